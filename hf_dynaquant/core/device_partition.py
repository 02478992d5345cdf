"""A tensor's codes and decoded values in torch ops, where the tensor lives.

The configuration search sizes and evaluates each candidate on every quantizable value. On the
host the compiled kernels do that (:meth:`~.quantizer.TensorPlan.codes`,
:func:`~.quantizer.decoded_values`). When the model trains on an accelerator its values are
there already, and copying every candidate's tensors to the host to partition them on its cores
was most of a checkpoint's search (about 38 s for 3 evaluations of a 353M model on an H100
machine's 16 cores, benchmarks/RESULTS.md). These are the same rules in torch ops, equal to the
kernels bit for bit, on any device: protection, pruning, the nearest centre, stochastic rounding,
the protected values and the decoded values (tested against the kernels on the CPU and on a GPU).

* The thresholds are doubles, and the kernel compares ``(double) x`` with them. A float32 ``x``
  lies above a double ``t`` exactly when it lies above the largest float32 not above ``t``, and
  below ``t`` exactly when it lies below the smallest float32 not below it. So the comparisons
  run in float32, against those two neighbours.
* Stochastic rounding draws SplitMix64 numbers equal to :func:`~.rounding.uniform`'s, in int64
  arithmetic, which wraps as uint64 does; right shifts are masked so that they are logical.

Plans with error feedback or rare rows (pre-trained snapshots) are partitioned on the host only.
"""

from __future__ import annotations

import numpy as np
import torch

from .quantizer import FIRST_CENTRE, PROTECTED, PRUNED, TensorPlan

__all__ = ["device_codes", "device_decoded", "device_uniform", "on_device"]

_MASK64 = (1 << 64) - 1


def _int64(u: int) -> int:
    """A uint64 as the int64 with the same bits."""
    u &= _MASK64
    return u - (1 << 64) if u >> 63 else u


_GOLDEN, _M1, _M2 = (_int64(x) for x in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` of int64 ``z`` read as uint64 (a logical shift)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def device_uniform(seed: int, offset: int, n: int, device: torch.device) -> torch.Tensor:
    """:func:`~.rounding.uniform` (``n`` float32 numbers in [0, 1) of elements ``offset ..``)
    computed on ``device``, bit for bit."""
    z = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=device) * _GOLDEN + _int64(seed)
    z = (z ^ _shifted(z, 30)) * _M1
    z = (z ^ _shifted(z, 27)) * _M2
    z = z ^ _shifted(z, 31)
    return _shifted(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def _at_most(t: float) -> float:
    """The largest float32 not above ``t``: float32 ``x > t`` exactly when ``x >`` it."""
    with np.errstate(over="ignore"):
        f = np.float32(t)
    return float(np.nextafter(f, np.float32(-np.inf)) if float(f) > t else f)


def _at_least(t: float) -> float:
    """The smallest float32 not below ``t``: float32 ``x < t`` exactly when ``x <`` it."""
    with np.errstate(over="ignore"):
        f = np.float32(t)
    return float(np.nextafter(f, np.float32(np.inf)) if float(f) < t else f)


def on_device(plan: TensorPlan) -> bool:
    """Whether :func:`device_codes` takes this plan (error feedback and rare rows: host only)."""
    return plan.feedback is None and plan.rare_rows is None


def device_codes(
    values: torch.Tensor, plan: TensorPlan, sensitivity: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8, protected values as bfloat16)`` of flat float32 ``values`` (the plan's
    target: a residual already has its reference taken off) where they live, equal to
    :meth:`TensorPlan.codes` and the protected values :func:`~.quantizer.quantize` stores.
    ``sensitivity``: the plan's sensitivity, flat, on the values' device."""
    if not on_device(plan):
        raise ValueError("plans with error feedback or rare rows are partitioned on the host")
    mids, tau_sens, tau_prune, by_sens = plan.rules(plan.centres, sensitivity is not None)
    magnitude = values.abs()
    protected = magnitude > _at_most(plan.protect_magnitude)
    if sensitivity is not None:
        protected |= sensitivity > _at_most(tau_sens)
    bounds = torch.from_numpy(mids).to(values.device)
    codes = (torch.searchsorted(bounds, values, out_int32=True) + FIRST_CENTRE).to(torch.uint8)
    if tau_prune >= 0:
        criterion = sensitivity if by_sens else magnitude
        codes.masked_fill_((criterion < _at_least(tau_prune)) | (criterion == 0), PRUNED)
    codes.masked_fill_(protected, PROTECTED)
    if plan.dither_seed is not None and plan.centres.size:
        u = device_uniform(plan.dither_seed, plan.dither_offset, values.numel(), values.device)
        _stochastic(codes, values, torch.from_numpy(plan.centres).to(values.device), bounds, u)
    return codes, values[protected].to(torch.bfloat16)


def _stochastic(
    codes: torch.Tensor, w: torch.Tensor, c: torch.Tensor, mids: torch.Tensor, u: torch.Tensor
) -> None:
    """:func:`~.rounding.stochastic_codes` in place, step for step (see its rules)."""
    top = c.numel() - 1
    if top > 0:
        sel = torch.nonzero(codes >= FIRST_CENTRE).squeeze(1)
        i = codes[sel].long() - FIRST_CENTRE
        x, ci = w[sel], c[i]
        j = torch.where(x > ci, i + 1, i - 1).clamp(0, top)  # the other centre bracketing x
        gap = c[j] - ci
        step = torch.where(gap != 0, (x - ci) / torch.where(gap != 0, gap, torch.ones_like(gap)), 0.0)
        codes[sel] = (torch.where(u[sel] < step, j, i) + FIRST_CENTRE).to(torch.uint8)
    sel = torch.nonzero(codes == PRUNED).squeeze(1)
    if sel.numel():
        x = w[sel]
        nearest = torch.searchsorted(mids, x)
        zero = int((c <= 0).sum())  # c[zero:] are > 0, c[:zero] <= 0
        inner = torch.where(x > 0, zero, zero - 1).clamp(0, top)
        k = torch.where(torch.sign(c[nearest]) == torch.sign(x), nearest, inner)
        same_side = (torch.sign(c[k]) == torch.sign(x)) & (x != 0)
        p = torch.where(same_side, (x.abs() / c[k].abs().clamp(min=1e-30)).clamp(max=1), 0.0)
        keep = u[sel] < p
        codes[sel[keep]] = (k[keep] + FIRST_CENTRE).to(torch.uint8)


def device_decoded(
    codes: torch.Tensor, centres: np.ndarray, protected: torch.Tensor, reference: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat float32 values codes decode to, where they live: :func:`~.quantizer.decoded_values`
    (pruned 0, protected their bfloat16 values in order, else their centre; plus the reference
    of a residual), bit for bit."""
    table = torch.from_numpy(np.concatenate(([0.0, 0.0], centres)).astype(np.float32)).to(codes.device)
    out = table.index_select(0, codes.int())
    out[codes == PROTECTED] = protected.float()
    return out if reference is None else out + reference
