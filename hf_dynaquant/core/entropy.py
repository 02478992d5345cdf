"""Entropy coding of byte streams with zstandard, used only where it pays.

We use zstd (well-kept, multi-GB/s decode, in every Python environment) as the entropy coder:
at level 1 its literals are Huffman-coded per 128 KiB block, so a byte stream with a skewed
histogram compresses close to its order-0 entropy, and its match finder still catches repeated
values. Streams that do not shrink (random mantissa bytes) are stored raw.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ..errors import CorruptCheckpointError

__all__ = ["encode_stream", "decode_stream", "RAW", "ZSTD"]

RAW = "raw"
ZSTD = "zstd"

_PAYS = 0.995  # compress only when it saves at least 0.5%
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per thread, reused across calls
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=1, write_checksum=False, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode_stream(data: np.ndarray | bytes) -> tuple[str, bytes]:
    """Return ``(coding, payload)``: zstd-compressed when that saves space, else the raw bytes.

    zstd level 1 gives up on incompressible input at well over 1 GB/s, so trying costs little.
    """
    buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if not buf:
        return RAW, b""
    packed = _compressor().compress(buf)
    if len(packed) <= _PAYS * len(buf):
        return ZSTD, packed
    return RAW, buf


def decode_stream(coding: str, payload: bytes | memoryview | np.ndarray, size: int, where: str) -> np.ndarray:
    """Inverse of :func:`encode_stream`: ``size`` bytes as a uint8 array."""
    if coding == RAW:
        out = np.frombuffer(payload, dtype=np.uint8)
    elif coding == ZSTD:
        try:
            out = np.frombuffer(_decompressor().decompress(payload, max_output_size=size), dtype=np.uint8)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{where}: zstd stream cannot be decoded ({exc})") from None
    else:
        raise CorruptCheckpointError(f"{where}: unknown stream coding {coding!r}")
    if out.size != size:
        raise CorruptCheckpointError(f"{where}: stream decodes to {out.size} bytes, expected {size}")
    return out
