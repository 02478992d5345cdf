"""The compiled kernels (C sources in ``hf_dynaquant/core/csrc/``), or ``None`` without them.

They are built at install as the optional extension ``hf_dynaquant.core._kernels`` (see
setup.py): single-pass versions of the bit-plane split and join, the log sketch and the
DynaQuant partition, each computing exactly what its numpy reference computes. Without a C
compiler, or on a big-endian machine (the kernels assume little-endian memory), :data:`native`
is ``None`` and every caller uses its numpy reference.
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["native"]

native: ModuleType | None
try:
    from . import _kernels as native
except ImportError:  # pragma: no cover - depends on the build
    native = None
if sys.byteorder != "little":  # pragma: no cover
    native = None
