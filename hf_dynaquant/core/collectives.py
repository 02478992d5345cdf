"""The few ``torch.distributed`` collectives the package uses, each a no-op in one process.

Every rank must call a collective together. Objects exchanged with ``*_object`` collectives are
pickled between the job's own processes only; nothing read from disk is ever unpickled.

A thread that makes collectives while another thread of the same process makes its own (a
background writer beside the training loop's FSDP all-gathers) must use a process group of its
own, or the two threads' calls would pair up with the wrong calls on the other ranks:
:func:`new_group` makes one (collectively, in the training thread), and inside
``with on_group(group):`` every collective of this module that the thread makes goes through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = [
    "rank_world",
    "is_distributed",
    "all_sum",
    "all_max",
    "all_gather",
    "broadcast",
    "barrier",
    "new_group",
    "on_group",
]

_thread = threading.local()  # .group: this thread's process group (None: the default one)


def new_group() -> Any:
    """A new gloo process group of all the ranks, for a thread's own collectives (see the module
    docstring). Collective: every rank creates it together, in the same order as any other
    group. gloo, whatever the training uses: the collectives here are small CPU ones, and a
    second NCCL communicator would cost GPU memory."""
    return torch.distributed.new_group(backend="gloo")


@contextmanager
def on_group(group: Any) -> Iterator[None]:
    """This thread's collectives go through ``group`` inside the block (``None``: the default
    group)."""
    before = getattr(_thread, "group", None)
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = before


def _group() -> Any:
    return getattr(_thread, "group", None)


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialized process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        group = _group()
        return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return 0, 1


def is_distributed() -> bool:
    """Whether several processes work together."""
    return rank_world()[1] > 1


def _device() -> torch.device:
    """Where tensors for collectives live: the current GPU under NCCL, else the CPU."""
    if torch.distributed.get_backend(_group()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: np.ndarray, op: Any) -> np.ndarray:
    if rank_world()[1] == 1:
        return np.asarray(values, dtype=np.float64)
    # a copy, never a view of the numpy array: gloo's worker thread may drop the last reference
    # to the tensor, and freeing numpy-owned memory needs the GIL (fatal during interpreter exit)
    t = torch.tensor(np.asarray(values, dtype=np.float64), device=_device())
    torch.distributed.all_reduce(t, op=op, group=_group())
    return t.cpu().numpy()


def all_sum(values: np.ndarray) -> np.ndarray:
    """Element-wise float64 sum of ``values`` over the ranks (an all-reduce)."""
    return _all_reduce(values, torch.distributed.ReduceOp.SUM if torch.distributed.is_available() else None)


def all_max(values: np.ndarray) -> np.ndarray:
    """Element-wise float64 maximum of ``values`` over the ranks (an all-reduce)."""
    return _all_reduce(values, torch.distributed.ReduceOp.MAX if torch.distributed.is_available() else None)


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    size = rank_world()[1]
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    torch.distributed.all_gather_object(out, obj, group=_group())
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, group=_group())
    return box[0]


def barrier() -> None:
    """Wait until every rank arrives."""
    if rank_world()[1] > 1:
        torch.distributed.barrier(group=_group())
