"""Optimizer state in a checkpoint: compressed, lossless, or dropped.

Modes (``optimizer_state=``):

* ``"compress"``: Adam/AdamW moments become an update and a scale (:mod:`hf_dynaquant.core.moments`),
  SGD momentum is quantized like a weight; both go through the DynaQuant codec (and its delta
  encoder) under :class:`MomentQuant`. Each tensor's fidelity is checked at every checkpoint
  (cosine similarity and relative error of the decoded Adam update, or of the decoded momentum,
  against the original; for a tensor of 2^20 values or more, on the eighth of its values a
  sketch samples, :func:`~hf_dynaquant.core.sketch.sample`, with its NaN and infinities
  checked on every value); a tensor that fails at every bin count is stored losslessly. Anything
  the module does not recognise (other optimizers' state, step counters, small tensors) is
  lossless too, and so are moments holding NaN or infinite values (with a warning naming the
  parameter and the step), unless ``non_finite="raise"`` (``QuantConfig.non_finite``) refuses them.
* ``"lossless"``: the state dict as it is (lossless codec, XOR delta against the previous
  checkpoint where that pays).
* ``"drop"``: nothing stored. A restore then has no optimizer state and says so loudly.

The transformed tree marks each compressed entry (``"dq_moments": "adam-v1"`` or
``"sgd-v1"``) so :func:`decode_optimizer_state` inverts it with no other information.

**Several processes holding rows of the same state** (a sharded model's optimizer, FSDP2) encode
with :class:`Reductions`: every choice the encoder makes from the values (which tensors are big
enough, the codebooks, the fidelity check that picks the bin count or lossless, the scale grid)
is made from quantities combined over the processes, so every process decides what one process
encoding the full state decides, and its codes are the rows of the full tensors' codes. In one
process the reductions are identities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from ..core.dtypes import all_finite, bf16_parts
from ..core.memory import ReleaseFreed
from ..core.moments import (
    adam_scale,
    adam_scale_stats,
    adam_update,
    adam_update_parts,
    codes_to_adam,
    fidelity_from_sums,
    grid_step,
    norm_gain,
    quantization_sums,
    scale_floor,
    scale_gain,
    scale_plan,
    update_scale_to_adam,
)
from ..core.pool import VALUES_IN_FLIGHT, ForkSafePool, ordered_map, weighed_batches
from ..core.quantizer import (
    Coded,
    QuantConfig,
    QuantPlan,
    TensorPlan,
    coded_values,
    plan_quantization,
    refuse_or_warn_non_finite,
)
from ..core.sketch import SAMPLE_FROM, sample
from ..errors import CorruptCheckpointError, FormatError
from ..store.tree import DeferredTensor, flatten_tree

__all__ = [
    "OPTIMIZER_MODES",
    "MomentQuant",
    "OptimizerEncoding",
    "Reductions",
    "encode_optimizer_state",
    "decode_optimizer_state",
    "as_codes",
    "TensorKey",
]

OPTIMIZER_MODES = ("compress", "lossless", "drop")
_POOL = ForkSafePool("dq-moments")  # the fidelity check, moment by moment
ADAM, SGD = "adam-v1", "sgd-v1"
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
# Moment values converted at restore between two hand-backs of freed memory (ReleaseFreed). The
# decoding threads' temporaries (codes, streams) are freed into their malloc arenas and stay
# there; at 124M parameters in pure bf16 that held 0.2x the checkpoint above the restored state
# at the end of a restore (peak 1.08-1.10x), 0.05x with these trims (0.93-0.95x), in the same CPU
# time.
_RESTORE_TRIM_EVERY = 1 << 25


@dataclass(frozen=True)
class MomentQuant:
    """How optimizer moments are quantized in mode ``"compress"``.

    Args:
        bins: bin counts tried in order for an Adam update or an SGD momentum until the
            fidelity check passes (if none does, the tensor is stored losslessly). The first
            that passes is kept, so the ladder's rungs decide the update's bytes: on a 10.7M
            language model, 16 of the 20 updates that took 6 bins before 5 was a rung pass at 5,
            and the updates' bits fell by 20-27% (``benchmarks/RESULTS.md``, session 23).
        prune: fraction of each update's smallest values set to zero.
        scale_step: step of the log grid of ``log(sqrt(v) + eps)``; 1.0 bounds the relative
            error of ``sqrt(v) + eps`` by ``exp(0.5) - 1 = 65%`` (about 30% RMS), a per-weight
            factor on the step size; the grid does not move, so v's slow drift delta-codes to
            about half a bit per value.
        bf16_scale_step: the scale grid's step for a second moment stored in bfloat16. Its 8-bit
            significand cannot hold Adam's decay of ``v`` (``beta2 = 0.999``: 0.1% a step, under
            half of bf16's resolution of 0.4-0.8%), so ``v`` hardly moves in pure bf16 training
            and an error a restore puts into it stays for the rest of the run instead of fading
            over ~1,000 steps. Measured (1,200-step language model, ten restores, three seeds,
            ``benchmarks/RESULTS.md`` "Pure bf16 training"): +1.13 ± 0.47% against the plain
            run at a 1-nat grid, +0.41 ± 0.58% at 0.25 (lossless: +0.45 ± 0.49%).
        min_cosine: the decoded update's cosine similarity to the original must reach this (for
            a tensor of 2^20 values or more, on the values its sketch samples: an eighth).
        max_rel_error: and its relative L2 error stay within this.
        min_numel: smaller tensors stay lossless.

    The defaults accept a coarse update (2-3 bins where they keep cosine 0.7 and a 75% relative
    error) and a coarse scale, because a restored optimizer state matters briefly and the
    decoder removes what would bias the restored run: the update keeps its original length (the
    norm gain) and Adam's steps their mean length (the scale gain; see
    :mod:`hf_dynaquant.core.moments`). Measured with ``benchmarks/bench_trainer.py``
    (``benchmarks/RESULTS.md``, "Unbiased optimizer state"): a 1,200-step run restored ten times
    ends +0.03 ± 0.76% in eval loss against the plain run (three seeds). Restores a few steps
    apart early in training are the hard case: the update's direction error has no time to fade
    between them (``beta1**4 = 0.66`` of it is left at the next restore). Ten restores four
    steps apart ended +2.00 ± 1.12% with these defaults (0.43M parameters, six seeds) and
    +0.68 ± 0.81% with ``min_cosine=0.97, max_rel_error=0.25``, which costs about 40% of the
    whole-checkpoint ratio (29x instead of 47x); a run that restores that often sets those.
    """

    bins: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 16, 32)
    prune: float = 0.0
    scale_step: float = 1.0
    bf16_scale_step: float = 0.25
    min_cosine: float = 0.7
    max_rel_error: float = 0.75
    min_numel: int = 64

    def __post_init__(self) -> None:
        if not self.bins or any(not 2 <= b <= 254 for b in self.bins):
            raise ValueError(f"bins must be a non-empty sequence of counts in [2, 254], got {self.bins}")
        if not -1 <= self.min_cosine <= 1:
            raise ValueError(f"min_cosine must be in [-1, 1], got {self.min_cosine}")
        if not (self.scale_step > 0 and self.bf16_scale_step > 0):
            raise ValueError(f"scale steps must be positive, got {self.scale_step} and {self.bf16_scale_step}")

    def scale_step_for(self, dtype: torch.dtype) -> float:
        """The scale grid's step for a second moment stored in ``dtype`` (see ``bf16_scale_step``)."""
        return self.bf16_scale_step if dtype == torch.bfloat16 else self.scale_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class OptimizerEncoding:
    """A state dict ready for the store: the (transformed) tree, the plans of its quantized
    tensors keyed by their tree key, and a fidelity report for the checkpoint's metadata."""

    tree: Any
    plans: dict[str, TensorPlan]
    report: dict[str, Any]


class PlanFn(Protocol):
    """Plans tensors from this process's part of each (``shapes``: the full ``(numel, 1)``;
    ``sketch_cache``: kept across the bin counts tried for the same tensors, whose sketches do
    not depend on the bins; ``sample_weights``: the tensors given as samples, see
    :func:`~hf_dynaquant.core.quantizer.plan_quantization`)."""

    def __call__(
        self,
        tensors: Mapping[str, torch.Tensor],
        config: QuantConfig,
        *,
        shapes: Mapping[str, Any],
        types: Mapping[str, str],
        sketch_cache: dict | None = None,
        sample_weights: Mapping[str, int] | None = None,
    ) -> QuantPlan: ...


def _plan_here(
    tensors: Mapping[str, torch.Tensor],
    config: QuantConfig,
    *,
    shapes: Mapping[str, Any],
    types: Mapping[str, str],
    sketch_cache: dict | None = None,
    sample_weights: Mapping[str, int] | None = None,
) -> QuantPlan:
    """One process holds every value: the plan of the tensors themselves."""
    return plan_quantization(tensors, config, types=types, sketch_cache=sketch_cache, sample_weights=sample_weights)


def _float64(values: np.ndarray) -> np.ndarray:
    """One process's sum or maximum over the processes: the values themselves."""
    return np.asarray(values, dtype=np.float64)


def _mine(pid: Any) -> bool:
    """In one process every value is the process's own."""
    return True


def _from_start(local: dict[Any, int]) -> dict[Any, int]:
    """In one process every tensor's values begin at its start."""
    return dict.fromkeys(local, 0)


@dataclass(frozen=True)
class Reductions:
    """How :func:`encode_optimizer_state` combines what several processes hold of one optimizer
    state (each process some rows of every tensor); the defaults are one process's identities.

    Every process calls the encoder together with the same parameter ids and the same tensor
    structure; each callable below is then called on every process in the same order (it may be
    collective).

    Args:
        plan: the quantization plan of the full tensors from this process's part of each
            (:func:`hf_dynaquant.training.sharded.plan_sharded`: thresholds and codebooks from sketches
            merged over the processes); identical on every process.
        total: element-wise float64 sum of an array over the processes (an all-reduce): tensor
            sizes and the sums the fidelity check is made of.
        maximum: element-wise maximum over the processes (the top of each scale grid).
        counts: whether this process's values of parameter ``pid`` are its own part (rows
            nobody else holds); ``False`` for a copy that another process counts (state of a
            parameter every process holds whole), so nothing is counted twice.
        offsets: from ``{pid: how many values of its state this process counts}``, where those
            values begin in the flat full tensor (the counts of the processes before it): the
            samples the decisions read are the full tensor's (:func:`~hf_dynaquant.core.sketch.sample`).
    """

    plan: PlanFn = _plan_here
    total: Callable[[np.ndarray], np.ndarray] = _float64
    maximum: Callable[[np.ndarray], np.ndarray] = _float64
    counts: Callable[[Any], bool] = _mine
    offsets: Callable[[dict[Any, int]], dict[Any, int]] = _from_start


def _group_eps(state_dict: Mapping[str, Any]) -> dict[Any, float | None]:
    out: dict[Any, float | None] = {}
    for group in state_dict.get("param_groups", []):
        for pid in group.get("params", []):
            out[pid] = group.get("eps")
    return out


@dataclass(frozen=True)
class _Moment:
    """One parameter's state to quantize (Adam's moments or SGD's momentum buffer), from which
    the quantized forms are made when needed: a save never holds all of them at once."""

    kind: str  # ADAM or SGD
    entry: Mapping[str, Any]  # the parameter's optimizer state
    eps: float | None  # Adam's eps (its param group's)

    def target(self) -> torch.Tensor:
        """The tensor quantized like a weight, flat float32 on the CPU: Adam's update, or the momentum."""
        if self.kind == ADAM:
            return adam_update(self.entry["exp_avg"], self.entry["exp_avg_sq"], self.eps).reshape(-1)
        return self.entry["momentum_buffer"].detach().to("cpu", torch.float32).reshape(-1)

    def target_parts(self) -> Callable[[int, int, np.ndarray], None] | None:
        """:meth:`target` made a part at a time: Adam's update
        (:func:`~hf_dynaquant.core.moments.adam_update_parts`), a bfloat16 momentum widened
        (:func:`~hf_dynaquant.core.dtypes.bf16_parts`); None where it is made whole (or, a
        float32 momentum, read as it is)."""
        if self.kind != ADAM:
            return bf16_parts(self.entry["momentum_buffer"])
        return adam_update_parts(self.entry["exp_avg"], self.entry["exp_avg_sq"], self.eps)

    def numel(self) -> int:
        """How many values this process holds of the parameter's state."""
        return self.entry["exp_avg" if self.kind == ADAM else "momentum_buffer"].numel()

    def sampled(self, total: int, offset: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``(target, v, weight)``: :meth:`target` at the positions a sketch of the full tensor
        (``total`` values, this process's from ``offset``) samples (:func:`~hf_dynaquant.core.sketch.sample`),
        made from the moments' values there alone; Adam's ``v`` there (``None`` for SGD), which
        the scale gain is measured on; and their weight (1: every value)."""
        if self.kind == SGD:
            buf, weight = sample(self.entry["momentum_buffer"].detach().reshape(-1), total, offset)
            return buf.to("cpu", torch.float32), None, weight
        m, weight = sample(self.entry["exp_avg"].detach().reshape(-1), total, offset)
        v, _ = sample(self.entry["exp_avg_sq"].detach().reshape(-1), total, offset)
        return adam_update(m, v, self.eps).reshape(-1), v, weight

    def target_finite(self) -> bool:
        """Whether :meth:`target` is finite at every value where the scale is (an Adam state
        is quantized only when both are): without making it, since ``m / (sqrt(v) + eps)``
        with a finite ``v`` is finite where ``m`` is, unless the quotient overflows, which
        only an ``|m|`` near float32's largest over ``eps`` can make (then it is made and checked)."""
        if self.kind == SGD:  # (a float64 buffer's finite values may not be float32's)
            buf = self.entry["momentum_buffer"]
            return all_finite(buf) if buf.element_size() <= 4 else all_finite(self.target())
        m = self.entry["exp_avg"]
        if not m.numel():
            return True
        low, high = (float(x) for x in torch.aminmax(m.detach()))  # NaN and infinities come through
        if not (math.isfinite(low) and math.isfinite(high)):
            return False
        floor = float(np.float32(scale_floor(self.eps)))
        return max(-low, high) / floor < float(np.finfo(np.float32).max) / 2 or all_finite(self.target())

    def scale_source(self) -> torch.Tensor:
        """What the codes of Adam's scale ``log(sqrt(v) + eps)`` are made from: ``v`` itself,
        float32 on the CPU (no copy of a float32 ``v`` there), as the scale's plan partitions
        it (:func:`~hf_dynaquant.core.moments.scale_plan`: thresholds in ``v``'s domain), so
        a save takes no logarithm and makes no float32 scale."""
        return self.entry["exp_avg_sq"].detach().to("cpu", torch.float32).reshape(-1)

    def scale_parts(self) -> Callable[[int, int, np.ndarray], None] | None:
        """:meth:`scale_source` a part at a time where ``v`` is bfloat16
        (:func:`~hf_dynaquant.core.dtypes.bf16_parts`); None where it is read as it is."""
        return bf16_parts(self.entry["exp_avg_sq"])

    def scale_top(self) -> tuple[bool, float]:
        """Whether Adam's scale ``log(sqrt(v) + eps)`` is finite everywhere (no NaN or +inf in
        ``v``), and its maximum (``-inf`` for no values): the scale of ``v``'s maximum, as the
        scale grows with ``v``; one pass over ``v``, no logarithm but that one."""
        v = self.entry["exp_avg_sq"]
        if not v.numel():
            return True, -math.inf
        largest = float(v.detach().max())  # NaN if any is
        # (in float32, as the scale is made: a float64 v past float32's largest gives inf)
        top = float(adam_scale(torch.tensor([largest], dtype=torch.float32), self.eps)[0])
        return math.isfinite(top), top

    def scale_step(self, settings: MomentQuant) -> float:
        """The step of this Adam state's scale grid (finer for a bf16 ``v``)."""
        return settings.scale_step_for(self.entry["exp_avg_sq"].dtype)


@dataclass(frozen=True)
class _Choice:
    """How one parameter's target is quantized: its plan, the bin count that passed the fidelity
    check, and the gains the decoder applies (:func:`~hf_dynaquant.core.moments.norm_gain`,
    of the full tensor: the same on every process)."""

    plan: TensorPlan
    bins: int
    gain: float
    scale_gain: float = 1.0  # Adam's (:func:`~hf_dynaquant.core.moments.scale_gain`)


def _deferred(
    make: Callable[[], torch.Tensor],
    shape: tuple[int, ...],
    fill: Callable[[int, int, np.ndarray], None] | None = None,
) -> DeferredTensor:
    """A tree leaf of ``shape`` that the store makes with ``make()`` (flat) when it encodes it,
    or a part at a time with ``fill`` (float32) where its codec reads parts."""
    return DeferredTensor(shape, lambda: make().reshape(shape), fill=fill)


def _decide(
    group: list[Any],
    candidates: Mapping[Any, _Moment],
    settings: MomentQuant,
    red: Reductions,
    numel: Mapping[Any, int],
) -> tuple[dict[Any, _Choice], list[Any], dict[Any, float]]:
    """For the parameters of ``group`` (every process calls this with the same group): the
    choice for each whose target passes the fidelity check at some bin count, the ones whose
    moments hold NaN or inf, and the top of each Adam scale (over the processes)."""

    # where this process's values begin in each flat full tensor: the decisions read the values
    # a sketch samples of a large tensor (a plan, a fidelity check and a scale gain are
    # statistics of its values), the finiteness and the scale's maximum are of every value
    offsets = dict.fromkeys(group, 0)
    if any(numel[pid] >= SAMPLE_FROM for pid in group):  # (full sizes: the same answer on every process)
        offsets = red.offsets({pid: candidates[pid].numel() if red.counts(pid) else 0 for pid in group})

    def facts(pid: Any) -> tuple[torch.Tensor, torch.Tensor | None, int, bool, float, np.ndarray]:
        """The sampled target, v and weight, whether the target and the scale are finite, and
        the scale's maximum and scale gain sums (on the sample) on the configured grid (this process's)."""
        moment = candidates[pid]
        target, v, weight = moment.sampled(int(numel[pid]), offsets[pid])
        top, gain_sums, finite = -math.inf, np.zeros(2), True
        if moment.kind == ADAM:
            finite, top = moment.scale_top()
            if finite:
                gain_sums = adam_scale_stats(v, moment.eps, moment.scale_step(settings))[2]
        return target, v, weight, finite and moment.target_finite(), top, gain_sums

    targets: dict[Any, torch.Tensor] = {}
    sampled_v: dict[Any, torch.Tensor | None] = {}  # for a scale gain on a widened grid
    weights: dict[str, int] = {}
    local_bad, local_top, local_gain_sums = [], {}, {}
    for pid, (target, v, weight, finite, top, gain_sums) in zip(group, ordered_map(_POOL, facts, group)):
        targets[pid], sampled_v[pid], weights[str(pid)] = target, v, weight
        local_bad.append(red.counts(pid) and not finite)
        local_top[pid] = top
        local_gain_sums[pid] = gain_sums if red.counts(pid) else np.zeros(2)
    # moments holding NaN or inf (in any process's rows) cannot be quantized: kept as they are
    bad = [pid for pid, n in zip(group, red.total(np.array(local_bad, dtype=np.float64))) if n > 0]
    pending = [pid for pid in group if pid not in bad]
    chosen: dict[Any, _Choice] = {}
    # each target's sketches, made once for all the bin counts tried; the targets left were
    # found finite above, which the planners' caches are told (plan_quantization's key per
    # tensor, plan_sharded's list of non-finite ones) so that neither checks them again
    sketches: dict = {(str(pid), "finite"): True for pid in pending}
    sketches["non-finite"] = []
    for bins in settings.bins:
        if not pending:
            break
        # (min_numel=0: the candidates were chosen by their full sizes, and a sample is smaller)
        config = QuantConfig(bins=bins, prune=settings.prune, protect=0.0, min_numel=0, embedding_bins=bins)
        # the plan from this process's part of each tensor (a copy that another process counts adds nothing)
        parts = {str(pid): (targets[pid] if red.counts(pid) else targets[pid][:0]).reshape(-1, 1) for pid in pending}
        shapes = {str(pid): (int(numel[pid]), 1) for pid in pending}
        plan = red.plan(
            parts,
            config,
            shapes=shapes,
            types={n: "moment" for n in parts},
            sketch_cache=sketches,
            sample_weights={n: weights[n] for n in parts},
        )

        def sums_of(pid: Any, plan: QuantPlan = plan) -> np.ndarray:
            """The fidelity sums of one target quantized under ``plan`` (zeros for a copy another process counts)."""
            return quantization_sums(targets[pid], plan.tensors[str(pid)]) if red.counts(pid) else np.zeros(4)

        # tensor by tensor on the pool (the kernels release the GIL), a few at a time
        sums = np.array(list(ordered_map(_POOL, sums_of, pending))).reshape(-1, 4)
        sums = red.total(sums.reshape(-1)).reshape(-1, 4)  # the full tensors' sums
        for pid, row in zip(pending, sums):
            cos, rel = fidelity_from_sums(row)
            if cos >= settings.min_cosine and rel <= settings.max_rel_error:
                chosen[pid] = _Choice(plan.tensors[str(pid)], bins, norm_gain(row))
        pending = [pid for pid in pending if pid not in chosen]
    # the top of each chosen Adam scale's grid (the full tensor's maximum), and its scale gain
    # on that grid (the configured one unless the scale spans too many steps for it)
    adam = [pid for pid in chosen if candidates[pid].kind == ADAM]
    if not adam:
        return chosen, bad, {}
    tops = dict(zip(adam, red.maximum(np.array([local_top[pid] for pid in adam]))))
    for pid in adam:
        configured = candidates[pid].scale_step(settings)
        step = grid_step(tops[pid], candidates[pid].eps, configured)
        if step != configured and red.counts(pid):
            local_gain_sums[pid] = adam_scale_stats(sampled_v[pid], candidates[pid].eps, step)[2]
    gain_sums = red.total(np.concatenate([local_gain_sums[pid] for pid in adam])).reshape(-1, 2)
    for pid, row in zip(adam, gain_sums):
        chosen[pid] = replace(chosen[pid], scale_gain=scale_gain(row))
    return chosen, bad, tops


def encode_optimizer_state(
    state_dict: Mapping[str, Any],
    mode: str = "compress",
    settings: MomentQuant | None = None,
    reductions: Reductions | None = None,
    *,
    non_finite: str = "lossless",
    where: str | None = None,
    freed: ReleaseFreed | None = None,
) -> OptimizerEncoding | None:
    """Prepare an optimizer ``state_dict`` for storage in ``mode`` (``None`` for ``"drop"``).

    ``reductions`` (default: one process's) make processes that each hold rows of the state
    take the decisions of the full state (:class:`~hf_dynaquant.training.sharded.ShardedCompressor`).
    Moments holding NaN or infinite values are stored losslessly with a warning, or refused
    (``non_finite="raise"``, see ``QuantConfig.non_finite``); ``where`` (e.g. ``"step 40"``)
    goes in the message. ``freed`` paces handing the decisions' freed memory back (default:
    every :data:`~hf_dynaquant.core.memory.TRIM_EVERY` values; a save passes the one its write
    goes on with)."""
    if mode not in OPTIMIZER_MODES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_MODES}, got {mode!r}")
    if mode == "drop":
        return None
    if mode == "lossless":
        return OptimizerEncoding(dict(state_dict), {}, {"mode": "lossless"})
    settings = settings or MomentQuant()
    red = reductions or Reductions()
    eps_of = _group_eps(state_dict)
    new_state: dict[Any, Any] = {}
    eligible: dict[Any, tuple[str, torch.Tensor]] = {}  # pid -> (kind, the tensor whose size counts)
    for pid, entry in state_dict.get("state", {}).items():
        new_state[pid] = entry
        if not isinstance(entry, Mapping):
            continue
        m, v, buf = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("momentum_buffer")
        if (
            isinstance(m, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and m.is_floating_point()
            and m.shape == v.shape
            and eps_of.get(pid) is not None
            and set(entry) <= {"step", "exp_avg", "exp_avg_sq"}
        ):
            eligible[pid] = (ADAM, m)
        elif isinstance(buf, torch.Tensor) and buf.is_floating_point() and set(entry) == {"momentum_buffer"}:
            eligible[pid] = (SGD, buf)
    # sizes of the full tensors (each process counts its own rows)
    local_numel = np.array([t.numel() if red.counts(pid) else 0 for pid, (_, t) in eligible.items()])
    numel = dict(zip(eligible, red.total(local_numel))) if eligible else {}
    candidates = {
        pid: _Moment(kind, state_dict["state"][pid], eps_of[pid])
        for pid, (kind, _) in eligible.items()
        if numel[pid] >= settings.min_numel
    }
    # the decisions, a group of parameters at a time (the same groups on every process: by the
    # full sizes): each group's targets exist only while it is decided, and the store makes them
    # again when it encodes them, so a save never holds the whole optimizer's float32 forms
    chosen: dict[Any, _Choice] = {}
    tops: dict[Any, float] = {}
    bad: list[Any] = []
    freed = freed if freed is not None else ReleaseFreed()
    for group in weighed_batches(list(candidates), numel.__getitem__, VALUES_IN_FLIGHT):
        group_chosen, group_bad, group_tops = _decide(group, candidates, settings, red, numel)
        chosen.update(group_chosen)
        bad += group_bad
        tops.update(group_tops)
        freed.processed(int(sum(numel[pid] for pid in group)))
    names = {ADAM: "Adam moments (exp_avg, exp_avg_sq)", SGD: "momentum_buffer"}
    refuse_or_warn_non_finite(
        [f"the {names[candidates[pid].kind]} of parameter {pid}" for pid in bad], non_finite, where
    )
    report: dict[str, Any] = {"mode": "compress", "settings": settings.to_dict(), "lossless": [], "bins": {}}
    if bad:
        report["non_finite"] = bad  # stored losslessly: their moments hold NaN or inf
    plan_by_leaf: dict[int, TensorPlan] = {}
    for pid, moment in candidates.items():
        if pid in bad:
            continue
        if pid not in chosen:
            report["lossless"].append(pid)  # failed every bin count: kept as it is
            continue
        choice = chosen[pid]
        report["bins"][str(pid)] = choice.bins
        original = moment.entry
        if moment.kind == ADAM:
            shape = tuple(original["exp_avg"].shape)
            u = _deferred(moment.target, shape, moment.target_parts())
            s = _deferred(moment.scale_source, shape, moment.scale_parts())
            new_state[pid] = {
                "step": original["step"],
                "dq_moments": ADAM,
                "dq_dtype": str(original["exp_avg"].dtype),
                "dq_update": u,
                "dq_scale": s,
                "dq_gain": choice.gain,
                "dq_scale_gain": choice.scale_gain,
            }
            plan_by_leaf[id(u)] = choice.plan
            plan_by_leaf[id(s)] = scale_plan(tops[pid], moment.eps, moment.scale_step(settings))
        else:
            shape = tuple(original["momentum_buffer"].shape)
            buf = _deferred(moment.target, shape, moment.target_parts())
            new_state[pid] = {
                "dq_moments": SGD,
                "dq_dtype": str(original["momentum_buffer"].dtype),
                "dq_momentum": buf,
                "dq_gain": choice.gain,
            }
            plan_by_leaf[id(buf)] = choice.plan
    tree = {**state_dict, "state": new_state}
    _, leaves = flatten_tree(tree)
    plans = {key: plan_by_leaf[id(t)] for key, t in leaves.items() if id(t) in plan_by_leaf}
    report["quantized"] = len(chosen)
    return OptimizerEncoding(tree, plans, report)


@dataclass(frozen=True)
class TensorKey:
    """Stands for a tensor in a stored tree read without its tensors (see :func:`decode_optimizer_state`)."""

    key: str


def decode_optimizer_state(
    tree: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor | Coded]],
    fetch: Callable[[str], torch.Tensor],
    *,
    where: str = "optimizer state",
) -> dict[str, Any]:
    """The optimizer ``state_dict`` back from a stored tree (any mode but ``"drop"``) whose
    tensors arrive one by one: ``tree`` holds a :class:`TensorKey` for each tensor
    (``EntryReader.tree(name, leaf=TensorKey)``), ``tensors`` yields ``(key, tensor)`` (the tree's
    section decoded in any order, :meth:`~hf_dynaquant.store.EntryReader.iter_section`; the keys
    :func:`as_codes` selects may come as their codes), and ``fetch`` gives a key that never arrives
    (raising what is wrong with it). Each parameter's state is converted as soon as its tensors
    are in, so only a few parameters' stored forms are held at once, never the whole optimizer's
    (a bf16 model's restore held 2.2x its checkpoint in them)."""
    eps_of = _group_eps(tree)
    order = list(tree.get("state", {}))
    stored = dict(tree.get("state", {}))  # parameters not converted yet
    waiting = {pid: {k.key for k in _keys_in(entry)} for pid, entry in stored.items()}
    owner = {key: pid for pid, keys in waiting.items() for key in keys}
    arrived: dict[str, torch.Tensor | Coded] = {}
    state: dict[Any, Any] = {}

    def take(key: str) -> torch.Tensor | Coded:
        return arrived.pop(key) if key in arrived else fetch(key)

    freed = ReleaseFreed(_RESTORE_TRIM_EVERY)

    def finish(pid: Any) -> None:
        entry = state[pid] = _decoded_entry(pid, _filled(stored.pop(pid), take), eps_of, where)
        if isinstance(entry, Mapping):
            freed.processed(sum(t.numel() for t in entry.values() if isinstance(t, torch.Tensor)))

    for key, tensor in tensors:
        arrived[key] = tensor  # (a tensor outside the per-parameter state waits for the rest of the tree)
        pid = owner.get(key)
        if pid is not None:
            waiting[pid].discard(key)
            if not waiting[pid] and pid in stored:
                finish(pid)
    for pid in list(stored):  # parameters without tensors, or whose tensors the section did not yield
        finish(pid)
    rest = {k: _filled(v, take) for k, v in tree.items() if k != "state"}
    return {**rest, "state": {pid: state[pid] for pid in order}}


def _keys_in(obj: Any) -> Iterator[TensorKey]:
    if isinstance(obj, TensorKey):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _keys_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _keys_in(v)


def _filled(obj: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """``obj`` with each :class:`TensorKey` replaced by ``tensor(key)``."""
    if isinstance(obj, TensorKey):
        return tensor(obj.key)
    if isinstance(obj, Mapping):
        return {k: _filled(v, tensor) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_filled(v, tensor) for v in obj)
    if isinstance(obj, list):
        return [_filled(v, tensor) for v in obj]
    return obj


def _gain(entry: Mapping[str, Any], key: str, pid: Any, where: str) -> float:
    """A stored gain (``dq_gain`` or ``dq_scale_gain``): 1.0 where the entry has none (written
    before it existed), refused unless a positive finite number."""
    gain = entry.get(key, 1.0)
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 < gain < math.inf:
        name = {"dq_gain": "moment norm gain", "dq_scale_gain": "scale gain"}[key]
        raise FormatError(f"{where}: parameter {pid} has a {name} {gain!r}, not a positive finite number")
    return float(gain)


def as_codes(key: str) -> bool:
    """Whether :func:`decode_optimizer_state` takes this stored tensor as its codes, where it has
    plain ones (``EntryReader.iter_section(..., coded=as_codes)``): Adam's update and scale,
    whose moments it makes straight from them (:func:`~hf_dynaquant.core.moments.codes_to_adam`)."""
    return key.rpartition("/")[2] in ("dq_update", "dq_scale")


def _values(x: torch.Tensor | Coded) -> torch.Tensor:
    """A stored tensor's float32 values: as it came, or decoded from its codes."""
    if isinstance(x, torch.Tensor):
        return x
    return coded_values(x)


def _decoded_entry(pid: Any, entry: Any, eps_of: Mapping[Any, float | None], where: str) -> Any:
    """One parameter's optimizer state back from its stored form (freshly decoded: Adam's
    moments are made from the codes of its update and scale, or from their float32 values in
    place)."""
    kind = entry.get("dq_moments") if isinstance(entry, Mapping) else None
    if kind is None:
        return entry
    dtype = _DTYPES.get(entry.get("dq_dtype", ""))
    if dtype is None:
        raise FormatError(f"{where}: parameter {pid} has an unknown moment dtype {entry.get('dq_dtype')!r}")
    gain = _gain(entry, "dq_gain", pid, where)
    if kind == ADAM:
        if eps_of.get(pid) is None:
            raise FormatError(f"{where}: parameter {pid} has Adam moments but its param group has no eps")
        u, s, eps = entry["dq_update"], entry["dq_scale"], eps_of[pid]
        gains = {"gain": gain, "scale_gain": _gain(entry, "dq_scale_gain", pid, where)}
        try:
            if isinstance(u, torch.Tensor) or isinstance(s, torch.Tensor):
                m, v = update_scale_to_adam(_values(u), _values(s), eps, dtype, **gains, inplace=True)
            else:
                m, v = (t.reshape(u.shape) for t in codes_to_adam(u, s, eps, dtype, **gains))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: parameter {pid}'s Adam moments: {exc}") from None
        return {"step": entry["step"], "exp_avg": m, "exp_avg_sq": v}
    if kind == SGD:
        return {"momentum_buffer": entry["dq_momentum"].mul(gain).to(dtype)}
    raise FormatError(f"{where}: parameter {pid} uses moment encoding {kind!r}, unknown to this version")
