"""Unsigned LEB128 varints: 7 bits per byte, high bit set on all but the last.

Used for run-length tokens (:mod:`~hf_dynaquant.core.delta`), for the frequency tables of the
rANS coder (:mod:`~hf_dynaquant.core.entropy`) and for length prefixes: small integers take one
byte. The compiled kernels code them where they are built; the numpy code is their reference
(about twenty array operations a call, which on the few-value arrays a save codes hundreds of
times cost more than the values).
"""

from __future__ import annotations

import numpy as np

from .kernels import native

__all__ = ["uleb128_encode", "uleb128_decode", "length_prefixed", "split_prefixed"]

_MAX_BYTES = 10  # a uint64 needs at most ten 7-bit groups


def uleb128_encode(values: np.ndarray) -> np.ndarray:
    """The LEB128 bytes of non-negative integers, as one uint8 array."""
    u = np.ascontiguousarray(np.asarray(values).astype(np.uint64)).reshape(-1)
    if native is not None:
        out = np.empty(_MAX_BYTES * u.size, dtype=np.uint8)
        return out[: native.uleb128_encode_u64(u, out)]
    nbytes = np.ones(u.size, dtype=np.int64)
    for j in range(1, _MAX_BYTES):
        nbytes += u >= (np.uint64(1) << np.uint64(7 * j))
    pos = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for j in range(int(nbytes.max(initial=0))):
        sel = nbytes > j
        more = (nbytes[sel] > j + 1).astype(np.uint8) << 7
        out[pos[sel] + j] = ((u[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8) | more
    return out


def uleb128_decode(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`uleb128_encode` (uint64); ``ValueError`` on a truncated stream."""
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if native is not None:
        out = np.empty(b.size, dtype=np.uint64)
        count = native.uleb128_decode_u64(b, out)
        if count < 0:
            raise ValueError("varint stream is truncated" if count == -1 else "varint longer than 64 bits")
        return out[:count]
    if b.size and b[-1] & 0x80:
        raise ValueError("varint stream is truncated")
    ends = np.flatnonzero(b < 0x80)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.size and int(lengths.max()) > _MAX_BYTES:
        raise ValueError("varint longer than 64 bits")
    u = np.zeros(ends.size, dtype=np.uint64)
    for j in range(int(lengths.max(initial=0))):
        sel = lengths > j
        u[sel] |= (b[starts[sel] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    return u


def length_prefixed(body: bytes) -> bytes:
    """``uleb128(len(body))``, then ``body``: a part of a blob that a reader must find the end of
    (an rANS stream's table, a gap stream's token counts)."""
    return uleb128_encode(np.array([len(body)], dtype=np.uint64)).tobytes() + body


def split_prefixed(data: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`length_prefixed` at the start of ``data`` (uint8): ``(body, the rest)``.
    ``ValueError`` naming ``what`` when there is no length or the body runs past the end."""
    first = int(np.argmax(data[:_MAX_BYTES] < 0x80)) + 1 if data.size else 0
    if first == 0 or data[first - 1] & 0x80:
        raise ValueError(f"{what} length is missing")
    end = first + int(uleb128_decode(data[:first])[0])
    if end > data.size:
        raise ValueError(f"{what} runs past the end of its blob")
    return data[first:end], data[end:]
