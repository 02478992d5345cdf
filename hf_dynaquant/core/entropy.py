"""Entropy coding of byte streams: zstandard where it pays, rANS for quantization codes.

Quantization codes (a few distinct byte values) are coded by :func:`encode_codes`: packed two
or more to a byte and then zstd-compressed (or left packed where zstd does not shrink them), or
order-0 rANS (:mod:`~hf_dynaquant.core.ans`) where it is clearly smaller. Everywhere else we
use zstd (well-kept, multi-GB/s decode, in every Python environment) as the entropy coder: at
level 1 its literals are Huffman-coded per 128 KiB block, so a byte stream with a skewed
histogram compresses close to its order-0 entropy, and its match finder still catches repeated
values. Streams that do not shrink (random mantissa bytes) are stored raw.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import zstandard

from ..errors import CorruptCheckpointError
from .ans import ans_coding, ans_decode, ans_encode, ans_lanes, lanes_for, table_symbols
from .bitplanes import PackedCodes, pack_bits, unpack_bits
from .histogram import byte_counts

__all__ = [
    "ans_bytes",
    "order0_bits",
    "entropy_bits",
    "encode_stream",
    "encode_symbols",
    "encode_codes",
    "encode_codes_packed",
    "codes_size_floor",
    "decode_stream",
    "decompress",
    "packed_bits",
    "RAW",
    "ZSTD",
    "ANS",
]

RAW = "raw"
ZSTD = "zstd"
ANS = ans_coding(1)  # order-0 rANS, one group (core/ans.py); ans_coding(L): in L lanes
PACK = "pack"  # "pack<N>": N-bit symbols packed densely, least significant bit first
# "pack<N>" and "pack<N>+<B>" (the same, each value plus B), in ASCII digits without leading zeros
_PACKED = re.compile(r"pack([1-8])(?:\+(0|[1-9][0-9]{0,2}))?")
_SAMPLE = 1 << 16

_PAYS = 0.995  # compress only when it saves at least 0.5%
_ANS_PAYS = 0.9  # rANS for codes only when it saves at least 10% over zstd (it decodes slower)
_SAMPLE_BLOCKS = 16  # blocks of _ESTIMATE_BLOCK bytes that estimate zstd's size of a long stream of codes
_ESTIMATE_BLOCK = 1 << 14
_CLEARLY = 0.97  # rANS skips zstd's trial when under _ANS_PAYS of that estimate by this margin too
_local = threading.local()


def _compressor(level: int = 1) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per thread and level, reused across calls
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode_stream(data: np.ndarray | bytes, level: int = 1) -> tuple[str, bytes]:
    """Return ``(coding, payload)``: zstd-compressed when that saves space, else the raw bytes.

    zstd level 1 gives up on incompressible input at well over 1 GB/s, so trying costs little;
    small, highly redundant streams (delta tokens) use a higher ``level``. zstd reads the array
    where it lies, with the GIL released; only a stream stored raw is copied (a copy holds the
    GIL, which a background save shares with the training loop).
    """
    buf = memoryview(np.ascontiguousarray(data).reshape(-1) if isinstance(data, np.ndarray) else data).cast("B")
    if not buf.nbytes:
        return RAW, b""
    packed = _compressor(level).compress(buf)
    if len(packed) <= _PAYS * buf.nbytes:
        return ZSTD, packed
    return RAW, bytes(buf)


def encode_symbols(values: np.ndarray, bits: int) -> tuple[str, bytes]:
    """Code a stream of ``bits``-bit symbols (one per byte).

    Near-uniform symbols (mantissa bits) are packed densely, which is as small as Huffman
    coding would make them and several times faster to decode; zstd is used only when a sample
    shows it wins clearly (skewed or repetitive symbols, e.g. many zeros).
    """
    if bits >= 8:
        return encode_stream(values)
    sample = values[:_SAMPLE]
    if sample.size and len(_compressor().compress(sample.tobytes())) < 0.97 * sample.size * bits / 8:
        coding, payload = encode_stream(values)
        if len(payload) < (values.size * bits + 7) // 8:
            return coding, payload
    return f"{PACK}{bits}", pack_bits(values, bits).tobytes()


def order0_bits(symbols: np.ndarray) -> float:
    """Total bits of uint8 ``symbols`` at their order-0 entropy: what rANS codes them in, to
    within its table and a few bytes."""
    return entropy_bits(byte_counts(symbols))


def ans_bytes(counts: np.ndarray) -> float:
    """The size an rANS payload (:func:`~hf_dynaquant.core.ans.ans_encode`) takes for symbols
    with these counts, one row per group (a 2-D array, a group per row; empty rows are no
    group): each group's order-0 entropy, which rANS reaches to within a few bytes, plus the
    exact table. Lets a coder choose between two streams without coding both. All the rows at
    once: a checkpoint's deltas ask this of hundreds of tensors, and row by row it held the
    interpreter lock about a tenth of a second of a 124M model's delta save."""
    rows = np.atleast_2d(counts)
    rows = rows[rows.any(axis=1)]
    if not rows.size:
        return 0.0
    total = rows.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -float(np.where(rows > 0, rows * np.log2(rows / total), 0.0).sum())
    used = table_symbols(rows)  # K = largest symbol + 1
    within = np.arange(rows.shape[1]) < used[:, None]
    table = int(_uleb128_length(rows[within]).sum() + _uleb128_length(used).sum())
    return bits / 8 + table + float(_uleb128_length(np.array([table]))[0])


def _uleb128_length(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's uleb128 encoding (7 bits a byte)."""
    top = np.floor(np.log2(np.maximum(values, 1).astype(np.float64))).astype(np.int64)
    return top // 7 + 1


def entropy_bits(counts: np.ndarray) -> float:
    """Total bits of symbols with these counts (one per symbol) at their order-0 entropy."""
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / counts.sum())).sum())


def encode_codes(codes: np.ndarray, counts: np.ndarray | None = None) -> tuple[str, bytes]:
    """``(stream coding, payload)`` of a stream of quantization codes: see :func:`encode_codes_packed`."""
    return encode_codes_packed(codes, counts)[:2]


def encode_codes_packed(codes: np.ndarray, counts: np.ndarray | None = None) -> tuple[str, bytes, PackedCodes | None]:
    """Code a stream of quantization codes: packed two, four or eight to a byte and then
    zstd-compressed where their codes span at most 16 values, zstd otherwise, or rANS where
    that is clearly smaller.

    zstd's literals are Huffman-coded a byte at a time, which on a few skewed levels costs up to
    a bit a byte over the entropy (at 10 levels about 7%), and its match finder walks every
    byte. Codes spanning at most ``2^N`` values (``N`` = 1, 2 or 4) are therefore packed ``N``
    bits a code from the smallest on (``"pack<N>+<B>"``, :func:`_packing`) first: a byte holds
    ``8 / N`` codes, whose joint Huffman code comes within about 1% of their entropy, and zstd walks
    ``N / 8`` of the bytes (on a 124M-parameter GPT-2's codes: 10% smaller than zstd of the
    codes, at a third of its time). Packed codes that zstd does not shrink (codes filling the
    range evenly, as Adam's update at two bins does) are stored packed. rANS reaches the order-0
    entropy, but decodes slower than zstd and packing: it is used when the codes' entropy
    (estimated from their histogram without coding them) is at most :data:`_ANS_PAYS` of
    zstd's size and it is smaller in fact. For a long stream of wider codes, which zstd takes
    one a byte, a sample of it estimates zstd's size (:func:`_zstd_estimate`), and codes whose
    entropy is that far under it, with the margin :data:`_CLEARLY`, skip zstd's trial of the
    whole stream.
    ``counts``: the codes' histogram where the caller has it (a delta's pair counts hold it).
    Without it, a long stream's histogram is taken from a sample of it (:func:`_sample`) for
    these choices, and counted in full only for rANS, which codes with it, or where a code that
    the sample missed leaves the packing's range (the packing finds it in its own pass).
    Returns ``(stream coding, payload, the codes packed)``: the codes as packed for the stream,
    where they were (whichever stream was kept: a keyframe keeps them for the next delta without
    a pass of its own), else None.
    """
    sample = _sample(codes) if counts is None else None
    exact = counts is not None or sample is None  # (else the sample's: rANS codes with the whole's)
    if counts is None:
        counts = byte_counts(codes if sample is None else sample)
    bits = entropy_bits(counts) / 8 * codes.size / max(int(counts.sum()), 1)  # (a sample's, scaled)
    lanes = lanes_for(codes.size)
    packing = _packing(counts)
    if packing is not None:
        width, base = packing
        try:
            packed = pack_bits(codes, width, base)
        except ValueError:  # (rANS refuses such a histogram too)
            if not exact:  # a code the sample missed
                return encode_codes_packed(codes, byte_counts(codes))
            top = base + (1 << width) - 1
            raise ValueError(f"codes outside {base} .. {top}: their histogram does not count them") from None
        coding, payload = encode_stream(packed)
        inner = f"{PACK}{width}+{base}"
        coding = inner if coding == RAW else f"{ZSTD}:{inner}"
        packed_codes: PackedCodes | None = PackedCodes(packed, width, base, int(codes.size))
    else:
        estimate = _zstd_estimate(codes, sample=sample)
        if estimate is not None and bits <= _ANS_PAYS * _CLEARLY * estimate:
            counts = counts if exact else byte_counts(codes)
            return ans_coding(lanes), ans_encode(codes, lanes=lanes, histograms=counts[None, :]), None
        coding, payload = encode_stream(codes)
        packed_codes = None
    if bits <= _ANS_PAYS * len(payload):
        counts = counts if exact else byte_counts(codes)
        ans = ans_encode(codes, lanes=lanes, histograms=counts[None, :])
        if len(ans) < len(payload):
            return ans_coding(lanes), ans, packed_codes
    return coding, payload, packed_codes


def _packing(counts: np.ndarray) -> tuple[int, int] | None:
    """``(N, B)``: codes with these counts packed ``N`` bits each (1, 2 or 4, so that a byte
    holds whole codes), as values less ``B``: their smallest, or ``256 - 2^N`` where the range
    ``B .. B + 2^N - 1`` would otherwise pass 255; ``None`` for fewer than two distinct codes
    (rANS codes one in no bytes) or codes spanning more than 16 values."""
    present = np.flatnonzero(counts)
    if present.size < 2:
        return None
    span = int(present[-1] - present[0]).bit_length()
    width = next((width for width in (1, 2, 4) if span <= width), None)
    # from the smallest code, or from lower where its range would pass 255 (a byte's codes)
    return None if width is None else (width, min(int(present[0]), 256 - (1 << width)))


def codes_size_floor(codes: np.ndarray, counts: np.ndarray) -> float | None:
    """An estimate of a size in bytes that :func:`encode_codes` does not code a long stream of
    codes with histogram ``counts`` under: rANS takes at least the order-0 entropy (a bound),
    zstd about what a sample of the stream, packed as :func:`encode_codes` packs it, measures
    (:func:`_zstd_estimate`, less the margin :data:`_CLEARLY`: an estimate, which structure the
    sample misses could beat; packed codes stored as they are take at least the entropy too).
    ``None`` for a stream too short to sample. Lets a delta that is smaller skip coding the
    keyframe it would be compared with."""
    estimate = _zstd_estimate(codes, _packing(counts))
    return None if estimate is None else min(entropy_bits(counts) / 8, _CLEARLY * estimate)


def _zstd_estimate(
    codes: np.ndarray, packing: tuple[int, int] | None = None, *, sample: np.ndarray | None = None
) -> float | None:
    """zstd's size for a stream of codes of at least :data:`_SAMPLE_BLOCKS` x
    :data:`_ESTIMATE_BLOCK` codes, from that many blocks of :data:`_ESTIMATE_BLOCK` codes spread
    evenly over it, scaled to its length (``None`` for a shorter stream: its whole trial is
    cheap); with ``packing`` (``(N, B)`` of :func:`_packing`), of the codes packed so first;
    ``sample``: their :func:`_sample`, where the caller has taken it.
    The sample is compressed as a stream of unknown size, so zstd keeps the parameters it uses
    for a long stream (told the sample's size, it picks smaller tables and estimates 2.6-6.2%
    high on average). Quantization codes are near-independent draws, so on a 124M-parameter
    GPT-2's codes the sample's size per byte was the whole stream's to within -1.3% to +2.7% at
    10-16 levels (means -0.6% to +0.2%) and -0.3% to +4.6% at 4 (blocks four times larger:
    -0.1% to +1.6%, at four times the cost; ``benchmarks/scale_session26_zstd_estimate.log``);
    structure the sample misses (a run of zeros covering less than the gap between two blocks)
    can make zstd smaller by more, which the margin :data:`_CLEARLY` covers up to 3%."""
    sample = _sample(codes) if sample is None else sample
    if sample is None:
        return None
    if packing is not None:
        width, base = packing
        sample = pack_bits(sample, width, base)
    stream = _compressor().compressobj()  # (no content size: the parameters of a long stream)
    return len(stream.compress(sample.tobytes()) + stream.flush()) * codes.size / (_SAMPLE_BLOCKS * _ESTIMATE_BLOCK)


def _sample(codes: np.ndarray) -> np.ndarray | None:
    """:data:`_SAMPLE_BLOCKS` blocks of :data:`_ESTIMATE_BLOCK` codes spread evenly over a
    stream, one after the other (``None`` for a stream shorter than that)."""
    flat = np.ascontiguousarray(codes).reshape(-1)
    if flat.size < _SAMPLE_BLOCKS * _ESTIMATE_BLOCK:
        return None
    starts = np.linspace(0, flat.size - _ESTIMATE_BLOCK, _SAMPLE_BLOCKS).astype(np.int64)
    return np.concatenate([flat[s : s + _ESTIMATE_BLOCK] for s in starts])


def decompress(payload: bytes | memoryview | np.ndarray, where: str, size: int) -> bytes:
    """One zstd frame that decodes to ``size`` bytes. Its header says how many it holds: more
    than ``size`` is refused before zstd allocates them (it would allocate what a damaged
    header claims, whatever the cap)."""
    try:
        if zstandard.frame_content_size(payload) > size:
            raise CorruptCheckpointError(f"{where}: zstd stream says it holds more than the {size} bytes expected")
        return _decompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: zstd stream cannot be decoded ({exc})") from None


def packed_bits(coding: str) -> int:
    """The symbol width of a ``pack<N>`` coding, 0 for any other coding (``pack<N>+<B>`` too)."""
    packed = _PACKED.fullmatch(coding)
    return int(packed[1]) if packed is not None and packed[2] is None else 0


def _packed_coding(coding: str) -> tuple[int, int] | None:
    """``(N, B)`` of a ``pack<N>`` (``B`` = 0) or ``pack<N>+<B>`` coding, else ``None``."""
    packed = _PACKED.fullmatch(coding)
    return None if packed is None else (int(packed[1]), int(packed[2] or 0))


def decode_stream(coding: str, payload: bytes | memoryview | np.ndarray, size: int, where: str) -> np.ndarray:
    """Inverse of :func:`encode_stream`, :func:`encode_symbols` and :func:`encode_codes`:
    ``size`` bytes as a uint8 array."""
    if coding == RAW:
        out = np.frombuffer(payload, dtype=np.uint8)
    elif coding == ZSTD:
        out = np.frombuffer(decompress(payload, where, size), dtype=np.uint8)
    elif lanes := ans_lanes(coding):
        try:
            out = ans_decode(payload, size, lanes=lanes)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from None
    elif (packing := _packed_coding(coding.removeprefix(f"{ZSTD}:"))) is not None:
        width, base = packing
        if base + (1 << width) - 1 > 255:
            raise CorruptCheckpointError(f"{where}: stream coding {coding!r} holds values past 255")
        if coding.startswith(f"{ZSTD}:"):  # zstd of the packed bytes
            payload = decompress(payload, where, (size * width + 7) // 8)
        try:
            out = unpack_bits(np.frombuffer(payload, dtype=np.uint8), width, size, base)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from None
    else:
        raise CorruptCheckpointError(f"{where}: unknown stream coding {coding!r}")
    if out.size != size:
        raise CorruptCheckpointError(f"{where}: stream decodes to {out.size} bytes, expected {size}")
    return out
