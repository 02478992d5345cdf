"""Counts of uint8 symbols (quantization codes and their deltas): the histograms the rANS
models, the entropy estimates and the delta's groups are made of. ``np.bincount`` converts
every byte to a 64-bit index first; the compiled kernel counts the bytes as they are."""

from __future__ import annotations

import numpy as np

from .kernels import native

__all__ = ["byte_counts"]


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
