"""The process-wide random number generators, saved and restored around work that must not draw
from them.

torch's default CPU and CUDA generators, :mod:`random` and numpy's legacy global state are shared
by every thread of a process. Training owns them (dropout, data order, augmentation), so only the
thread that trains may save and restore them: a background thread that restored a state it saved
earlier would rewind draws the training loop made in the meantime. :func:`preserved_rng` is for
that owning thread; code on other threads must not draw from these generators at all.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["preserved_rng"]


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the body, then put every process-wide RNG state back as it was before (call it only
    from the thread that owns them, see the module docstring)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py, np_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        np.random.set_state(np_state)
