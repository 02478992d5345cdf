"""Bit-plane transforms that make float and integer tensors entropy-codable, losslessly.

NeuZip (papers/003) observes that in trained weights the exponent carries about 2.6 of its
8 bits of information while sign and mantissa are close to random; so it splits the exponent
out and entropy-codes only that. We go one step further, with a layout that a byte-oriented
entropy coder (zstd's Huffman stage) exploits fully and that splits and joins in a few passes:

* the exponent is replaced by its *rank* in the chunk's own exponent histogram (most frequent
  exponent -> 0), capped at ``2**(8-k) - 1``; rarer exponents are escaped to a side stream;
* the rank and the top ``k`` mantissa bits share one **head** byte. Within one binade the
  leading mantissa bits of bell-shaped weights are not uniform, so coding them jointly with the
  exponent saves about 0.07 bit/value, and the wider alphabet shrinks Huffman's rounding loss;
* the other bits of the value's upper 16 (sign and the next mantissa bits) form the **side**
  byte (``16 - E - k`` bits used), and the value's lower ``W - 16`` bits are the **rest**
  stream (for fp64: all low 32-bit words, then all 16-bit words), little-endian, stored raw
  unless they compress (repeated values do).

Both head and side are one table lookup on the upper 16 bits, and decoding is two lookups and a
byte copy. fp32: head + side (6 bits) + 2 rest bytes; bf16 and fp16: head + side; fp64: head +
side (3 bits) + 6 rest bytes. Integer tensors are split into byte planes (LSB first), which makes
small integers compressible.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .dtypes import FloatLayout
from .kernels import native

__all__ = [
    "FloatPlanes",
    "split_float",
    "join_float",
    "split_bytes",
    "join_bytes",
    "head_bits",
    "side_bits",
    "PackedCodes",
    "pack_bits",
    "unpack_bits",
]

_STRIDE = 4
_UINT = {8: np.dtype("u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4"), 64: np.dtype("<u8")}
_UPPER = np.arange(1 << 16, dtype=np.uint32)  # every possible upper-16-bit pattern


def head_bits(layout: FloatLayout) -> int:
    """How many top mantissa bits share the head byte with the exponent rank."""
    return max(2, 8 - layout.exponent_bits)


@dataclass
class FloatPlanes:
    """The split form of a float chunk (see the module docstring)."""

    head: np.ndarray  # uint8: exponent rank << k | top k mantissa bits
    table: list[int]  # exponent value of each rank, most frequent first
    escapes: np.ndarray  # <u2: exponents of elements whose rank is the cap
    side: np.ndarray  # uint8: the rest of the upper 16 bits, sign in the top used bit
    rest: np.ndarray  # uint8, (W-16)/8 little-endian bytes per element
    side_packed: int = 0  # 0: one side byte per element; b > 0: side is packed, b bits each


def _rest_fields(width: int) -> list[tuple[int, int]]:
    """(lowest bit, width) of the fields of the lower ``width - 16`` bits, stored one after the
    other in the rest stream; whole machine words so that split and join are plain casts."""
    return {16: [], 32: [(0, 16)], 64: [(0, 32), (32, 16)]}[width]


def side_bits(layout: FloatLayout) -> int:
    """Bits used in each side byte: the mantissa bits below the head's, plus the sign."""
    return 16 - layout.exponent_bits - head_bits(layout)


@functools.cache
def _split_tables(layout: FloatLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every upper-16-bit pattern: its exponent, its top k mantissa bits, its side byte."""
    exp, k, sb = layout.exponent_bits, head_bits(layout), side_bits(layout)
    exponent_of = ((_UPPER >> (15 - exp)) & ((1 << exp) - 1)).astype(np.uint16)
    top_bits = ((_UPPER >> (sb - 1)) & ((1 << k) - 1)).astype(np.uint8)
    side = ((_UPPER & ((1 << (sb - 1)) - 1)) | ((_UPPER >> 15) << (sb - 1))).astype(np.uint8)
    return exponent_of, top_bits, side


def _split_float_numpy(bits: np.ndarray, layout: FloatLayout) -> FloatPlanes:
    """Reference implementation of :func:`split_float` in numpy."""
    width, exp = layout.width, layout.exponent_bits
    k = head_bits(layout)
    cap = (1 << (8 - k)) - 1
    x = bits.view(_UINT[width])
    upper = x if width == 16 else (x >> (width - 16)).astype(np.uint16)
    sample = upper[:: _stride(upper.size)]
    table, rank = _rank_table(np.bincount((sample >> (15 - exp)) & ((1 << exp) - 1), minlength=1 << exp), cap)
    exponent_of, top_bits, side_lut = _split_tables(layout)
    head_lut = (np.take(rank, exponent_of) << np.uint8(k)) | top_bits
    head = np.take(head_lut, upper, mode="clip")
    side = np.take(side_lut, upper, mode="clip")
    escaped = np.flatnonzero(head >= cap << k)
    escapes = ((upper[escaped] >> (15 - exp)) & ((1 << exp) - 1)).astype("<u2")
    rest = [(x >> lo).astype(_UINT[bits]).view(np.uint8) for lo, bits in _rest_fields(width)]
    return FloatPlanes(
        head,
        table,
        escapes,
        side,
        np.concatenate(rest) if len(rest) > 1 else (rest[0] if rest else np.empty(0, np.uint8)),
    )


def _join_float_numpy(planes: FloatPlanes, layout: FloatLayout, out: np.ndarray | None = None) -> np.ndarray:
    """Reference implementation of :func:`join_float` in numpy."""
    if planes.side_packed:
        side = unpack_bits(planes.side, planes.side_packed, planes.head.size)
        planes = FloatPlanes(planes.head, planes.table, planes.escapes, side, planes.rest)
    width, exp = layout.width, layout.exponent_bits
    k, sb = head_bits(layout), side_bits(layout)
    cap = (1 << (8 - k)) - 1
    utype = _UINT[width]
    head, side = planes.head, planes.side
    n = head.size
    rest_bytes = width // 8 - 2
    if len(planes.table) > cap:
        raise ValueError(f"rank table has {len(planes.table)} entries, at most {cap} allowed")
    if side.size != n or planes.rest.size != n * rest_bytes:
        raise ValueError(f"planes hold {n}, {side.size} and {planes.rest.size} bytes: they disagree")
    shift = width - 16  # where the upper 16 bits sit
    exponents = np.zeros(cap + 1, dtype=utype)
    exponents[: len(planes.table)] = planes.table
    code = np.arange(256, dtype=utype)
    head_lut = (exponents[code >> k] << (15 - exp + shift)) | ((code & ((1 << k) - 1)) << (sb - 1 + shift))
    side_lut = ((code & ((1 << (sb - 1)) - 1)) | ((code >> (sb - 1) & 1) << 15)) << shift
    x = np.take(head_lut, head, out=out, mode="clip")  # "clip" avoids a buffered copy; indices are bytes
    x |= np.take(side_lut, side, mode="clip")
    pos = 0
    for lo, bits in _rest_fields(width):
        field = planes.rest[pos : pos + n * bits // 8].view(_UINT[bits])
        pos += field.nbytes
        x |= field.astype(utype) << lo if lo else field
    if planes.escapes.size:  # (without escapes no head byte reaches the cap; checksums guard the data)
        escaped = np.flatnonzero(head >= cap << k)
        if escaped.size != planes.escapes.size:
            raise ValueError(f"{planes.escapes.size} escaped exponents stored, {escaped.size} needed")
        x[escaped] |= planes.escapes.astype(utype) << (15 - exp + shift)
    return x


def _stride(n: int) -> int:
    """Ranking needs no exact counts: large chunks count every 4th element."""
    return _STRIDE if n > _STRIDE * 4096 else 1


def _rank_table(counts: np.ndarray, cap: int) -> tuple[list[int], np.ndarray]:
    """Exponents by decreasing count (at most ``cap``), and the rank of every exponent."""
    order = np.argsort(-counts, kind="stable")
    table = order[: min(cap, int(np.count_nonzero(counts)))]
    rank = np.full(counts.size, cap, dtype=np.uint8)
    rank[table] = np.arange(table.size, dtype=np.uint8)
    return [int(t) for t in table], rank


def split_float(bits: np.ndarray, layout: FloatLayout) -> FloatPlanes:
    """Split raw float bits (``uint16/32/64``, flat, contiguous) into :class:`FloatPlanes`."""
    if native is None:
        return _split_float_numpy(bits, layout)
    width, exp, k = layout.width, layout.exponent_bits, head_bits(layout)
    x = np.ascontiguousarray(bits.view(_UINT[width]))
    n = x.size
    counts = np.zeros(1 << exp, dtype=np.int64)
    native.histogram(x, _stride(n), counts, width, exp)
    table, rank = _rank_table(counts, (1 << (8 - k)) - 1)
    head, side = np.empty(n, np.uint8), np.empty(n, np.uint8)
    rest, escapes = np.empty(n * (width // 8 - 2), np.uint8), np.empty(n, "<u2")
    found = native.split(x, width, exp, k, rank, head, side, rest, escapes)
    return FloatPlanes(head, table, escapes[:found].copy(), side, rest)


def join_float(planes: FloatPlanes, layout: FloatLayout, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`split_float`: the raw bits as a flat unsigned array (into ``out`` if given).

    Raises ``ValueError`` when the parts are inconsistent (the caller names the tensor).
    """
    if native is None:
        return _join_float_numpy(planes, layout, out)
    width, exp, k = layout.width, layout.exponent_bits, head_bits(layout)
    cap = (1 << (8 - k)) - 1
    n = planes.head.size
    if len(planes.table) > cap:
        raise ValueError(f"rank table has {len(planes.table)} entries, at most {cap} allowed")
    if planes.rest.size != n * (width // 8 - 2):
        raise ValueError(f"rest stream holds {planes.rest.size} bytes, {n} elements need {n * (width // 8 - 2)}")
    exponents = np.zeros(cap + 1, dtype="<u2")
    exponents[: len(planes.table)] = planes.table
    x = np.empty(n, dtype=_UINT[width]) if out is None else out
    escapes = np.ascontiguousarray(planes.escapes, dtype="<u2")
    used = native.join(
        x,
        width,
        exp,
        k,
        exponents,
        np.ascontiguousarray(planes.head),
        np.ascontiguousarray(planes.side),
        planes.side_packed,
        np.ascontiguousarray(planes.rest),
        escapes,
    )
    if used != escapes.size:
        raise ValueError(f"{escapes.size} escaped exponents stored, {'more' if used < 0 else used} needed")
    return x


def pack_bits(values: np.ndarray, bits: int, base: int = 0) -> np.ndarray:
    """``bits``-bit values (one per byte) less ``base`` packed densely, least significant bit
    first. Raises ``ValueError`` for a value outside ``base .. base + 2^bits - 1`` (checked in
    the packing's own pass)."""
    values = np.ascontiguousarray(values, dtype=np.uint8)
    out = np.empty((values.size * bits + 7) // 8, dtype=np.uint8)
    if native is not None:
        fits = native.pack(values, bits, out, base)
    else:
        shifted = values - np.uint8(base)
        fits = bits == 8 or not np.any(shifted >> np.uint8(bits))
        planes = (shifted[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
        out = np.packbits(planes.reshape(-1), bitorder="little")
    if not fits:
        raise ValueError(f"values outside {base} .. {base + (1 << bits) - 1} cannot be packed in {bits} bits")
    return out


class PackedCodes(NamedTuple):
    """``size`` codes as :func:`pack_bits` packs them, ``width`` bits each less ``base``."""

    data: np.ndarray
    width: int
    base: int
    size: int

    def unpacked(self) -> np.ndarray:
        return unpack_bits(self.data, self.width, self.size, self.base)


def unpack_bits(packed: np.ndarray, bits: int, count: int, base: int = 0) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` values of ``bits`` bits, each plus ``base``
    (``base + 2^bits - 1`` at most 255)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    if packed.size != (count * bits + 7) // 8:
        raise ValueError(f"{packed.size} packed bytes cannot hold exactly {count} values of {bits} bits")
    if base + (1 << bits) - 1 > 255:
        raise ValueError(f"{bits}-bit values plus {base} pass 255")
    if native is not None:
        out = np.empty(count, dtype=np.uint8)
        native.unpack(packed, bits, out, base)
        return out
    planes = np.unpackbits(packed, bitorder="little", count=count * bits).reshape(count, bits)
    out = (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    return out + np.uint8(base) if base else out


def split_bytes(bits: np.ndarray) -> list[np.ndarray]:
    """Byte planes of a flat unsigned array, least significant first."""
    size = bits.dtype.itemsize
    if size == 1:
        return [bits.view(np.uint8)]
    return list(bits.view(np.uint8).reshape(-1, size).T.copy())


def join_bytes(planes: list[np.ndarray], size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`split_bytes` for elements of ``size`` bytes (into ``out`` if given)."""
    n = planes[0].size if planes else 0
    if any(p.size != n for p in planes) or len(planes) != size:
        raise ValueError("byte planes disagree in length or count")
    if out is None:
        out = np.empty(n, dtype=_UINT[8 * size])
    out.view(np.uint8).reshape(-1, size).T[:] = planes
    return out
