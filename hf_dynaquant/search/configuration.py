"""The quantization configuration manager (DynaQuant section 5, Alg. 4, Table 7).

The user states how much quality one checkpoint may lose (a metric, its direction, a threshold
of relative degradation and evaluation data); the manager finds the most compressive
configuration that keeps to it, at every checkpoint, cheaply:

* **The pass rule.** The baseline (the uncompressed weights) and a candidate are evaluated on
  the same examples, so a degradation is a paired difference; a metric that can (see
  :class:`QualityMetric`) gives its standard error, and a candidate passes when its degradation
  plus ``z`` (1.645) standard errors is within the threshold, for every measure the metric
  reports (e.g. the user's metric and the loss): a candidate truly past the threshold passes at
  most 5% of the time, however few the examples. The chosen candidate's standard error is in
  :class:`SearchResult` (what the test could resolve).
* **A time bound.** Each candidate costs a pass over the evaluation data, which at 100M+
  parameters on a CPU is minutes. With ``seconds`` the search evaluates no further candidate once
  that many seconds of this checkpoint's search are spent (every rank stops at the same round):
  the checkpoint then takes the passing configuration found, and without one it is stored
  losslessly (mode ``"out of time"``, with a warning), never with an unverified configuration.
* **Restores.** A candidate is judged on exactly the weights a resume from it loads, so the
  threshold bounds what one restore costs. Restores did not add up in our measurement
  (``benchmarks/bench_restore_budget.py``: tiny GPT-2 from scratch, 200 steps, resumed at all 10
  checkpoints, optimizer state lossless: final eval loss -1.1%, -0.3% and -0.8% against the
  uncompressed run at 32, 8 and 3 bins with 30% pruning, whose decoded weights are 6.8%, 19% and
  39% off in relative L2; the spread over data orders is 3.5%), while the compressed optimizer
  state cost +0.1% to +3.0% over the same restores, which no evaluation of a checkpoint sees.
  So no tighter threshold is applied to checkpoints that may be resumed; each candidate's
  relative L2 error of the decoded weights against the uncompressed ones is recorded
  (``weight_error``) so a run can be audited for it.

* **First checkpoint: guided exhaustive search, smallest first.** A candidate's size is
  *measured* without evaluating the model: plan it (the per-tensor sketches are shared, so this
  is mostly K-means) and take the entropy of its codes plus 16 bits per protected value. Both
  pruning criteria share one queue ordered by measured size, so the first candidate that passes
  is the most compressive one and ends the search. Size rises with bins and with protection (in
  every cube we measured), so the queue walks out from the most compressive corner and sizes a
  point only when the point before it leaves: no plan of the whole cube up front. Quality is
  *not* monotone along the axes on real models (pruning can lower the loss; near the threshold
  more bins can cost quality), so a failure condemns the points below it only when it is clear:
  past the threshold by twice the larger of the threshold and the largest inversion seen so far
  at this checkpoint (a configuration losing against one below it). The rule loosens itself
  where the metric is noisy. A failure far past that margin has the search try the top of its
  column (same pruning level and criterion), which condemns the column in one evaluation when it
  fails clearly too. Without pruning the pruning criterion changes nothing: such configurations
  are planned and evaluated once.
* **Residual coding** (``QuantConfig.residual``) is one more axis: a candidate codes the weights
  themselves (``"none"``) or their residual against a reference the decoder has (``"previous"``:
  the last checkpoint's decoded weights; ``"pretrained"``: the weights a fine-tune started from),
  each offered where the caller hands :meth:`ConfigurationSearch.search` its :class:`Reference`.
  Every residual kind's columns share the one queue, so the choice is by size at passing
  quality: by *chain cost*, this checkpoint's measured size plus what the next checkpoint of the
  same kind is expected to cost (:meth:`ConfigurationSearch.chain_cost`). A kind whose codes
  persist between checkpoints (the weights, their residual on the pre-trained weights) stores
  the next one as a small code delta, while a residual on the previous checkpoint has new codes
  every time; ranking by this checkpoint's size alone switched kinds for a saving that the next
  checkpoints paid back.
* **Later checkpoints: epsilon-neighbourhood.** Candidates are the last choice (under both
  pruning criteria) and, when it fails, the configurations at most ``epsilon`` steps away that are
  *not more aggressive*, lowest chain cost first; the first that passes ends the round (a residual
  on the previous checkpoint, the update made since, shrinks as the learning rate decays: when
  its last choice passes, its bolder points around it are judged too). Round
  1 also tries the last point under the other available residual kinds; when round 1 found a
  passing candidate, their points at most ``epsilon`` steps away in every direction (that point
  is not their own) are sized too, and those of lower chain cost than it are evaluated, lowest
  first. If none passes, the exhaustive search runs again (counted as a fallback); so does it
  when the last residual is not available (a keyframe has no previous checkpoint to code against).
* **Data-parallel.** With ``torch.distributed`` initialised, each round hands one candidate to
  each rank (and sizes are measured the same way); results are all-gathered, so every rank picks
  the same configuration.
* **Sharded models (lockstep).** Under FSDP every forward needs every rank, so candidates cannot
  be spread: with a :class:`Lockstep` all ranks plan (from sketches merged over the ranks),
  size and evaluate the same candidate together, sizes are summed over the ranks and metric
  values averaged, so every rank takes the same decisions (see :mod:`hf_dynaquant.training.sharded`).
* **Safe evaluation.** A candidate is evaluated by writing its dequantized values into the live
  model in place and copying the originals back from the checkpoint's CPU snapshot (which the
  compressor holds anyway: no deep copy of the model), under ``torch.no_grad``, in eval mode,
  with the train/eval mode restored: the weights are bit-identical after. The process-wide RNG
  states are saved and restored around evaluations only on the thread that made the search (the
  training thread); on a background thread they are left alone, since restoring them there would
  rewind the training loop's draws (:mod:`hf_dynaquant.core.rng`). A metric of your own that draws
  random numbers must therefore not run in the background (``background=False``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.collectives import all_gather, all_sum, broadcast, rank_world
from ..core.dtypes import all_finite
from ..core.memory import ReleaseFreed
from ..core.pool import VALUES_IN_FLIGHT, ForkSafePool, ordered_map
from ..core.quantizer import (
    EMBEDDING,
    Calibration,
    QuantConfig,
    QuantPlan,
    TensorPlan,
    plan_quantization,
    read_config_record,
    refuse_or_warn_non_finite,
)
from ..core.rng import preserved_rng
from ..errors import InvalidSettingError
from ..renames import renamed_attribute, renamed_keywords
from .measures import DeviceTensors, Measured, host_measure, live_tensor
from .quality import Measurement, QualityMetric
from .space import Candidate, Reference, SearchResult, SearchSpace

__all__ = ["ConfigurationSearch", "Lockstep", "evaluate_plan", "measured_bits"]

T = TypeVar("T")
_POOL = ForkSafePool("dq-search")  # sizes and decodes a candidate's tensors a few at a time


# ---------------------------------------------------------------------------------------------
# evaluation


@contextmanager
def evaluation_mode(model: torch.nn.Module, rng: bool):
    """Eval mode and no gradients; the train/eval mode restored afterwards, and with ``rng`` (the
    caller's thread owns the process-wide generators) every RNG state too."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), preserved_rng() if rng else nullcontext():
            yield
    finally:
        model.train(was_training)


def _code_totals(
    snapshot: Mapping[str, torch.Tensor],
    plan: QuantPlan,
    base_codes: Mapping[str, np.ndarray] | None = None,
    device: DeviceTensors | None = None,
) -> np.ndarray:
    """``[bits, quantized values]`` of ``plan`` on ``snapshot`` (summable over shards), error
    feedback and the trellis left out (see :func:`measured_bits`); measured as :func:`_measured` does."""
    plan = QuantPlan(plan.config, {n: replace(tp, nearest=True) for n, tp in plan.tensors.items()})
    totals = np.zeros(2)
    for _, _, sums in _measured(plan, snapshot, base_codes, device, decode=False):
        totals += sums[:2]
    return totals


def _measured(
    plan: QuantPlan,
    snapshot: Mapping[str, torch.Tensor],
    base_codes: Mapping[str, np.ndarray] | None,
    device: DeviceTensors | None,
    decode: bool,
    kept: dict[str, tuple[TensorPlan, Measured]] | None = None,
) -> Iterator[Measured]:
    """Each of the plan's tensors measured (:func:`~.measures.host_measure`), in order: on the
    accelerator that holds the model, one after another (``device``, when it takes the plan), or
    on the host, a few tensors at a time on the search's pool. The same results either way.
    ``kept``: a tensor rounded by the trellis by kind of row (an input embedding's, whose plan
    the planner gives every candidate that shares its thresholds: the same object) is measured
    once while its plan stays the same, and kept there."""
    base_codes = base_codes or {}
    if device is not None and device.takes(plan):
        for name, tp in plan.tensors.items():
            yield device.measure(name, tp, snapshot[name], decode)
        return

    def measure(item: tuple[str, TensorPlan]) -> Measured:
        name, tp = item
        keep = kept is not None and tp.trellis_steps is not None and tp.rare_rows is not None and name not in base_codes
        if keep and name in kept and kept[name][0] is tp:
            return kept[name][1]
        result = host_measure(name, tp, snapshot[name], base_codes.get(name), decode)
        if keep:
            kept[name] = (tp, result)
        return result

    yield from _on_pool(measure, plan, snapshot)


def _on_pool(
    fn: Callable[[tuple[str, TensorPlan]], T], plan: QuantPlan, snapshot: Mapping[str, torch.Tensor]
) -> Iterator[T]:
    """``fn((name, tensor plan))`` of each of the plan's tensors, in order, computed on the
    search's pool with at most :data:`~hf_dynaquant.core.pool.VALUES_IN_FLIGHT` values in flight."""
    freed = ReleaseFreed()  # the threads' temporaries go back to the system as they are freed
    items = list(plan.tensors.items())
    numel = lambda item: snapshot[item[0]].numel()  # noqa: E731
    for item, result in zip(items, ordered_map(_POOL, fn, items, weight=numel, budget=VALUES_IN_FLIGHT)):
        yield result
        freed.processed(numel(item))


def measured_bits(
    snapshot: Mapping[str, torch.Tensor], plan: QuantPlan, *, base_codes: Mapping[str, np.ndarray] | None = None
) -> float:
    """Bits per quantized value of ``plan`` on ``snapshot`` (the ``bits`` of :func:`evaluate_plan`),
    without touching the model: what the search orders its candidates by. ``base_codes`` (the
    base entry's codes by tensor name, when the checkpoint will be a delta on it) counts a
    tensor's code delta where that is smaller. Error feedback (``QuantConfig.error_feedback``) is
    left out of the sizes: it changes which centre a value gets, not how many values each centre
    gets (sizes within 0.1% on MiniLM), and costs a pass per column, too much for every point
    the search sizes; :func:`evaluate_plan` measures with it. So is the trellis
    (``QuantConfig.trellis``): its symbols are sized as nearest rounding's."""
    bits, total = _code_totals(snapshot, plan, base_codes)
    return bits / max(total, 1.0)


def evaluate_plan(
    model: torch.nn.Module,
    snapshot: Mapping[str, torch.Tensor],
    plan: QuantPlan,
    metric: QualityMetric,
    *,
    preserve_rng: bool = True,
    base_codes: Mapping[str, np.ndarray] | None = None,
) -> tuple[float, float]:
    """``(metric value, measured bits per value)`` of the model with the plan's tensors
    quantized; the live weights are restored from ``snapshot`` bit-exactly afterwards, and with
    ``preserve_rng`` every process-wide RNG state (pass ``False`` off the training thread, see
    :mod:`hf_dynaquant.core.rng`); ``base_codes``: see :func:`measured_bits`."""
    value, totals = _evaluate(model, snapshot, plan, metric, preserve_rng, base_codes)
    return value.value, float(totals[0] / max(totals[1], 1.0))


def _evaluate(
    model: torch.nn.Module,
    snapshot: Mapping[str, torch.Tensor],
    plan: QuantPlan,
    metric: QualityMetric,
    preserve_rng: bool,
    base_codes: Mapping[str, np.ndarray] | None = None,
    device: DeviceTensors | None = None,
    kept: dict[str, tuple[TensorPlan, Measured]] | None = None,
) -> tuple[Measurement, np.ndarray]:
    """:func:`evaluate_plan` with the metric's :class:`Measurement` and ``[bits, quantized values,
    squared error, squared norm]`` of the quantized tensors (the sizes as :func:`_code_totals`;
    the error of the decoded values against the exact ones), which sum over the shards of a
    sharded model. Each tensor is measured (on ``device`` when given, see :func:`_measured`)
    before its decoded values are written into the model. ``kept``: measurements an earlier
    evaluation of the same search kept (see :func:`_measured`)."""
    totals = np.zeros(4)

    def decoded() -> Iterator[tuple[str, torch.Tensor]]:
        for name, values, sums in _measured(plan, snapshot, base_codes, device, decode=True, kept=kept):
            totals[:] += sums
            yield name, values

    with evaluation_mode(model, preserve_rng), written(model, snapshot, decoded()):
        value = metric.measure(model)
    return value, totals


@contextmanager
def written(
    model: torch.nn.Module, snapshot: Mapping[str, torch.Tensor], values: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[None]:
    """The model with each ``(name, values)`` written into its tensor in place, in this thread
    (on its CUDA stream), as they come; the originals copied back from ``snapshot`` afterwards,
    bit-exactly, however the block ends."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for name, new in values:
            live = live_tensor(model, name)
            swapped.append((live, snapshot[name]))
            live.copy_(new.view(live.shape).to(live.dtype))
        yield
    finally:
        for live, original in swapped:
            live.copy_(original)


@dataclass(frozen=True)
class Lockstep:
    """How a search runs when every evaluation needs every rank (a sharded model: under FSDP a
    forward pass is collective). All ranks plan, size and evaluate the same candidates, in the
    same order; nothing is spread over the ranks.

    Args:
        plan: the plan of a configuration, identical on every rank for the tensors it covers
            (:func:`hf_dynaquant.training.sharded.plan_sharded`: from sketches merged over the ranks).
            Called on every rank together (it may be collective).
        all_sum: element-wise sum of a float64 array over the ranks (an all-reduce).
        ranks: the number of ranks; a metric value is averaged over them, so that every rank
            judges a candidate alike even when each evaluates its own data shard.
    """

    plan: Callable[[QuantConfig], QuantPlan]
    all_sum: Callable[[np.ndarray], np.ndarray]
    ranks: int

    def agree(self, value: float) -> float:
        """The mean of a metric value over the ranks."""
        return float(self.all_sum(np.array([value], dtype=np.float64))[0] / self.ranks)


# ---------------------------------------------------------------------------------------------
# the manager

# A failure condemns the configurations below it only when it exceeds the threshold by this many
# times the larger of the threshold and the largest inversion seen (see _Context.condemned).
_CLEAR_FAIL = 2.0
# A failure this many times past that margin makes the search evaluate the top of its column.
_FAR = 4.0
# One-sided 95%: a candidate passes when its degradation + DEFAULT_Z standard errors is within the threshold.
DEFAULT_Z = 1.645


def pass_rule(measures: Mapping[str, tuple[float, float]], threshold: float, z: float) -> tuple[bool, float, float]:
    """``(passed, degradation, standard error)`` of a candidate with ``measures`` (name ->
    (degradation, standard error)): it passes when every measure's degradation plus ``z``
    standard errors is within ``threshold``; the degradation and standard error returned are the
    binding measure's (the largest bound)."""

    def bound(item: tuple[str, tuple[float, float]]) -> float:
        deg, se = item[1]
        value = deg + z * se
        return value if math.isfinite(value) else math.inf

    _, (deg, se) = max(measures.items(), key=bound)
    return all(bound(item) <= threshold for item in measures.items()), deg, se


@renamed_keywords(space="search_space", base="config")
class ConfigurationSearch:
    """Chooses a :class:`QuantConfig` per checkpoint (see the module docstring).

    Args:
        metric: the quality measure (see :func:`mean_loss`, :func:`accuracy`, ...).
        threshold: how much worse (relative, 0.01 = 1%) the metric may be on a decoded
            checkpoint, and so on a run resumed from it, than on the uncompressed weights, with
            one-sided 95% confidence (``z``) where the metric gives a standard error. The default,
            1%, comes from our GPT-2 and CNN runs (benchmarks/RESULTS.md): it keeps 4-16 bins and
            19-127x on the weights; at 0.1% the later GPT-2 checkpoints need 48-128 bins, beyond
            the cube's 32, and would be stored losslessly; 5% lets the coarsest bins through
            everywhere.
        search_space: the configuration cube (``space=`` before).
        epsilon: neighbourhood radius, in cube steps, at later checkpoints.
        config: the fixed knobs (sigma, alpha, min_numel, seed) of every candidate (``base=`` before).
        z: standard errors added to a degradation before it is compared with the threshold
            (1.645: one-sided 95%; 0: the degradation alone, as before the standard error).
        seconds: the most one checkpoint's search may take before it evaluates no further
            candidate (``None``: unbounded; see the module docstring).
        progress: show a progress bar of the evaluated candidates (for one-off searches such as a
            pre-trained snapshot's; off during training, where the search runs at every save).
    """

    def __init__(
        self,
        metric: QualityMetric,
        threshold: float = 0.01,
        *,
        search_space: SearchSpace | None = None,
        epsilon: int = 1,
        config: QuantConfig | None = None,
        z: float = DEFAULT_Z,
        seconds: float | None = None,
        progress: bool = False,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if not z >= 0:
            raise ValueError(f"z must be >= 0, got {z}")
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise InvalidSettingError(f"the search's seconds must be a finite number > 0 or None, got {seconds!r}")
        self.metric, self.threshold, self.z, self.seconds = metric, threshold, z, seconds
        self.progress = progress
        self.search_space, self.epsilon = search_space or SearchSpace(), epsilon
        self.config = config or QuantConfig()
        self.last: QuantConfig | None = None
        # per residual kind, the bits a value of its last checkpoint that was a delta on one of its own
        # kind: what the next checkpoint of that kind is expected to cost (see chain_cost)
        self.delta_bits: dict[str, float] = {}
        self.fallbacks = 0
        self._rng_thread = threading.get_ident()  # the thread that made the search: the training thread

    space = renamed_attribute("space", "search_space")
    base = renamed_attribute("base", "config")

    def continue_from(self, config: Mapping[str, Any] | None, delta_bits: Mapping[str, float] | None = None) -> None:
        """Go on from the configuration a stored checkpoint records (its ``quant_config``
        metadata, with the key names of any version: see
        :func:`~hf_dynaquant.core.quantizer.read_config_record`), as if this search had chosen it: a
        run resumed in a new process searches the neighbourhood of where it stopped instead of the
        whole cube. Nothing (a lossless or fixed-configuration checkpoint, or a configuration off
        this search's cube) leaves the next search exhaustive. ``delta_bits``: the search's
        :attr:`delta_bits` when it wrote that checkpoint (its record's ``delta_bits``; see
        :meth:`chain_cost`)."""
        self.delta_bits = dict(delta_bits or {})
        self.last = None
        if not config:
            return
        fields = ("bins", "prune", "protect", "prune_by", "embedding_bins", "residual")
        record = read_config_record(config)
        chosen = {k: record[k] for k in fields if k in record}
        try:
            last = replace(self.config, **chosen)
        except (TypeError, ValueError):  # a value QuantConfig refuses
            return
        if self.search_space.holds(last):
            self.last = last

    def agree(self) -> None:
        """With several processes, every rank takes rank 0's position (collective: every rank
        calls it). After a resume only the writing rank reads the stored configuration
        (:meth:`continue_from`), while the next search is spread over all ranks, which must
        search alike (with the same chain costs)."""
        self.last, self.delta_bits = broadcast((self.last, self.delta_bits))

    def judge(
        self, config: QuantConfig, measures: Mapping[str, tuple[float, float]], bits: float, plan: QuantPlan | None
    ) -> Candidate:
        """The candidate ``config`` with its measures (name -> (degradation, standard error)). It
        passes when every measure's degradation plus ``z`` standard errors is within the
        threshold: with ``z`` = 1.645, a candidate whose true degradation exceeds the threshold
        passes at most 5% of the time (one-sided), whatever the sampling error of the evaluation
        data. The candidate's degradation is that of the binding measure (the largest bound)."""
        passed, deg, se = pass_rule(measures, self.threshold, self.z)
        return Candidate(config, deg, bits, passed, plan, standard_error=se, measures=dict(measures))

    def chain_cost(self, config: QuantConfig, bits: float) -> float:
        """What choosing ``config`` (measured at ``bits`` per value as stored) costs this
        checkpoint and the next: the search minimises this, not this checkpoint's size alone. The
        next checkpoint of the same residual kind is expected to cost what that kind's last delta
        on one of its own kind cost, or, with no such delta yet, what this candidate costs. A kind
        whose codes persist between checkpoints (the weights, or their residual on the pre-trained
        weights: the next checkpoint stores a small code delta) is charged its full price once
        when the run switches to it, while a residual on the previous checkpoint, whose codes are
        new at every checkpoint, costs its full size each time. Ranked by size alone, a fine-tune
        took previous-checkpoint residuals for three checkpoints at 3.1-3.6 MB each, after
        pre-trained residual deltas of 2.3-2.8 MB, and paid 3.8 MB to come back to deltas of
        0.3-1 MB (benchmarks/RESULTS.md, issue 15)."""
        return bits + self.delta_bits.get(config.residual, bits)

    def candidate_cost(self, candidate: Candidate) -> float:
        """:meth:`chain_cost` of an evaluated candidate."""
        return self.chain_cost(candidate.config, candidate.bits)

    def owns_rng(self) -> bool:
        """Whether this thread may save and restore the process-wide RNG states around an
        evaluation: only the thread that made the search (training). On a background thread the
        search leaves them alone (see :mod:`hf_dynaquant.core.rng`); evaluations run in eval mode,
        where a model draws no random numbers."""
        return threading.get_ident() == self._rng_thread

    def search(
        self,
        model: torch.nn.Module,
        snapshot: Mapping[str, torch.Tensor],
        *,
        types: Mapping[str, str] | None = None,
        sensitivity: Mapping[str, torch.Tensor] | None = None,
        lockstep: Lockstep | None = None,
        where: str | None = None,
        references: Mapping[str, Reference] | None = None,
        base_codes: Mapping[str, np.ndarray] | None = None,
        base_is_last: bool = True,
        calibration: Calibration | None = None,
    ) -> SearchResult:
        """Choose the configuration for the checkpoint whose exact weights are ``snapshot``
        (names as in ``model.state_dict()``; only the tensors to quantize are needed). With
        ``lockstep`` (a sharded model) ``snapshot`` and ``sensitivity`` hold this rank's shards
        and every rank evaluates every candidate together (see :class:`Lockstep`). ``where``
        (e.g. ``"step 40"``) names the checkpoint in warnings and errors. ``references`` offers
        residual coding: ``{kind: Reference}`` for the kinds available at this checkpoint (those
        of ``search_space.residuals``; ``"none"`` needs none). Not in lockstep (sharded models code directly).
        ``base_codes``: the codes of the entry this checkpoint will be a delta on, by tensor name;
        sizes then count each tensor's code delta where it is smaller (see :func:`measured_bits`),
        so that direct coding, whose codes change little between checkpoints, is sized as stored.
        ``base_is_last``: whether that entry is the last checkpoint (False for an anchor, coded
        on its chain's keyframe, ``restore_depth``): only then is the chosen size what the next
        checkpoint of its kind is expected to cost (:meth:`chain_cost`).
        ``calibration``: what candidates with ``error_feedback`` round with (see :func:`plan_quantization`).

        A metric that is NaN or infinite on the unquantized model (weights holding NaN after a
        divergence) leaves nothing to compare candidates with: the checkpoint is stored
        losslessly, after the tensors at fault are named (or refused, see ``QuantConfig.non_finite``)."""
        started = time.perf_counter()
        with evaluation_mode(model, self.owns_rng()):
            measured = self.metric.measure(model)
        baseline = lockstep.agree(measured.value) if lockstep is not None else measured.value
        if not math.isfinite(baseline):
            return self._non_finite_baseline(baseline, snapshot, where, lockstep)
        prune_by = [m for m in self.search_space.prune_by if m == "magnitude" or sensitivity]
        references = dict(references or {})
        if lockstep is not None and references:
            raise InvalidSettingError("residual coding is not available for sharded models (lockstep): direct only")
        residuals = [r for r in self.search_space.residuals if r == "none" or r in references] or ["none"]
        ctx = _Context(self, model, snapshot, types, sensitivity, measured, prune_by, lockstep, where, references)
        ctx.residuals = residuals
        ctx.base_codes = dict(base_codes or {})
        ctx.device = DeviceTensors.of(model, snapshot, ctx.base_codes, ctx.sketches)
        ctx.calibration = calibration
        ctx.deadline = None if self.seconds is None else started + self.seconds
        mode = "exhaustive"
        ctx.bar = tqdm(desc="searching", unit="candidate", disable=not self.progress)
        try:
            if self.last is not None and self.last.prune_by in prune_by and self.last.residual in residuals:
                mode = "neighbourhood"
                found = ctx.neighbourhood(self.last, prune_by)
                if found is None:
                    self.fallbacks += 1
                    mode = "fallback"
                    found = ctx.exhaustive(prune_by)
            else:
                found = ctx.exhaustive(prune_by)
        except _OutOfTime:
            # a passing candidate of an unfinished round (round 1 of a neighbourhood), if any
            found = min((c for c in ctx.tried if c.passed), key=self.candidate_cost, default=None)
            mode = "out of time"
        finally:
            ctx.bar.close()
        if found is None:
            late = mode == "out of time"
            why = f"spent its {self.seconds:g} s after {len(ctx.tried)} candidate(s) without a" if late else "found no"
            warnings.warn(
                f"the configuration search{f' at {where}' if where else ''} {why} configuration that keeps the "
                f"{self.metric.name} degradation within {self.threshold:.2%}: this checkpoint is stored losslessly"
                + (" (evaluate on fewer examples, or allow the search more seconds)" if late else ""),
                stacklevel=2,
            )
            return SearchResult(
                None,
                None,
                baseline,
                mode,
                ctx.tried,
                local_evaluations=ctx.local,
                sized=ctx.sized,
                z=self.z,
                delta_bits=dict(self.delta_bits),
            )
        found = ctx.embedding_bins(found)
        if ctx.base_codes and base_is_last and self.last is not None and self.last.residual == found.config.residual:
            self.delta_bits[found.config.residual] = found.bits  # a delta on a checkpoint of its own kind
        self.last = found.config
        plan = found.plan or ctx.plan(found.config)
        return SearchResult(
            found.config,
            found.degradation,
            baseline,
            mode,
            ctx.tried,
            ctx.local,
            plan,
            ctx.sized,
            standard_error=found.standard_error,
            z=self.z,
            weight_error=found.weight_error,
            bits=found.bits,
            delta_bits=dict(self.delta_bits),
        )

    def _non_finite_baseline(
        self, baseline: float, snapshot: Mapping[str, torch.Tensor], where: str | None, lockstep: Lockstep | None
    ) -> SearchResult:
        """The result for a checkpoint whose unquantized model scores NaN or inf: stored losslessly,
        after the tensors at fault are named (in lockstep: those with NaN or inf on any rank)."""
        names = [n for n, t in snapshot.items() if t.is_floating_point()]
        flags = np.array([0.0 if all_finite(snapshot[n]) else 1.0 for n in names])
        if lockstep is not None and names:
            flags = lockstep.all_sum(flags)
        bad = [repr(n) for n, flag in zip(names, flags) if flag > 0]
        refuse_or_warn_non_finite(bad, self.config.non_finite, where)  # raises in mode "raise"
        warnings.warn(
            f"the {self.metric.name} of the unquantized model is {baseline}{f' at {where}' if where else ''}: "
            "no configuration can be judged, this checkpoint is stored losslessly",
            stacklevel=3,
        )
        return SearchResult(None, None, baseline, "non-finite", delta_bits=dict(self.delta_bits))


class _OutOfTime(Exception):
    """The search's seconds are spent (raised between rounds, caught by ConfigurationSearch.search)."""


class _Context:
    """The state of one checkpoint's search: plans, measured sizes, evaluated points and the rules
    they imply."""

    def __init__(
        self,
        owner: ConfigurationSearch,
        model: torch.nn.Module,
        snapshot: Mapping[str, torch.Tensor],
        types: Mapping[str, str] | None,
        sensitivity: Mapping[str, torch.Tensor] | None,
        baseline: Measurement,
        prune_by: Sequence[str],
        lockstep: Lockstep | None = None,
        where: str | None = None,
        references: Mapping[str, Reference] | None = None,
    ) -> None:
        self.owner, self.model, self.snapshot = owner, model, snapshot
        self.references = dict(references or {})
        self.residuals = ["none", *self.references]  # offered residual kinds (the search narrows them)
        self.base_codes: dict[str, np.ndarray] = {}  # the base entry's codes, for sizes as stored
        self.device: DeviceTensors | None = None  # where candidates are measured when the model is on an accelerator
        self.lockstep, self.where = lockstep, where
        self.rank, self.world = (0, 1) if lockstep is not None else rank_world()  # in lockstep nothing is spread
        self.types, self.sensitivity, self.baseline = types, sensitivity, baseline
        self.prune_by = list(prune_by)  # the pruning criteria available at this checkpoint
        self.tried: list[Candidate] = []
        self.local = 0
        self.sized = 0
        self.inversion = 0.0  # the most an evaluated configuration lost against one below it (see condemned)
        self.sketches: dict = {}  # per-tensor sketches, shared by every candidate of this checkpoint
        self._plans: dict[QuantConfig, QuantPlan] = {}  # made on this rank
        self._bits: dict[QuantConfig, float] = {}
        self._cache: dict[QuantConfig, Candidate] = {}
        # tensors measured once while their plan stays the same (see _measured)
        self.measured: dict[str, tuple[TensorPlan, Measured]] = {}
        self.has_embeddings = any((types or {}).get(n) == EMBEDDING for n in snapshot) or any(
            "embed" in n.lower() for n in snapshot
        )
        self.deadline: float | None = None  # time.perf_counter() past which no candidate is evaluated
        self.calibration: Calibration | None = None  # for candidates with error feedback
        self.bar: Any = tqdm(disable=True)  # the search's progress bar (ConfigurationSearch.progress)

    def out_of_time(self) -> bool:
        """Whether the search's seconds are spent, the same answer on every rank (a collective
        when several take part; with no bound, none is needed: every rank has the same settings)."""
        if self.deadline is None:
            return False
        late = np.array([float(time.perf_counter() > self.deadline)])
        if self.lockstep is not None:
            late = self.lockstep.all_sum(late)
        elif self.world > 1:
            late = all_sum(late)
        return bool(late[0] > 0)

    def _embedding_default(self) -> int:
        return self.owner.search_space.embedding_bins[-1]

    def config(
        self, point: tuple[int, int, int], prune_by: str, embedding_bins: int | None = None, residual: str = "none"
    ) -> QuantConfig:
        """The configuration at ``point``; without pruning the pruning criterion changes nothing,
        so such points all take the first criterion (one plan, one evaluation)."""
        space = self.owner.search_space
        prune_by = self.prune_by[0] if space.prune[point[1]] == 0 and self.prune_by else prune_by
        return space.config(point, prune_by, self.owner.config, embedding_bins or self._embedding_default(), residual)

    def plan(self, config: QuantConfig) -> QuantPlan:
        if config not in self._plans:
            ref = self.references.get(config.residual)
            self._plans[config] = (
                self.lockstep.plan(config)
                if self.lockstep is not None
                else plan_quantization(
                    self.device.exact if self.device is not None else self.snapshot,  # sketched where they live
                    config,
                    types=self.types,
                    sensitivity=ref.sensitivity if ref is not None and self.sensitivity else self.sensitivity,
                    sketch_cache=self.sketches,
                    where=self.where,
                    reference=ref.values if ref is not None else None,
                    calibration=self.calibration,
                )
            )
        return self._plans[config]

    def size(self, configs: Sequence[QuantConfig]) -> list[float]:
        """Measured bits per quantized value of each configuration, without evaluating the model
        (spread over the ranks like evaluations)."""
        todo = [c for c in dict.fromkeys(configs) if c not in self._bits]
        rank, world = self.rank, self.world
        totals = [_code_totals(self.snapshot, self.plan(c), self.base_codes, self.device) for c in todo[rank::world]]
        if self.lockstep is not None and totals:
            totals = list(self.lockstep.all_sum(np.stack(totals)))  # every rank sized every candidate
        mine = [(c, float(t[0] / max(t[1], 1.0))) for c, t in zip(todo[rank::world], totals)]
        self._bits.update([x for part in all_gather(mine) for x in part] if world > 1 else mine)
        self.sized += len(todo)
        return [self._bits[c] for c in configs]

    def evaluate(self, configs: Sequence[QuantConfig]) -> list[Candidate]:
        """Evaluate a round: one configuration per rank, results shared by all ranks."""
        todo = [c for c in dict.fromkeys(configs) if c not in self._cache]
        rank, world = self.rank, self.world
        for start in range(0, len(todo), world):
            if self.out_of_time():
                raise _OutOfTime
            batch = todo[start : start + world]
            mine = []
            if rank < len(batch):
                plan = self.plan(batch[rank])
                metric, rng = self.owner.metric, self.owner.owns_rng()
                value, totals = _evaluate(
                    self.model, self.snapshot, plan, metric, rng, self.base_codes, self.device, self.measured
                )
                measures = metric.compare(self.baseline, value)
                if self.lockstep is not None:
                    measures, totals = self.agreed(measures, value.value), self.lockstep.all_sum(totals)
                bits = float(totals[0] / max(totals[1], 1.0))
                cand = self.owner.judge(batch[rank], measures, bits, plan)
                cand.weight_error = float(math.sqrt(totals[2] / max(totals[3], 1e-300)))
                mine.append(cand)
                self.local += 1
            shared = [replace(c, plan=None) for c in mine]
            gathered = [x for part in all_gather(shared) for x in part] if world > 1 else mine
            for cand in gathered:
                for other in self.tried:
                    if self.below(other.config, cand.config):
                        self.inversion = max(self.inversion, cand.degradation - other.degradation)
                    elif self.below(cand.config, other.config):
                        self.inversion = max(self.inversion, other.degradation - cand.degradation)
                self._cache[cand.config] = cand
                self.tried.append(cand)
                self.bar.update()
                self.bar.set_postfix_str(
                    f"{cand.config.bins} bins, prune {cand.config.prune:g}: {cand.degradation:.4g} "
                    + ("passes" if cand.passed else "fails")
                )
        return [self._cache[c] for c in configs]

    def agreed(self, measures: dict[str, tuple[float, float]], value: float) -> dict[str, tuple[float, float]]:
        """Every rank's measures made one (lockstep, each rank on its own data shard): a single
        measure's degradation is that of the metric value averaged over the ranks against the
        averaged baseline (as one process would measure it on all the data), several measures'
        the mean of the ranks' degradations; the standard error is that of a mean of independent
        per-rank estimates."""
        assert self.lockstep is not None
        names = sorted(measures)
        local = np.array([[measures[n][0], measures[n][1] ** 2] for n in names], dtype=np.float64).ravel()
        summed = self.lockstep.all_sum(np.append(local, [value, self.baseline.value]))
        ranks = self.lockstep.ranks
        agreed_value, agreed_baseline = summed[-2:] / ranks
        pairs = summed[:-2].reshape(-1, 2)
        out = {n: (float(d / ranks), float(math.sqrt(v) / ranks)) for n, (d, v) in zip(names, pairs)}
        if len(out) == 1:
            ((name, (_, se)),) = out.items()
            out[name] = (self.owner.metric.degradation(float(agreed_baseline), float(agreed_value)), se)
        return out

    def condemned(self, config: QuantConfig) -> bool:
        """Whether a clear failure lies at or above ``config`` on every axis. Quality is not
        monotone along the axes on real models, so a failure is clear only when it exceeds the
        threshold by ``_CLEAR_FAIL`` times the larger of the threshold and the largest inversion
        seen at this checkpoint (the most a configuration has lost against one at least as
        aggressive): the rule loosens itself where the metric is noisy."""
        margin = self.margin()
        return any(c.degradation > margin and self.below(config, c.config) for c in self.tried)

    def margin(self) -> float:
        """The degradation past which a failure is clear (see :meth:`condemned`)."""
        threshold = self.owner.threshold
        return threshold + _CLEAR_FAIL * max(threshold, self.inversion)

    def below(self, a: QuantConfig, b: QuantConfig) -> bool:
        """Whether ``a`` is at least as aggressive as ``b`` on every axis (were quality monotone
        along the axes, ``a`` would be no better); without pruning the pruning criterion is moot."""
        space = self.owner.search_space
        return (
            (b.prune == 0 or a.prune_by == b.prune_by)
            and a.residual == b.residual
            and a.embedding_bins <= b.embedding_bins
            and all(x <= y for x, y in zip(space.point_of(a), space.point_of(b)))
        )

    def exhaustive(self, prune_by: Sequence[str]) -> Candidate | None:
        """The passing configuration of lowest chain cost (:meth:`ConfigurationSearch.chain_cost`,
        a rising function of the measured size within a residual kind), every (pruning, criterion,
        residual) column in one queue.

        The queue walks the cube from the most compressive corner of each column: a point leaves
        it in order of chain cost, and its successors (one more step of bins; at the fewest
        bins, one more step of protection) join, sized, as it leaves. Size rises along both, so
        every point still to come costs at least as much as the one leaving, and the first that
        passes is the answer. A point at or below a clear failure (see :meth:`condemned`) is
        skipped when its turn comes."""
        space, world = self.owner.search_space, self.world
        n_bins, n_prune, n_protect = space.shape
        columns = [(m, r) for r in self.residuals for m in prune_by]
        queue: list[tuple[float, tuple[int, int, int], int]] = []  # (chain cost, point, column index)
        seen: set[QuantConfig] = set()

        def at(point: tuple[int, int, int], column: int) -> QuantConfig:
            criterion, residual = columns[column]
            return self.config(point, criterion, residual=residual)

        def push(points: list[tuple[int, int, int]], column: int) -> None:
            fresh = []
            for point in points:
                if (config := at(point, column)) not in seen:  # without pruning, both criteria meet
                    seen.add(config)
                    fresh.append((point, config))
            for (point, config), bits in zip(fresh, self.size([c for _, c in fresh])):
                heapq.heappush(queue, (self.owner.chain_cost(config, bits), point, column))

        def successors(point: tuple[int, int, int]) -> list[tuple[int, int, int]]:
            """One more step of bins; at the fewest bins, also one more step of protection (a tree
            over each column: every point has one predecessor)."""
            b, p, r = point
            out = [(b + 1, p, r)] if b + 1 < n_bins else []
            if b == 0 and r + 1 < n_protect:
                out.append((b, p, r + 1))
            return out

        def column_top(config: QuantConfig) -> QuantConfig:
            point = (n_bins - 1, space.prune.index(config.prune), n_protect - 1)
            return self.config(point, config.prune_by, residual=config.residual)

        # the highest-quality configurations first, a round at a time until one is not a clear
        # failure: when they all fail clearly, nothing is left to try
        tops = [at((n_bins - 1, n_prune - 1, n_protect - 1), c) for c in range(len(columns))]
        for start in range(0, len(tops), world):
            self.evaluate(tops[start : start + world])
            if not all(self.condemned(c) for c in tops[: start + world]):
                break
        else:
            return None
        for column in range(len(columns)):
            push([(0, p, 0) for p in range(n_prune)], column)
        while queue:
            batch: list[QuantConfig] = []
            while queue and len(batch) < world:
                _, point, column = heapq.heappop(queue)
                push(successors(point), column)
                if not self.condemned(config := at(point, column)):
                    batch.append(config)
            cands = self.evaluate(batch)
            if passed := next((c for c in cands if c.passed), None):
                return passed
            # a failure far past the margin hints that its whole column (pruning level, criterion and
            # residual) fails: the column's top decides in one evaluation, and condemns the column
            # if it fails clearly
            self.evaluate([column_top(c.config) for c in cands if c.degradation > _FAR * self.margin()])
        return None

    def neighbourhood(self, last: QuantConfig, prune_by: Sequence[str]) -> Candidate | None:
        """Round 1: the last point under its pruning criterion and residual, under the other
        criteria, and under the other available residuals. Then the points around it, sized first
        and evaluated in order of chain cost (:meth:`ConfigurationSearch.chain_cost`), only where
        that is lower than the best passing candidate's so far; the first that passes is the
        answer, else round 1's cheapest passing:

        * under the last residual kind, when its centre fails: the points at most ``epsilon``
          steps less aggressive (never bolder: the model grows denser as training goes on); they
          use the other criterion when it passed clearly better at the centre. A residual on the
          previous checkpoint is the exception: it is the update made since, which shrinks as the
          learning rate decays, so when its centre passes its points around it, bolder too, are
          judged as another kind's are;
        * under each other residual kind, when round 1 found a passing candidate: every point at
          most ``epsilon`` steps away, bolder too. The centre is not that kind's own point, so
          judging the kind there alone would keep a run on a kind that happened to win once (a
          fine-tune that moved to residuals on the previous checkpoint at twice the size of those
          on its pre-trained weights one step less aggressive, benchmarks/RESULTS.md, issue 15)
          or on a kind's pruning level taken over from another kind. Without a passing candidate
          they are left to the fallback, whose walk orders every kind's cube by chain cost."""
        space, eps = self.owner.search_space, self.owner.epsilon
        try:
            centre = space.point_of(last)
        except ValueError:
            return None
        emb, residual = last.embedding_bins, last.residual
        others = [m for m in prune_by if m != last.prune_by]
        alternatives = [r for r in self.residuals if r != residual]
        same = self.config(centre, last.prune_by, emb, residual)
        first = self.evaluate(
            [same]
            + [self.config(centre, m, emb, residual) for m in others]
            + [self.config(centre, last.prune_by, emb, r) for r in alternatives]
        )
        criterion = last.prune_by
        if others and first[1].passed and first[1].degradation < 0.9 * first[0].degradation:
            criterion = others[0]
        chosen = self._cache[self.config(centre, criterion, emb, residual)]
        cost = self.owner.candidate_cost
        best = min((c for c in first if c.passed), key=cost, default=None)

        def around(bolder: bool) -> list[tuple[int, int, int]]:
            ranges = [range(max(0, c - eps) if bolder else c, min(n, c + eps + 1)) for c, n in zip(centre, space.shape)]
            return [p for p in itertools.product(*ranges) if p != centre]

        shrinking = chosen.passed and residual == "previous"  # (see the docstring)
        own = around(bolder=shrinking) if shrinking or not chosen.passed else []
        near = [self.config(p, criterion, emb, residual) for p in own]
        if best is not None:  # else the fallback's exhaustive walk orders every kind's cube by chain cost anyway
            near += [self.config(p, criterion, emb, r) for r in alternatives for p in around(bolder=True)]
        near = [c for c in dict.fromkeys(near) if c not in self._cache]  # round 1 judged the centres
        chain_cost = self.owner.chain_cost
        by_cost = sorted(((chain_cost(c, bits), c) for c, bits in zip(near, self.size(near))), key=lambda x: x[0])
        near = [c for key, c in by_cost if best is None or key < cost(best)]
        world = self.world
        for start in range(0, len(near), world):
            for cand in self.evaluate(near[start : start + world]):
                if cand.passed:
                    return cand
        return best

    def embedding_bins(self, found: Candidate) -> Candidate:
        """Embeddings are searched apart: the fewest embedding bins that still pass."""
        if not self.has_embeddings:
            return found
        for bins in self.owner.search_space.embedding_bins:
            if bins >= found.config.embedding_bins:
                break
            try:
                cand = self.evaluate([replace(found.config, embedding_bins=bins)])[0]
            except _OutOfTime:
                return found  # it passed with more embedding bins
            if cand.passed:
                return cand
        return found
