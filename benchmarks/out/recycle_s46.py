"""Large temporaries that reuse the memory of earlier ones, within an encode or a decode.

A save makes, for every large tensor, temporaries as large as the tensor or a quarter of it:
Adam's update (4 bytes a value), the codes (1 byte a value), a delta's regrouped differences
(1 byte a value). Each is new memory, and new memory costs a page fault and a page of zeroes
from the kernel for every 4 KB first written (for ``numpy``'s large arrays, a 2 MB page
zeroed at once): glibc hands a block of more than its mmap threshold (at most 32 MB) back to
the kernel when it is freed, and a thread's arena gives its freed top back too. Measured with
``perf`` on a 124M float32 delta (session 46): 120,000 page faults, the kernel zeroing pages
for 12% of the save's CPU time (a keyframe: 7%).

Inside :func:`recycling` (the store's write and read hold it while they code tensors), a
buffer from :func:`empty` or :func:`empty_tensor` takes a block that an earlier one left,
already faulted in, when one is free and large enough. A block is free when nothing refers to
it but this module: every array or tensor made of it holds a reference to it (a ``numpy``
view keeps its base, a tensor from ``numpy`` keeps the array), so the count of references
tells it without any call to give a buffer back. Outside, and for buffers under
:data:`SMALLEST`, they are plain new memory. The blocks are let go when the last
:func:`recycling` ends, so nothing is held between saves; while one runs, the free blocks
kept are at most :data:`KEEP` bytes.

The blocks are uninitialised, like ``numpy.empty``'s: a buffer taken is written in full by
its maker before it is read.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from .pool import reset_after_fork

__all__ = ["SMALLEST", "KEEP", "recycling", "empty", "empty_tensor"]

SMALLEST = 32 << 20  # bytes: glibc keeps freed smaller blocks in its arenas for reuse (its mmap threshold rises to 32 MB)
KEEP = 1 << 30  # bytes of blocks kept at most while a recycling runs
_WASTE = 2  # a free block serves buffers down to half its size
# references to a free block: the list that holds it, and sys.getrefcount's argument
_FREE = 2


class _Blocks:
    """The blocks kept, and how many :func:`recycling` are running (one per process)."""

    def __init__(self) -> None:
        self.after_fork()
        reset_after_fork(self)

    def after_fork(self) -> None:
        # a lock a parent's thread held would stay held in the child (the blocks are the child's copies)
        self.lock, self.blocks, self.users = threading.Lock(), [], 0

    def take(self, nbytes: int) -> np.ndarray:
        """The smallest free block of ``nbytes`` to ``_WASTE`` times that, else a new block
        (kept while the blocks kept stay under :data:`KEEP`). (A buffer may outlive the
        recycling, e.g. codes a compressor keeps for its next delta: it holds no more than
        ``_WASTE`` times its size.)"""
        with self.lock:
            if not self.users:
                return np.empty(nbytes, dtype=np.uint8)
            best = None
            for i in range(len(self.blocks)):  # (indexed: a loop variable would be one more reference)
                size = self.blocks[i].nbytes
                if nbytes <= size <= _WASTE * nbytes and (best is None or size < self.blocks[best].nbytes):
                    if sys.getrefcount(self.blocks[i]) == _FREE:
                        best = i
            if best is not None:
                return self.blocks[best]
            block = np.empty(nbytes, dtype=np.uint8)
            if sum(b.nbytes for b in self.blocks) + block.nbytes <= KEEP:
                self.blocks.append(block)
            return block

    def enter(self) -> None:
        with self.lock:
            self.users += 1

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            if not self.users:
                self.blocks = []  # (a block still in use is freed with its last buffer)


_BLOCKS = _Blocks()


@contextmanager
def recycling() -> Iterator[None]:
    """Let the buffers of :func:`empty` and :func:`empty_tensor` reuse each other's memory
    while this runs (in any thread: a save's pool threads make them); nested and concurrent
    uses count, and the blocks are let go when the last one ends."""
    _BLOCKS.enter()
    try:
        yield
    finally:
        _BLOCKS.leave()


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised array, like ``numpy.empty`` (C order), on a recycled block where it can."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < SMALLEST:
        return np.empty(shape, dtype=dtype)
    return _BLOCKS.take(nbytes)[:nbytes].view(dtype).reshape(shape)


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, like ``torch.empty``, on a recycled block where it can
    (any dtype: made as bytes and viewed as ``dtype``)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = int(np.prod(shape, dtype=np.int64))
    if count * itemsize < SMALLEST:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(empty(count * itemsize, np.uint8)).view(dtype).reshape(shape)
