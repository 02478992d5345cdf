"""Memory freed during a long encode, handed back to the operating system as it goes.

glibc's malloc serves each thread from an arena of its own and, once a large block has been
freed, raises its mmap threshold to that block's size (up to 32 MB). From then on a tensor's
temporaries (float32 values, codes, coded streams) are carved from the pool threads' arenas and,
once freed, mostly stay there, fragmented between live blocks, so the resident set grows with
every tensor encoded, not with the few in flight. Measured at 124M parameters in bf16 (a save
runs 3 x 124M values through the encoder), back to back on one machine: a keyframe's peak extra
memory was 1.42x the checkpoint and a delta's 1.17x without trimming, 0.80x and 0.71x with
:class:`ReleaseFreed` trimming every 2^23 values, at about 2 s more for the keyframe (13.2 s
against 11.1 s: pages handed back are faulted in again when reused). ``MALLOC_MMAP_THRESHOLD_``
does the same, but it is the user's process-wide setting, not ours to change. A restore trims
while it converts the optimizer moments, every 2^25 values (``optimizer_state``): a pure-bf16
124M restore peaked at 1.08-1.10x its checkpoint without, 0.93-0.95x with, in the same CPU time
(trimming every tensor had cost an earlier restore 40% more time).

Handing pages back costs the faults that take them again: a save therefore keeps what it frees
while its resident set has grown by less than half its checkpoint (:data:`SAVE_ALLOWANCE`, see
:class:`ReleaseFreed` and :func:`save_allowance`: less for values narrower than float32), and
trims only past that.

``malloc_trim(0)`` returns the free pages of every arena (not only the top of the heap), taking
each arena's lock briefly in turn; it changes no allocator setting. Where the C library has no
``malloc_trim`` (macOS, musl) this does nothing.

On an accelerator, what we allocate beside training (a staged snapshot, the search's tensors)
must leave training's next step its memory: :func:`has_room`, :func:`cached_on_device`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "RESERVE",
    "SAVE_ALLOWANCE",
    "save_allowance",
    "TRIM_EVERY",
    "Computed",
    "ReleaseFreed",
    "cached_on_device",
    "has_room",
    "on_accelerator",
    "release_freed",
    "resident_bytes",
]

RESERVE = 0.10  # share of a CUDA device's memory that must stay free besides what we allocate there

TRIM_EVERY = 1 << 23  # values processed between two trims
SAVE_ALLOWANCE = 0.5  # share of its checkpoint's bytes a save may grow the resident set by before trimming


def save_allowance(nbytes: int, values: int) -> int:
    """The allowance (bytes, :class:`ReleaseFreed`) of a save of a checkpoint of ``nbytes`` bytes
    holding ``values`` values: :data:`SAVE_ALLOWANCE` of its bytes, times its bytes a value
    against float32's 4 where they are fewer. A save's temporaries are float32 forms and codes
    whatever the checkpoint's dtype, so a pure-bfloat16 checkpoint's are twice its own share of
    a float32 one's: with half its bytes kept on top of them, a 124M pure-bf16 keyframe peaked at
    up to 0.93x its checkpoint (its embedding's Adam update and scale in float32 in flight), with
    a quarter at 0.55-0.79x (``benchmarks/RESULTS.md``, session 48)."""
    if values <= 0:
        return 0
    return int(SAVE_ALLOWANCE * nbytes * min(1.0, nbytes / (4 * values)))


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


class ReleaseFreed:
    """Counts the values a loop has processed (and freed the temporaries of) and hands freed
    memory back to the operating system every ``every`` of them (default :data:`TRIM_EVERY`).
    Used by one thread (the one running the loop); the trim itself is safe from any thread.

    With an ``allowance`` (bytes), a count that comes due hands memory back only once the
    process's resident set has grown more than that since this object was made (read from
    ``/proc/self/statm``; where it cannot be read, every time, as without one): freed pages kept
    are reused without a page fault, each of which the kernel zeroes first. A
    :class:`~hf_dynaquant.training.compressor.Compressor` makes one for each save before its
    plan, allowing :func:`save_allowance` of the checkpoint, and its optimizer-state decisions
    and its write go on with it, so the growth counted is the whole save's. Measured at 124M in
    alternating ``bench_scale.py`` runs (session 42): float32 keyframes 1.25-1.39 s against
    1.51-1.61 s (CPU 1.91-2.10 s against 2.27-2.41 s), peak extra memory 0.36-0.45x the checkpoint
    against 0.22-0.24x; pure-bfloat16 keyframes 1.53-1.70 s against 1.58-2.01 s and deltas
    1.72-1.92 s against 1.96-2.18 s, peaks up to 0.87x against 0.74x. A save whose own
    temporaries pass the allowance trims as often as one without."""

    def __init__(self, every: int | None = None, allowance: int | None = None) -> None:
        self.every, self._since = every if every is not None else TRIM_EVERY, 0
        self.allowance = allowance
        self._start = resident_bytes() if allowance is not None else None

    def processed(self, values: int) -> None:
        self._since += values
        if self._since < self.every:
            return
        self._since = 0
        if self._start is not None and self.allowance is not None:
            now = resident_bytes()
            if now is not None and now - self._start <= self.allowance:
                return
        release_freed()


def resident_bytes() -> int | None:
    """The process's resident set in bytes (Linux's ``/proc/self/statm``), or None where that
    cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release_freed() -> None:
    """Hand the memory freed so far back to the operating system now (``malloc_trim(0)``; see the
    module docstring): at the end of a checkpoint's search and of its write, so that what they
    freed is not held between checkpoints (at 124M, 0.9x the checkpoint otherwise)."""
    if _TRIM is not None:
        _TRIM(0)


def has_room(device: torch.device, nbytes: int) -> bool:
    """Whether CUDA ``device`` has ``nbytes`` free outside PyTorch's cache, besides :data:`RESERVE`
    of its memory: training's own cached blocks stay its own, so its next step allocates as it
    did before."""
    free, total = torch.cuda.mem_get_info(device)
    return free >= nbytes + RESERVE * total


def on_accelerator(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The CUDA device that holds all of ``tensors`` (at least one), else None."""
    devices = {t.device for t in tensors}
    device = devices.pop() if len(devices) == 1 else None
    return device if device is not None and device.type == "cuda" else None


def cached_on_device(
    cache: dict[Any, Any], key: tuple, host: Callable[[], np.ndarray | torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """A flat copy of ``host()`` on ``device`` (floating point as float32), kept in ``cache``
    under ``("on device", *key)`` (a checkpoint's search keeps one per tensor, residual kind
    and what it is, and frees them with the cache); None when a CUDA device has no room for it
    besides its reserve (:func:`has_room`). ``host`` is called only when the key is not cached
    (a sensitivity is computed from the weights each time it is asked for)."""
    key = ("on device", *key)
    if key not in cache:
        t = torch.as_tensor(host())
        t = t.float() if t.is_floating_point() else t
        fits = device.type != "cuda" or has_room(device, t.numel() * t.element_size())
        cache[key] = t.to(device).reshape(-1) if fits else None
    return cache[key]


class Computed(Mapping[str, torch.Tensor]):
    """Named tensors made each time one is read and never held: for values as large as the
    weights that a checkpoint's planning and search read a tensor at a time (the sensitivities
    ``|EMA(g) * w|`` of :meth:`~hf_dynaquant.training.snapshot.Snapshot.sensitivity`, the
    previous checkpoint's weights decoded from its kept codes). Holding them all took the
    weights' size in float32 each (measured: 0.37x a checkpoint per sensitivity kind, 0.33x for
    the previous weights, on top of the snapshot); making one again costs a pass over its
    values. ``makers`` maps each name to what makes it."""

    def __init__(self, makers: Mapping[str, Callable[[], torch.Tensor]]) -> None:
        self._makers = makers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __contains__(self, name: object) -> bool:  # (Mapping's would make the tensor)
        return name in self._makers
