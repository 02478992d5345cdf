"""Counts of uint8 symbols (quantization codes and their deltas): the histograms the rANS
models, the entropy estimates and the delta's groups are made of. ``np.bincount`` converts
every byte to a 64-bit index first; the compiled kernel counts the bytes as they are."""

from __future__ import annotations

import numpy as np

from .kernels import native

__all__ = ["byte_counts", "pair_counts"]


def byte_counts(symbols: np.ndarray, minlength: int = 1) -> np.ndarray:
    """``np.bincount(symbols, minlength=minlength)`` of uint8 ``symbols`` (int64 counts, as
    long as the largest symbol present plus one, at least ``minlength``)."""
    flat = np.ascontiguousarray(symbols, dtype=np.uint8).ravel()
    if native is None:
        return np.bincount(flat, minlength=minlength)
    counts = np.zeros(256, dtype=np.int64)
    native.byte_counts(flat, counts)
    present = np.flatnonzero(counts)
    length = max(int(present[-1]) + 1 if present.size else 0, minlength)
    return counts[:length] if length <= 256 else np.concatenate((counts, np.zeros(length - 256, np.int64)))


def pair_counts(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``counts[key, value]`` (256 x 256, int64) of the pairs of two uint8 arrays of one size."""
    k = np.ascontiguousarray(keys, dtype=np.uint8).ravel()
    v = np.ascontiguousarray(values, dtype=np.uint8).ravel()
    if k.size != v.size:
        raise ValueError(f"{k.size} keys for {v.size} values")
    if native is None:
        return np.bincount(k.astype(np.int64) * 256 + v, minlength=65536).reshape(256, 256)
    counts = np.zeros(65536, dtype=np.int64)
    native.pair_counts(k, v, counts)
    return counts.reshape(256, 256)
