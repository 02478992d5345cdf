"""The few ``torch.distributed`` collectives the package uses, each a no-op in one process.

Every rank must call a collective together. Objects exchanged with ``*_object`` collectives are
pickled between the job's own processes only; nothing read from disk is ever unpickled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["rank_world", "is_distributed", "all_sum", "all_max", "all_gather", "broadcast", "barrier"]


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialized process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    """Whether several processes work together."""
    return rank_world()[1] > 1


def _device() -> torch.device:
    """Where tensors for collectives live: the current GPU under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: np.ndarray, op: Any) -> np.ndarray:
    if rank_world()[1] == 1:
        return np.asarray(values, dtype=np.float64)
    # a copy, never a view of the numpy array: gloo's worker thread may drop the last reference
    # to the tensor, and freeing numpy-owned memory needs the GIL (fatal during interpreter exit)
    t = torch.tensor(np.asarray(values, dtype=np.float64), device=_device())
    torch.distributed.all_reduce(t, op=op)
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
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait until every rank arrives."""
    if rank_world()[1] > 1:
        torch.distributed.barrier()
