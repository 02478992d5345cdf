"""Optimizer moments in a form that quantizes well (numeric primitives, no I/O).

The paper compresses weights only; Adam's two moments are two thirds of a checkpoint. They are
not like weights, so they are not stored as they are:

* ``exp_avg_sq`` (v) is non-negative and spans many decades, and only its square root matters
  (Adam divides by ``sqrt(v) + eps``). We store the **scale** ``s = log(sqrt(v) + eps)`` on a
  fixed grid of step ``h`` in the log domain that starts at ``log(eps)``: every value keeps a
  relative error of at most ``exp(h/2) - 1`` in ``sqrt(v) + eps``, ``v = 0`` decodes to exactly 0,
  and because the grid does not move between checkpoints, a slowly drifting ``v`` keeps most of
  its codes and delta-codes to almost nothing.
* ``exp_avg`` (m) is signed. We store the **update** ``u = m / (sqrt(v) + eps)``, the step Adam
  takes (before the learning rate), quantized like a weight (sketch + K-means). Decoding sets
  ``m = u_q * (sqrt(v_q) + eps)``, so the first step after a restore moves each weight by
  exactly ``u_q``: the update's fidelity is the quantizer's fidelity on ``u``, nothing more.

An error in m is forgotten at rate ``beta1`` per step (after 20 steps 12% of it is left); an
error in v persists for ``1/(1-beta2)`` steps, which is why v gets the finer, bounded
representation. SGD's ``momentum_buffer`` is signed like a weight and quantized as one.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .kernels import native
from .quantizer import TensorPlan, flat_f32

__all__ = [
    "MAX_SCALE_LEVELS",
    "scale_floor",
    "adam_update",
    "adam_scale",
    "update_scale_to_adam",
    "scale_plan",
    "fidelity",
    "fidelity_sums",
    "fidelity_from_sums",
]

MAX_SCALE_LEVELS = 254  # centres a uint8 code can name (0 and 1 are the pruned/protected levels)
_FIDELITY_CHUNK = 1 << 20  # values per float64 chunk of fidelity_sums (24 MiB of temporaries)


def scale_floor(eps: float) -> float:
    """The additive floor of the scale: Adam's eps (at least 1e-12, so ``log`` stays finite
    for an optimizer configured with ``eps=0``)."""
    return max(float(eps), 1e-12)


def _denominator(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(v) + eps``: a new float32 tensor on the CPU (NaN stays NaN, negatives count as 0)."""
    return v.detach().to("cpu", torch.float32, copy=True).clamp_min_(0).sqrt_().add_(scale_floor(eps))


def adam_update(m: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """Adam's update ``m / (sqrt(v) + eps)``: a new float32 tensor on the CPU."""
    return m.detach().to("cpu", torch.float32, copy=True).div_(_denominator(v, eps))


def adam_scale(v: torch.Tensor, eps: float) -> torch.Tensor:
    """The scale ``log(sqrt(v) + eps)``: a new float32 tensor on the CPU."""
    return _denominator(v, eps).log_()


def update_scale_to_adam(
    u: torch.Tensor, s: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)`` back from an update and a scale (see the module docstring). ``inplace``: ``u``
    and ``s`` (float32, the caller's to give up) become ``m`` and ``v``, with no temporaries."""
    if not (inplace and u.dtype == s.dtype == torch.float32):
        u, s = u.float().clone(), s.float().clone()
    denom = s.exp_()
    m = u.mul_(denom)
    v = denom.sub_(scale_floor(eps)).clamp_min_(0).square_()
    return m.to(dtype), v.to(dtype)


def scale_plan(top: float, eps: float, step: float) -> TensorPlan:
    """A plan whose codebook is the fixed log grid ``log(eps) + step * k`` up to ``top``, the
    scale's maximum (of the full tensor when a process holds a shard of it, so that every shard
    gets the full tensor's grid).

    The grid widens (``step`` grows) only if the scale spans more than :data:`MAX_SCALE_LEVELS`
    steps; nothing is pruned or protected."""
    if step <= 0:
        raise ValueError(f"the scale grid step must be positive, got {step}")
    origin = math.log(scale_floor(eps))
    span = max(top - origin, 0.0)
    if span / step > MAX_SCALE_LEVELS - 1:
        step = span / (MAX_SCALE_LEVELS - 1)
    levels = int(math.floor(span / step + 0.5)) + 1
    centres = (origin + step * np.arange(levels, dtype=np.float64)).astype(np.float32)
    return TensorPlan("moment_scale", centres, float("inf"), None, None, "magnitude")


def fidelity_sums(original: torch.Tensor, decoded: torch.Tensor) -> np.ndarray:
    """``[a.b, a.a, b.b, (a-b).(a-b)]`` in float64 for ``a = original``, ``b = decoded``: the sums
    :func:`fidelity` is made of. They add over any split of the values (row shards of one tensor:
    sum each rank's, then :func:`fidelity_from_sums`)."""
    a_all, b_all = flat_f32(original), flat_f32(decoded)
    if native is not None:
        return np.array(native.fidelity_f32(a_all.numpy(), b_all.numpy()), dtype=np.float64)
    sums = np.zeros(4, dtype=np.float64)
    for start in range(0, a_all.numel(), _FIDELITY_CHUNK):  # float64 copies of one chunk at a time
        a = a_all[start : start + _FIDELITY_CHUNK].double()
        b = b_all[start : start + _FIDELITY_CHUNK].double()
        d = a - b
        sums += [float(a @ b), float(a @ a), float(b @ b), float(d @ d)]
    return sums


def fidelity_from_sums(sums: np.ndarray) -> tuple[float, float]:
    """``(cosine similarity, relative L2 error)`` from :func:`fidelity_sums` (of all the values:
    ``(1, 0)`` for two all-zero tensors)."""
    ab, aa, bb, dd = (float(x) for x in sums)
    na, nb = math.sqrt(aa), math.sqrt(bb)
    if na == 0:
        return (1.0, 0.0) if nb == 0 else (0.0, math.inf)
    cos = ab / (na * nb) if nb else 0.0
    return cos, math.sqrt(dd) / na


def fidelity(original: torch.Tensor, decoded: torch.Tensor) -> tuple[float, float]:
    """``(cosine similarity, relative L2 error)`` of a decoded tensor against its original
    (``(1, 0)`` for two all-zero tensors)."""
    return fidelity_from_sums(fidelity_sums(original, decoded))
