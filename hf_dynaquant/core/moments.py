"""Optimizer moments in a form that quantizes well (numeric primitives, no I/O).

The paper compresses weights only; Adam's two moments are two thirds of a checkpoint. They are
not like weights, so they are not stored as they are:

* ``exp_avg_sq`` (v) is non-negative and spans many decades, and only its square root matters
  (Adam divides by ``sqrt(v) + eps``). We store the **scale** ``s = log(sqrt(v) + eps)`` on a
  fixed grid of step ``h`` in the log domain that starts at ``log(eps)``: every value keeps a
  relative error of at most ``exp(h/2) - 1`` in ``sqrt(v) + eps``, ``v = 0`` decodes to exactly 0,
  and because the grid does not move between checkpoints, a slowly drifting ``v`` keeps most of
  its codes and delta-codes to almost nothing. Rounding in the log domain is unbiased in
  ``log``, not in Adam's step ``1 / (sqrt(v) + eps)``: at ``h = 1`` the rounded scale makes the
  steps 4.2% longer on average, for the ~1,000 steps ``v`` lasts. The decoder multiplies
  ``sqrt(v_q)`` by the stored **scale gain** (:func:`scale_gain`, the tensor's mean shortfall),
  so the restored steps keep their mean length. Measured over a 1,200-step run restored ten
  times (three seeds), the final eval loss went from -1.68 ± 0.78% against the plain run
  (faster than the plain run, on every seed) to +0.03 ± 0.76%, at the same size.
* ``exp_avg`` (m) is signed. We store the **update** ``u = m / (sqrt(v) + eps)``, the step Adam
  takes (before the learning rate), quantized like a weight (sketch + K-means) into ``u_q``.
  Decoding sets ``m = g * u_q * (sqrt(v_q) + eps)``, so the first step after a restore moves
  each weight by exactly ``g * u_q``: the update's fidelity is the quantizer's on ``u``.
  The quantizer's centres are (close to) the means of their bins, so ``u_q`` is *shorter* than
  ``u``: ``|u_q| = cos * |u|`` for the cosine ``cos`` between them, up to the centres' error.
  Restored as it is, Adam steps less far along its momentum for the ten or so steps the
  momentum lasts, and a run restored every few steps falls behind. The decoder therefore
  scales ``u_q`` by the stored **norm gain** ``g = |u| / |u_q|`` (:func:`norm_gain`): the
  restored update has the original's length and a direction within the checked cosine.
  Measured on a run restored ten times four steps apart (``benchmarks/RESULTS.md``, six seeds),
  this took the eval-loss deviation from the plain run from +1.65 ± 1.17% to +0.39 ± 1.01% at
  the same size, lower by 1.27 ± 0.20 points seed by seed; restoring the update's projection on
  ``u`` instead (gain ``1/cos^2``) gained less and less steadily (0.84 ± 0.69).

An error in m is forgotten at rate ``beta1`` per step (after 20 steps 12% of it is left); an
error in v persists for ``1/(1-beta2)`` steps, which is why v gets the finer, bounded
representation. SGD's ``momentum_buffer`` is signed like a weight and quantized as one (with
its own norm gain, for the same reason).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import numpy as np
import torch

from .dtypes import all_finite
from .histogram import byte_counts
from .kernels import native
from .pool import ForkSafePool
from .quantizer import (
    PROTECTED,
    Coded,
    TensorPlan,
    code_table,
    coded_values,
    decoded_values,
    flat_f32,
    midpoints,
    quantize,
)

__all__ = [
    "MAX_SCALE_LEVELS",
    "scale_floor",
    "adam_update",
    "adam_update_parts",
    "adam_scale",
    "adam_scale_stats",
    "update_scale_to_adam",
    "codes_to_adam",
    "grid_step",
    "scale_plan",
    "scale_gain_sums",
    "scale_stats",
    "scale_gain",
    "fidelity",
    "fidelity_sums",
    "quantized_fidelity_sums",
    "quantization_sums",
    "fidelity_from_sums",
    "norm_gain",
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


_NATIVE_MOMENTS = (torch.float32, torch.bfloat16)  # what the compiled adam_update reads as it is


def adam_update(m: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """Adam's update ``m / (sqrt(v) + eps)``: a new float32 tensor on the CPU. The compiled
    kernel takes one pass over float32 or bfloat16 moments (torch's five took 8x longer; the
    two agree to an ulp, torch's vectorised sqrt not always being correctly rounded)."""
    if native is None or m.dtype not in _NATIVE_MOMENTS or v.dtype not in _NATIVE_MOMENTS or m.shape != v.shape:
        return m.detach().to("cpu", torch.float32, copy=True).div_(_denominator(v, eps))
    m, v = (t.detach().to("cpu").contiguous() for t in (m, v))
    out = torch.empty(m.shape, dtype=torch.float32)
    m_bits, v_bits, u = _moment_bits(m).reshape(-1), _moment_bits(v).reshape(-1), out.numpy().reshape(-1)
    m_bf16, v_bf16, floor = m.dtype == torch.bfloat16, v.dtype == torch.bfloat16, scale_floor(eps)
    _over_parts(u.size, lambda a, b: native.adam_update(m_bits[a:b], m_bf16, v_bits[a:b], v_bf16, floor, u[a:b]))
    return out


def adam_update_parts(m: torch.Tensor, v: torch.Tensor, eps: float) -> Callable[[int, int, np.ndarray], None] | None:
    """``fill(start, stop, out)``: :func:`adam_update`'s flat values ``start:stop`` (the same
    values, by the same kernel) written into float32 ``out``, so that the update is made a part
    at a time as it is quantized (:class:`~hf_dynaquant.core.dtypes.ValuesInParts`) and never
    whole; None where the kernel does not read the moments as they are (not contiguous on the
    CPU, another dtype, shapes that differ): :func:`adam_update` then makes it whole."""
    usable = (
        native is not None
        and m.dtype in _NATIVE_MOMENTS
        and v.dtype in _NATIVE_MOMENTS
        and m.shape == v.shape
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (m, v))
    )
    if not usable:
        return None
    m_bits, v_bits = _moment_bits(m.detach()).reshape(-1), _moment_bits(v.detach()).reshape(-1)
    m_bf16, v_bf16, floor = m.dtype == torch.bfloat16, v.dtype == torch.bfloat16, scale_floor(eps)

    def fill(start: int, stop: int, out: np.ndarray) -> None:
        native.adam_update(m_bits[start:stop], m_bf16, v_bits[start:stop], v_bf16, floor, out)

    return fill


def _moment_bits(t: torch.Tensor) -> np.ndarray:
    """A CPU float32 or bfloat16 moment's values as the compiled kernels read them."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def adam_scale(v: torch.Tensor, eps: float) -> torch.Tensor:
    """The scale ``log(sqrt(v) + eps)``: a new float32 tensor on the CPU. The compiled kernel
    takes one pass over float32 or bfloat16 ``v`` (torch's five took 6x longer); its ``log`` is
    within an ulp of the correctly rounded one (so within two of torch's, whose vectorised
    ``log`` and ``sqrt`` are not always correctly rounded)."""
    if native is None or v.dtype not in _NATIVE_MOMENTS:
        return _denominator(v, eps).log_()
    v = v.detach().to("cpu").contiguous()
    out = torch.empty(v.shape, dtype=torch.float32)
    v_bits, s = _moment_bits(v).reshape(-1), out.numpy().reshape(-1)
    bf16, floor = v.dtype == torch.bfloat16, scale_floor(eps)
    _over_parts(s.size, lambda a, b: native.adam_scale(v_bits[a:b], bf16, floor, s[a:b]))
    return out


def update_scale_to_adam(
    u: torch.Tensor,
    s: torch.Tensor,
    eps: float,
    dtype: torch.dtype = torch.float32,
    *,
    gain: float = 1.0,
    scale_gain: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)`` back from a decoded update and scale and their gains (:func:`norm_gain`,
    :func:`scale_gain`): ``sqrt(v) = scale_gain * (exp(s) - eps)`` (``v = 0`` stays 0) and
    ``m = gain * u * (sqrt(v) + eps)``, so Adam's first step after a restore is ``gain * u``.
    ``inplace``: ``u`` and ``s`` (float32, the caller's to give up) become ``m`` and ``v``, with
    no temporaries. The compiled kernel takes one pass and one ``exp`` per distinct scale value
    (a decoded scale has at most :data:`MAX_SCALE_LEVELS`): the restore's main thread spent more
    time in torch's six passes than in anything else; its ``expf`` is within an ulp of torch's."""
    if not (inplace and u.dtype == s.dtype == torch.float32):
        u, s = u.float().clone(), s.float().clone()
    floor = scale_floor(eps)
    if native is not None and u.device.type == s.device.type == "cpu" and u.shape == s.shape:
        u, s = u.contiguous(), s.contiguous()  # (decoded tensors already are: no copy)
        native.scale_to_adam_f32(u.numpy(), s.numpy(), floor, gain, scale_gain)  # one pass, in place
        return u.to(dtype), s.to(dtype)
    denom = s.exp_()  # sqrt(v) + eps as rounded
    if scale_gain != 1:
        denom.sub_(floor).clamp_min_(0).mul_(scale_gain).add_(floor)
    m = u.mul_(denom)
    if gain != 1:
        m.mul_(gain)
    v = denom.sub_(floor).clamp_min_(0).square_()
    return m.to(dtype), v.to(dtype)


def codes_to_adam(
    update: Coded,
    scale: Coded,
    eps: float,
    dtype: torch.dtype = torch.float32,
    *,
    gain: float = 1.0,
    scale_gain: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``(m, v)`` in ``dtype`` from a quantized update and scale: :func:`update_scale_to_adam`
    of the values they decode to (:func:`~hf_dynaquant.core.quantizer.decoded_values`), bit for
    bit (a NaN's bits aside), but taken straight from their codes. The compiled kernel never holds the float32 update
    and scale (8 bytes a value, where the codes take 2): in a pure-bf16 model's restore they were
    the largest temporaries, 0.4x the checkpoint for GPT-2's embedding alone. Raises
    ``ValueError`` when a code lies beyond its centres or the protected values do not match
    the codes that need one."""
    n = update.codes.size
    if scale.codes.size != n or tuple(update.shape) != tuple(scale.shape):
        raise ValueError(
            f"the update has shape {tuple(update.shape)} ({n} codes), the scale {tuple(scale.shape)} "
            f"({scale.codes.size})"
        )
    fast = native is not None and dtype in _NATIVE_MOMENTS and update.codes.dtype == scale.codes.dtype == np.uint8
    if not fast:
        u, s = (coded_values(c).reshape(-1) for c in (update, scale))
        return update_scale_to_adam(u, s, eps, dtype, gain=gain, scale_gain=scale_gain, inplace=True)
    m, v = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    m_out, v_out = (t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy() for t in (m, v))
    bounds = _part_bounds(n)
    parts = [_CodedParts(c, bounds) for c in (update, scale)]
    floor, bf16 = scale_floor(eps), dtype == torch.bfloat16

    def convert(k: int) -> tuple[int, int]:
        a, b = bounds[k], bounds[k + 1]
        return native.codes_to_adam(
            *parts[0].arrays(k), *parts[1].arrays(k), floor, gain, scale_gain, bf16, m_out[a:b], v_out[a:b]
        )

    used = _in_parts(len(bounds) - 1, convert)  # (a code beyond its centres, in any part)
    for i, (what, c) in enumerate(zip(("update", "scale"), (update, scale))):
        k = sum(u[i] for u in used)  # the codes 1 of every part, each counted by the kernel
        if k != c.protected.size:
            raise ValueError(f"{what}: {c.protected.size} protected values stored, {k} codes need one")
    return m, v


T = TypeVar("T")
# Values from which a pass over a tensor (codes_to_adam, adam_update, adam_scale) is split into
# parts made on several threads: below it, a thread's hand-off costs more than the part saves.
_SPLIT_FROM = 1 << 21
# values of each part of adam_scale_stats and quantization_sums (a fixed size: sums that do not
# depend on the cores)
_STATS_PART = 1 << 22
_POOL = ForkSafePool("dq-adam")


def _part_bounds(n: int) -> list[int]:
    """The bounds of the parts a pass over a tensor's values makes at once (:func:`codes_to_adam`,
    :func:`adam_update`, :func:`adam_scale`): one per worker of its pool for a tensor of
    :data:`_SPLIT_FROM` values or more, else the whole."""
    k = _POOL.max_workers if n >= _SPLIT_FROM else 1
    return [n * i // k for i in range(k + 1)]


def _over_parts(n: int, run: Callable[[int, int], object]) -> None:
    """``run(a, b)`` over the parts ``[a, b)`` of ``n`` values that :func:`_part_bounds` cuts,
    on several threads (:func:`_in_parts`): an elementwise pass over a large tensor."""
    bounds = _part_bounds(n)
    _in_parts(len(bounds) - 1, lambda k: run(bounds[k], bounds[k + 1]))


def _in_parts(parts: int, run: Callable[[int], T]) -> list[T]:
    """``run(k)`` for ``k < parts``: the first in this thread, the others on the pool (a save's
    or a restore's largest tensor would otherwise keep one core busy while the other idles);
    every part waited for, the results in order, the first failure raised."""
    others = [_POOL.submit(run, k) for k in range(1, parts)]
    try:
        first = run(0)
    finally:
        for job in others:
            job.exception()
    return [first] + [job.result() for job in others]


class _CodedParts:
    """A coded tensor cut at ``bounds``: each part's codes, the centres' table and the protected
    values its codes take (the ``j``-th code 1 takes the ``j``-th protected value, so a part's
    values begin after those of the parts before it; the last part is handed every one left, so
    that codes needing more or fewer than are stored show in the kernel's count)."""

    def __init__(self, c: Coded, bounds: list[int]) -> None:
        self.codes = np.ascontiguousarray(c.codes).reshape(-1)
        self.table = code_table(c.centres)
        self.protected = np.ascontiguousarray(c.protected, dtype=np.uint16)
        self.bounds = bounds
        self.before = [0] * (len(bounds) - 1) + [self.protected.size]  # protected values before each part
        if self.protected.size:
            for k in range(1, len(bounds) - 1):
                part = self.codes[bounds[k - 1] : bounds[k]]
                self.before[k] = min(self.before[k - 1] + int(byte_counts(part, 2)[PROTECTED]), self.protected.size)

    def arrays(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(codes, table, protected)`` of part ``k``, for the kernel."""
        a, b = self.bounds[k], self.bounds[k + 1]
        return self.codes[a:b], self.table, self.protected[self.before[k] : self.before[k + 1]]


def grid_step(top: float, eps: float, step: float) -> float:
    """The step of the scale grid up to ``top`` (the scale's maximum): ``step``, widened only if
    the scale spans more than :data:`MAX_SCALE_LEVELS` steps."""
    if step <= 0:
        raise ValueError(f"the scale grid step must be positive, got {step}")
    span = max(top - math.log(scale_floor(eps)), 0.0)
    return span / (MAX_SCALE_LEVELS - 1) if span / step > MAX_SCALE_LEVELS - 1 else step


def scale_plan(top: float, eps: float, step: float) -> TensorPlan:
    """A plan whose codebook is the fixed log grid ``log(eps) + h * k`` up to ``top``, the
    scale's maximum (of the full tensor when a process holds a shard of it, so that every shard
    gets the full tensor's grid), ``h = grid_step(top, eps, step)``; nothing is pruned or protected.
    A keyframe may code its codes with contexts from their rows' and columns' terms
    (:mod:`~hf_dynaquant.core.factored`: ``v`` is close to the outer product of its row and
    column sums, so the scale to a row term plus a column term)."""
    origin = math.log(scale_floor(eps))
    span = max(top - origin, 0.0)
    step = grid_step(top, eps, step)
    levels = int(math.floor(span / step + 0.5)) + 1
    centres = (origin + step * np.arange(levels, dtype=np.float64)).astype(np.float32)
    plan = TensorPlan("moment_scale", centres, float("inf"), None, None, "magnitude", factored=True)
    plan.thresholds = _second_moment_thresholds(float(eps), midpoints(centres).tobytes())
    return plan


@functools.lru_cache(maxsize=64)
def _second_moment_thresholds(eps: float, mids: bytes) -> np.ndarray:
    """For each midpoint ``m`` (float32) of a scale grid, the largest float32 ``v`` whose scale
    :func:`adam_scale` makes no more than ``m`` (``-inf`` where even ``v = 0``'s is above it),
    found by bisection over the float32 bits with :func:`adam_scale` itself. The scale grows with
    ``v``, so ``v`` lies above that threshold exactly when its scale lies above ``m``: the scale's
    codes are made from ``v`` by the partition with these midpoints, the same codes without the
    logarithm or the scale's float32 form (:meth:`TensorPlan.rules`; a test checks the equality;
    the one exception, a ``v`` of -inf against a threshold of -inf, Adam never holds)."""
    m = np.frombuffer(mids, dtype=np.float32)
    lo = np.zeros(m.size, dtype=np.int64)  # the first v (as bits) whose scale is above m lies in [lo, hi]
    hi = np.full(m.size, 0x7F800000, dtype=np.int64)  # +inf, whose scale is above any m
    while (active := lo < hi).any():
        probe = (lo + hi) // 2
        above = adam_scale(torch.from_numpy(probe.astype(np.uint32).view(np.float32)), eps).numpy() > m
        hi = np.where(active & above, probe, hi)
        lo = np.where(active & ~above, probe + 1, lo)
    largest_not_above = np.maximum(lo - 1, 0).astype(np.uint32).view(np.float32)
    out = np.where(lo == 0, np.float32(-np.inf), largest_not_above).astype(np.float32)
    out.flags.writeable = False
    return out


def scale_stats(scale: torch.Tensor, eps: float, step: float) -> tuple[bool, float, np.ndarray]:
    """``(finite, top, sums)`` of an Adam scale in one pass: whether every value is finite, the
    maximum (``-inf`` for no values), and :func:`scale_gain_sums` on the grid of ``step``
    (meaningful only when finite)."""
    flat = flat_f32(scale)
    if native is not None:
        finite, top, total = native.scale_stats_f32(flat.numpy(), math.log(scale_floor(eps)), float(step))
        return bool(finite), float(top), np.array([total, float(flat.numel())], dtype=np.float64)
    top = float(flat.max()) if flat.numel() else -math.inf
    finite = all_finite(flat)
    return finite, top, _gain_sums(flat, eps, step) if finite else np.zeros(2)


def adam_scale_stats(v: torch.Tensor, eps: float, step: float) -> tuple[bool, float, np.ndarray]:
    """:func:`scale_stats` of ``adam_scale(v, eps)``, without making the scale where the
    compiled kernel reads ``v`` (float32 or bfloat16): a save needs the scale's statistics of
    every Adam state before it codes any, and its float32 form would be 4 bytes a value of new
    memory and two passes more."""
    if native is None or v.dtype not in _NATIVE_MOMENTS:
        return scale_stats(adam_scale(v, eps), eps, step)
    if step <= 0:
        raise ValueError(f"the scale grid step must be positive, got {step}")
    v = v.detach().to("cpu").contiguous()
    v_bits = _moment_bits(v).reshape(-1)

    def part(k: int) -> tuple[bool, float, float]:
        return native.adam_scale_stats(
            v_bits[k * _STATS_PART : (k + 1) * _STATS_PART],
            v.dtype == torch.bfloat16,
            scale_floor(eps),
            math.log(scale_floor(eps)),
            float(step),
        )

    # in parts of a fixed size, on several threads, summed in order: the same sums on any machine
    parts = _in_parts(max(1, -(-v_bits.size // _STATS_PART)), part)
    total = 0.0
    for _, _, gain in parts:
        total += gain
    finite, top = all(p[0] for p in parts), max(p[1] for p in parts)
    return bool(finite), float(top), np.array([total, float(v.numel())], dtype=np.float64)


def scale_gain_sums(scale: torch.Tensor, eps: float, step: float) -> np.ndarray:
    """``[sum of exp(s - s_q), count]`` in float64 over the values ``s`` of ``scale``, ``s_q``
    being ``s`` rounded to the grid ``log(eps) + step * k``: the sums :func:`scale_gain` is made
    of. They add over any split of the values (sum each rank's rows)."""
    return scale_stats(scale, eps, step)[2]


def _gain_sums(flat: torch.Tensor, eps: float, step: float) -> np.ndarray:
    """:func:`scale_gain_sums` in torch, float64 chunks (the compiled kernel's reference)."""
    if step <= 0:
        raise ValueError(f"the scale grid step must be positive, got {step}")
    origin = math.log(scale_floor(eps))
    total = 0.0
    for start in range(0, flat.numel(), _FIDELITY_CHUNK):  # float64 temporaries of one chunk at a time
        x = flat[start : start + _FIDELITY_CHUNK].double().sub_(origin)
        total += float(x.sub_(x.div(step).round_().mul_(step)).exp_().sum())
    return np.array([total, float(flat.numel())], dtype=np.float64)


def scale_gain(sums: np.ndarray) -> float:
    """The **scale gain** ``c`` from :func:`scale_gain_sums`: the mean of ``exp(s - s_q)``, i.e.
    of ``(sqrt(v) + eps) / (sqrt(v_q) + eps)``, by which the rounded scale falls short on
    average (1.0 for no values). Rounding in the log domain is unbiased in ``log``, not in the
    step size: over a bin of width ``h`` the mean of ``exp`` of the rounding error is about
    ``sinh(h/2) / (h/2)``, 4.2% at ``h = 1``. A restored ``v_q`` as it is would make Adam's steps
    that much longer for the ~1,000 steps ``v`` lasts; decoding ``sqrt(v)`` as ``c * sqrt(v_q)``
    gives them the original length on average."""
    total, count = float(sums[0]), float(sums[1])
    return total / count if count > 0 and total > 0 else 1.0


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


def quantized_fidelity_sums(
    original: torch.Tensor, codes: np.ndarray, centres: np.ndarray, protected: np.ndarray
) -> np.ndarray:
    """:func:`fidelity_sums` of ``original`` and its quantized values (``codes``, ``centres``,
    ``protected`` as :func:`~hf_dynaquant.core.quantizer.quantize` gives them), the same sums.
    Without protected values the compiled kernel reads the codes through their table in one
    pass, without the decoded float32 copy (4 bytes a value of new memory, and two passes)."""
    if native is None or protected.size or codes.dtype != np.uint8:
        return fidelity_sums(original, torch.from_numpy(decoded_values(codes.reshape(-1), centres, protected)))
    flat = flat_f32(original)
    if codes.size != flat.numel():
        raise ValueError(f"{codes.size} codes for {flat.numel()} values")
    return np.array(native.fidelity_codes_f32(flat.numpy(), codes.reshape(-1), code_table(centres)), dtype=np.float64)


def quantization_sums(original: torch.Tensor, plan: TensorPlan) -> np.ndarray:
    """:func:`fidelity_sums` of ``original`` and its values quantized under ``plan`` (as
    :func:`~hf_dynaquant.core.quantizer.quantize` codes them), in parts of a fixed size
    quantized and summed on several threads, the parts' sums added in order: the same sums on
    any machine, and a part's codes at a time, not the tensor's (a save's decisions kept one
    core busy on their largest tensor while the other idled). A plan that reads more than the
    values (sensitivities, a reference, error feedback, rare rows) quantizes the tensor whole."""
    flat = flat_f32(original)
    n = flat.numel()
    whole = any(x is not None for x in (plan.sensitivity, plan.reference, plan.feedback, plan.rare_rows))
    bounds = [0, n] if whole or n <= _STATS_PART else [*range(0, n, _STATS_PART), n]

    def part(k: int) -> np.ndarray:
        a, b = bounds[k], bounds[k + 1]
        codes, kept = quantize(flat[a:b], replace(plan, dither_offset=plan.dither_offset + a) if a else plan)
        return quantized_fidelity_sums(flat[a:b], codes, plan.centres, kept)

    total = np.zeros(4, dtype=np.float64)
    for sums in _in_parts(len(bounds) - 1, part):
        total += sums
    return total


def fidelity_from_sums(sums: np.ndarray) -> tuple[float, float]:
    """``(cosine similarity, relative L2 error)`` from :func:`fidelity_sums` (of all the values:
    ``(1, 0)`` for two all-zero tensors)."""
    ab, aa, bb, dd = (float(x) for x in sums)
    na, nb = math.sqrt(aa), math.sqrt(bb)
    if na == 0:
        return (1.0, 0.0) if nb == 0 else (0.0, math.inf)
    cos = ab / (na * nb) if nb else 0.0
    return cos, math.sqrt(dd) / na


def norm_gain(sums: np.ndarray) -> float:
    """``|a| / |b|`` from :func:`fidelity_sums` of ``a = original``, ``b = decoded``: the factor
    that gives the decoded tensor the original's L2 norm (1.0 when either norm is 0, where no
    factor can)."""
    aa, bb = float(sums[1]), float(sums[2])
    return math.sqrt(aa / bb) if aa > 0 and bb > 0 else 1.0


def fidelity(original: torch.Tensor, decoded: torch.Tensor) -> tuple[float, float]:
    """``(cosine similarity, relative L2 error)`` of a decoded tensor against its original
    (``(1, 0)`` for two all-zero tensors)."""
    return fidelity_from_sums(fidelity_sums(original, decoded))
