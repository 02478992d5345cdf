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
  pruning metrics share one queue ordered by measured size, so the first candidate that passes
  is the most compressive one and ends the search. Size rises with bins and with protection (in
  every cube we measured), so the queue walks out from the most compressive corner and sizes a
  point only when the point before it leaves: no plan of the whole cube up front. Quality is
  *not* monotone along the axes on real models (pruning can lower the loss; near the threshold
  more bins can cost quality), so a failure condemns the points below it only when it is clear:
  past the threshold by twice the larger of the threshold and the largest inversion seen so far
  at this checkpoint (a configuration losing against one below it). The rule loosens itself
  where the metric is noisy. A failure far past that margin has the search try the top of its
  column (same pruning level and metric), which condemns the column in one evaluation when it
  fails clearly too. Without pruning the pruning metric changes nothing: such configurations
  are planned and evaluated once.
* **Residual coding** (``QuantConfig.residual``) is one more axis: a candidate codes the weights
  themselves (``"none"``) or their residual against a reference the decoder has (``"previous"``:
  the last checkpoint's decoded weights; ``"pretrained"``: the weights a fine-tune started from),
  each offered where the caller hands :meth:`ConfigurationSearch.search` its :class:`Reference`.
  Every residual kind's columns share the one size-ordered queue, so the choice is by measured size
  at passing quality.
* **Later checkpoints: epsilon-neighbourhood.** Candidates are the last choice (under both
  metrics) and the configurations at most ``epsilon`` steps away that are *not more aggressive*,
  smallest measured size first; the first that passes ends the round. Round 1 also tries the
  last point under the other available residual kinds, and takes one that passes with fewer
  measured bits (or passes where the last residual fails). If none passes, the exhaustive search
  runs again (counted as a fallback); so does it when the last residual is not available (a
  keyframe has no previous checkpoint to code against).
* **Data-parallel.** With ``torch.distributed`` initialised, each round hands one candidate to
  each rank (and sizes are measured the same way); results are all-gathered, so every rank picks
  the same configuration.
* **Sharded models (lockstep).** Under FSDP every forward needs every rank, so candidates cannot
  be spread: with a :class:`Lockstep` all ranks plan (from sketches merged over the ranks),
  size and evaluate the same candidate together, sizes are summed over the ranks and metric
  values averaged, so every rank takes the same decisions (see :mod:`hf_dynaquant.sharded`).
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
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from .core.entropy import order0_bits
from .core.quantizer import (
    EMBEDDING,
    QuantConfig,
    RESIDUALS,
    QuantPlan,
    decoded_values,
    plan_quantization,
    quantize,
    refuse_or_warn_non_finite,
)
from .core.rng import preserved_rng
from .errors import InvalidSettingError

__all__ = [
    "held_out",
    "QualityMetric",
    "Measurement",
    "paired_standard_error",
    "SearchSpace",
    "SearchResult",
    "Reference",
    "ConfigurationSearch",
    "evaluate_plan",
    "measured_bits",
    "Lockstep",
    "mean_loss",
    "accuracy",
    "perplexity",
    "output_distortion",
]


# ---------------------------------------------------------------------------------------------
# quality metrics


@dataclass
class Measurement:
    """One evaluation of a model by a :class:`QualityMetric`: its value and, for a metric that can
    say how precise it is, the per-example evidence that two evaluations on the same examples are
    compared by (per-batch losses, cached predictions)."""

    value: float
    evidence: Any = field(default=None, repr=False)


@dataclass
class QualityMetric:
    """A model-quality measure and its direction; :meth:`degradation` is relative (0.01 = 1%).

    A metric made with ``measure`` (``model -> Measurement``) and ``paired_error`` (``(baseline,
    candidate) -> standard error of the degradation``) tells the search how precisely a
    degradation is known: the baseline and a candidate are evaluated on the same examples, so
    the degradation is a paired difference whose standard error the evidence gives (see
    :func:`mean_loss` and :func:`hf_dynaquant.integrations.trainer.trainer_metric`)."""

    fn: Callable[[torch.nn.Module], float]
    higher_is_better: bool = False
    name: str = "metric"
    relative: bool = True  # False for a metric that is itself a distortion (0 = perfect)
    measure_fn: Callable[[torch.nn.Module], Measurement] | None = field(default=None, repr=False)
    paired_error: Callable[[Measurement, Measurement], float] | None = field(default=None, repr=False)

    def __call__(self, model: torch.nn.Module) -> float:
        return float(self.fn(model))

    def measure(self, model: torch.nn.Module) -> Measurement:
        """The value on ``model`` with the evidence :meth:`compare` needs."""
        return self.measure_fn(model) if self.measure_fn is not None else Measurement(self(model))

    def degradation(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline``, relative to it (negative: better)."""
        worse = baseline - value if self.higher_is_better else value - baseline
        return worse / max(abs(baseline), 1e-12) if self.relative else worse

    def compare(self, baseline: Measurement, value: Measurement) -> dict[str, tuple[float, float]]:
        """``{measure name: (degradation, standard error)}`` of a candidate against the baseline;
        a candidate passes only if every measure does. The standard error is 0 for a metric
        without ``paired_error`` (nothing is known about its precision)."""
        deg = self.degradation(baseline.value, value.value)
        se = self.paired_error(baseline, value) if self.paired_error is not None and math.isfinite(deg) else 0.0
        return {self.name: (deg, float(se))}


def paired_standard_error(baseline: np.ndarray, value: np.ndarray, scale: float) -> float:
    """Standard error of ``mean(value - baseline) / scale`` over paired units (examples or
    batches of the same examples); 0 with fewer than 2 units (nothing to estimate it from)."""
    diff = np.asarray(value, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if diff.size < 2:
        return 0.0
    return float(diff.std(ddof=1) / math.sqrt(diff.size) / max(abs(scale), 1e-12))


def _batches(data: Iterable[Any]) -> list[Any]:
    return list(data)


def held_out(data: Iterable[Any], n: int) -> list[Any]:
    """The first ``n`` batches of ``data`` (a DataLoader, a list, any iterable), materialised,
    to evaluate candidates on; keep them out of training."""
    return list(itertools.islice(iter(data), n))


def _loss_of(model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    if isinstance(batch, Mapping):
        out = model(**batch)
        return model_output_loss(out) if loss_fn is None else loss_fn(out, batch)
    inputs, target = batch
    out = model(inputs)
    logits = getattr(out, "logits", out)
    return (loss_fn or torch.nn.functional.cross_entropy)(logits, target)


def model_output_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output, read as ``transformers.Trainer.compute_loss`` reads it: a
    ``ModelOutput`` or a dict holds it under ``"loss"``, a tuple or list first."""
    if isinstance(out, Mapping):  # ModelOutput is an OrderedDict
        loss = out.get("loss")
    elif isinstance(out, (tuple, list)):
        loss = out[0] if out else None
    else:
        loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        keys = f" (keys: {', '.join(map(str, out.keys()))})" if isinstance(out, Mapping) else ""
        raise InvalidSettingError(
            f"the model returned no loss for an evaluation batch: got {type(out).__name__}{keys}; give the batches "
            "their labels, or pass metric= (a callable model -> float) for the configuration search"
        )
    return loss


def mean_loss(
    data: Iterable[Any],
    loss_fn: Callable | None = None,
    *,
    compute_loss: Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor] | None = None,
) -> QualityMetric:
    """Mean loss over evaluation batches (lower is better). A batch is a dict for a Hugging Face
    model (the loss of ``model(**batch)``: a ``ModelOutput``'s or dict's ``"loss"``, a tuple's
    first element) or an ``(inputs, target)`` pair (cross-entropy by default). ``compute_loss``
    (``(model, batch) -> loss``, e.g. a ``Trainer``'s own ``compute_loss``) replaces the default for
    dict batches; it gets a shallow copy of each batch, so it may pop keys.

    The batches are the paired units of the standard error (a loss function returns one mean
    per batch): the degradation's standard error is that of the mean of per-batch differences,
    so it needs at least 2 batches (with 1 it is reported as 0)."""
    batches = _batches(data)

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if compute_loss is not None and isinstance(batch, Mapping):
            return compute_loss(model, dict(batch))
        return _loss_of(model, batch, loss_fn)

    def measure(model: torch.nn.Module) -> Measurement:
        dev = _device_of(model)
        losses = np.array([loss(model, _to(b, dev)).item() for b in batches], dtype=np.float64)
        return Measurement(float(losses.mean()), losses)

    return QualityMetric(
        lambda model: measure(model).value,
        higher_is_better=False,
        name="loss",
        measure_fn=measure,
        paired_error=lambda base, cand: paired_standard_error(base.evidence, cand.evidence, base.value),
    )


def perplexity(data: Iterable[Any]) -> QualityMetric:
    """``exp`` of the mean loss (lower is better)."""
    loss = mean_loss(data)
    return QualityMetric(lambda m: math.exp(loss(m)), higher_is_better=False, name="perplexity")


def accuracy(data: Iterable[Any]) -> QualityMetric:
    """Top-1 accuracy over ``(inputs, labels)`` batches (higher is better); the standard error
    of a degradation from the per-example differences in correctness."""
    batches = _batches(data)

    def measure(model: torch.nn.Module) -> Measurement:
        dev = _device_of(model)
        right = [
            (getattr(out, "logits", out).argmax(-1).cpu() == labels).reshape(-1)
            for out, labels in ((model(_to(inputs, dev)), labels) for inputs, labels in batches)
        ]
        correct = torch.cat(right).numpy().astype(np.float64) if right else np.zeros(0)
        return Measurement(float(correct.mean()) if correct.size else 0.0, correct)

    return QualityMetric(
        lambda model: measure(model).value,
        higher_is_better=True,
        name="accuracy",
        measure_fn=measure,
        paired_error=lambda base, cand: paired_standard_error(base.evidence, cand.evidence, base.value),
    )


def output_distortion(model: torch.nn.Module, data: Iterable[Any]) -> QualityMetric:
    """Default calibration metric without labels: relative squared error of the model's outputs
    against the original model's outputs on the same inputs (0 for the original)."""
    batches = _batches(data)
    with torch.no_grad():
        reference = [_output(model, b) for b in batches]

    def fn(m: torch.nn.Module) -> float:
        num = den = 0.0
        for b, ref in zip(batches, reference):
            out = _output(m, b)
            num += float((out - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
        return num / max(den, 1e-30)

    return QualityMetric(fn, higher_is_better=False, name="output_distortion", relative=False)


def _output(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    dev = _device_of(model)
    out = model(**_to(batch, dev)) if isinstance(batch, Mapping) else model(_to(batch, dev))
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr).float().cpu()
    return (out[0] if isinstance(out, (tuple, list)) else out).float().cpu()


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


# ---------------------------------------------------------------------------------------------
# the configuration cube


@dataclass(frozen=True)
class SearchSpace:
    """The configuration cube (the paper's Table 7, plus 3 bins). Each axis is listed from the
    most compressive to the highest-quality value.

    3 bins is our addition: on the Trainer benchmark (benchmarks/RESULTS.md, "Trainer
    integration") the search takes it at the 1% threshold and the run ends as close to the
    uncompressed one as with 4 bins (+0.3%) at 1.2x the weights ratio. 2 bins also passes the
    per-checkpoint test there but ends +2% after 10 restores, so it is not offered by default.
    """

    bins: tuple[int, ...] = (3, 4, 6, 8, 12, 16, 32)
    prune: tuple[float, ...] = (0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
    protect: tuple[float, ...] = (0.0005, 0.005, 0.01)
    metrics: tuple[str, ...] = ("magnitude", "sensitivity")
    embedding_bins: tuple[int, ...] = (16, 32)
    residuals: tuple[str, ...] = ("pretrained", "previous", "none")  # each offered where available

    def __post_init__(self) -> None:
        if bad := [r for r in self.residuals if r not in RESIDUALS]:
            raise InvalidSettingError(f"SearchSpace.residuals: unknown {bad}; choose from {RESIDUALS}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.bins), len(self.prune), len(self.protect)

    def config(
        self, point: tuple[int, int, int], metric: str, base: QuantConfig, embedding_bins: int, residual: str = "none"
    ) -> QuantConfig:
        return replace(
            base,
            bins=self.bins[point[0]],
            prune=self.prune[point[1]],
            protect=self.protect[point[2]],
            metric=metric,
            embedding_bins=embedding_bins,
            residual=residual,
        )

    def point_of(self, config: QuantConfig) -> tuple[int, int, int]:
        return self.bins.index(config.bins), self.prune.index(config.prune), self.protect.index(config.protect)

    def holds(self, config: QuantConfig) -> bool:
        """Whether ``config`` is one of this cube's configurations (every searched knob on an axis)."""
        on_axes = (
            config.bins in self.bins
            and config.prune in self.prune
            and config.protect in self.protect
            and config.embedding_bins in self.embedding_bins
        )
        return on_axes and config.metric in self.metrics and config.residual in self.residuals


@dataclass(frozen=True)
class Reference:
    """What residual candidates of one kind (``"previous"`` or ``"pretrained"``) code against:
    reference values by tensor name (a tensor without one is coded directly), and the
    sensitivity of the residual, ``|EMA(g) * (w - ref)|`` (``None`` without gradients)."""

    values: Mapping[str, torch.Tensor]
    sensitivity: Mapping[str, torch.Tensor] | None = None


@dataclass
class Candidate:
    """One evaluated configuration."""

    config: QuantConfig
    degradation: float  # of the binding measure: the one with the largest degradation + z * standard error
    bits: float  # measured: entropy of the codes + 16 per protected value, per quantized value
    passed: bool
    plan: QuantPlan | None = field(default=None, repr=False, compare=False)  # kept on the rank that made it
    standard_error: float = 0.0  # of ``degradation`` (paired: baseline and candidate on the same examples)
    measures: dict[str, tuple[float, float]] = field(default_factory=dict)  # every measure: (degradation, s.e.)
    weight_error: float | None = None  # relative L2 error of the decoded quantized weights (what a resume loads)

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "bins": c.bins,
            "prune": c.prune,
            "protect": c.protect,
            "metric": c.metric,
            "embedding_bins": c.embedding_bins,
            "residual": c.residual,
            "degradation": self.degradation,
            "standard_error": self.standard_error,
            "measures": {k: list(v) for k, v in self.measures.items()},
            "weight_error": self.weight_error,
            "bits": self.bits,
            "passed": self.passed,
        }


@dataclass
class SearchResult:
    """What the manager chose for one checkpoint and how."""

    config: QuantConfig | None  # None: nothing passed; store this checkpoint losslessly
    degradation: float | None
    baseline: float
    mode: str  # "exhaustive" | "neighbourhood" | "fallback" | "non-finite" (the metric was NaN or inf)
    candidates: list[Candidate] = field(default_factory=list)
    local_evaluations: int = 0  # candidates this process evaluated itself (the rest came from other ranks)
    plan: QuantPlan | None = field(default=None, repr=False)
    sized: int = 0  # configurations planned and measured without evaluating the model, to order the candidates
    standard_error: float | None = None  # of the chosen candidate's degradation: what the test could resolve
    z: float = 0.0  # the pass rule: degradation + z * standard_error <= threshold
    weight_error: float | None = None  # of the chosen candidate: relative L2 error of the weights a resume loads

    @property
    def evaluations(self) -> int:
        return len(self.candidates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict() if self.config else None,
            "residual": self.config.residual if self.config else None,
            "degradation": self.degradation,
            "standard_error": self.standard_error,
            "z": self.z,
            "weight_error": self.weight_error,
            "baseline": self.baseline if math.isfinite(self.baseline) else str(self.baseline),  # JSON has no NaN
            "mode": self.mode,
            "evaluations": self.evaluations,
            "sized": self.sized,
            "candidates": [c.to_dict() for c in self.candidates],
        }


# ---------------------------------------------------------------------------------------------
# evaluation


@contextmanager
def _preserved_state(model: torch.nn.Module, rng: bool):
    """Eval mode and no gradients; the train/eval mode restored afterwards, and with ``rng`` (the
    caller's thread owns the process-wide generators) every RNG state too."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), preserved_rng() if rng else nullcontext():
            yield
    finally:
        model.train(was_training)


def _live_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The live tensor ``name`` of ``model``; for a sharded (DTensor) parameter its local shard,
    which is what a sharded snapshot holds."""
    try:
        live = model.get_parameter(name)
    except AttributeError:
        live = model.get_buffer(name)
    to_local = getattr(live, "to_local", None)  # torch.distributed.tensor.DTensor
    return to_local() if to_local is not None else live


def _code_bits(codes: np.ndarray, protected: np.ndarray, base: np.ndarray | None = None) -> float:
    """Bits of one tensor's codes at their order-0 entropy, plus 16 per protected (bf16) value.
    With the base entry's codes of the tensor (``base``), the smaller of that and the entropy of
    the codes given the base codes: what the code delta (the regrouped cyclic delta, one model
    per base code) stores when it pays, as the codec chooses."""
    bits = order0_bits(codes)
    if base is not None and base.size == codes.size:
        joint = np.bincount(base.astype(np.int64) * 256 + codes, minlength=1)
        given = np.bincount(base, minlength=1)
        pairs = np.nonzero(joint)[0]
        count = joint[pairs]
        bits = min(bits, float(-(count * np.log2(count / given[pairs // 256])).sum()))
    return bits + 16 * protected.size


def _code_totals(
    snapshot: Mapping[str, torch.Tensor], plan: QuantPlan, base_codes: Mapping[str, np.ndarray] | None = None
) -> np.ndarray:
    """``[bits, quantized values]`` of ``plan`` on ``snapshot`` (summable over shards)."""
    totals = np.zeros(2)
    for name, tp in plan.tensors.items():
        codes, protected = quantize(snapshot[name], tp)
        totals += (_code_bits(codes, protected, (base_codes or {}).get(name)), codes.size)
    return totals


def measured_bits(
    snapshot: Mapping[str, torch.Tensor], plan: QuantPlan, *, base_codes: Mapping[str, np.ndarray] | None = None
) -> float:
    """Bits per quantized value of ``plan`` on ``snapshot`` (the ``bits`` of :func:`evaluate_plan`),
    without touching the model: what the search orders its candidates by. ``base_codes`` (the
    base entry's codes by tensor name, when the checkpoint will be a delta on it) counts a
    tensor's code delta where that is smaller."""
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
) -> tuple[Measurement, np.ndarray]:
    """:func:`evaluate_plan` with the metric's :class:`Measurement` and ``[bits, quantized values,
    squared error, squared norm]`` of the quantized tensors (the sizes as :func:`_code_totals`;
    the error of the decoded values against the exact ones), which sum over the shards of a
    sharded model."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    totals = np.zeros(4)
    with _preserved_state(model, preserve_rng):
        try:
            for name, tp in plan.tensors.items():
                codes, protected = quantize(snapshot[name], tp)
                live = _live_tensor(model, name)
                values = torch.from_numpy(decoded_values(codes, tp.centres, protected, tp.reference)).view(live.shape)
                exact = snapshot[name].double()
                error = float((values.to(live.dtype).double() - exact).pow(2).sum())
                bits = _code_bits(codes, protected, (base_codes or {}).get(name))
                totals += (bits, codes.size, error, float(exact.pow(2).sum()))
                swapped.append((live, snapshot[name]))
                live.copy_(values.to(live.dtype))
            value = metric.measure(model)
        finally:
            for live, original in swapped:
                live.copy_(original)
    return value, totals


def _gather(local: list[Any]) -> list[Any]:
    """All ranks' lists concatenated in rank order (or the local list without distribution)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, local)
    return [x for part in out for x in part]


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class Lockstep:
    """How a search runs when every evaluation needs every rank (a sharded model: under FSDP a
    forward pass is collective). All ranks plan, size and evaluate the same candidates, in the
    same order; nothing is spread over the ranks.

    Args:
        plan: the plan of a configuration, identical on every rank for the tensors it covers
            (:func:`hf_dynaquant.sharded.plan_sharded`: from sketches merged over the ranks).
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
        space: the configuration cube.
        epsilon: neighbourhood radius, in cube steps, at later checkpoints.
        base: the fixed knobs (sigma, alpha, min_numel, seed) of every candidate.
        z: standard errors added to a degradation before it is compared with the threshold
            (1.645: one-sided 95%; 0: the degradation alone, as before the standard error).
    """

    def __init__(
        self,
        metric: QualityMetric,
        threshold: float = 0.01,
        *,
        space: SearchSpace | None = None,
        epsilon: int = 1,
        base: QuantConfig | None = None,
        z: float = DEFAULT_Z,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if not z >= 0:
            raise ValueError(f"z must be >= 0, got {z}")
        self.metric, self.threshold, self.z = metric, threshold, z
        self.space, self.epsilon, self.base = space or SearchSpace(), epsilon, base or QuantConfig()
        self.last: QuantConfig | None = None
        self.fallbacks = 0
        self._rng_thread = threading.get_ident()  # the thread that made the search: the training thread

    def continue_from(self, config: Mapping[str, Any] | None) -> None:
        """Go on from the configuration a stored checkpoint records (its ``quant_config``
        metadata), as if this search had chosen it: a run resumed in a new process searches the
        neighbourhood of where it stopped instead of the whole cube. Nothing (a lossless or
        fixed-configuration checkpoint, or a configuration off this search's cube) leaves the next
        search exhaustive."""
        self.last = None
        if not config:
            return
        fields = ("bins", "prune", "protect", "metric", "embedding_bins", "residual")
        chosen = {k: config[k] for k in fields if k in config}
        try:
            last = replace(self.base, **chosen)
        except (TypeError, ValueError):  # a value QuantConfig refuses
            return
        if self.space.holds(last):
            self.last = last

    def agree(self) -> None:
        """With several processes, every rank takes rank 0's position (collective: every rank
        calls it). After a resume only the writing rank reads the stored configuration
        (:meth:`continue_from`), while the next search is spread over all ranks, which must
        search alike."""
        if _world()[1] > 1:
            box = [self.last]
            torch.distributed.broadcast_object_list(box, src=0)
            self.last = box[0]

    def judge(
        self, config: QuantConfig, measures: Mapping[str, tuple[float, float]], bits: float, plan: QuantPlan | None
    ) -> Candidate:
        """The candidate ``config`` with its measures (name -> (degradation, standard error)). It
        passes when every measure's degradation plus ``z`` standard errors is within the
        threshold: with ``z`` = 1.645, a candidate whose true degradation exceeds the threshold
        passes at most 5% of the time (one-sided), whatever the sampling error of the evaluation
        data. The candidate's degradation is that of the binding measure (the largest bound)."""

        def bound(item: tuple[str, tuple[float, float]]) -> float:
            deg, se = item[1]
            value = deg + self.z * se
            return value if math.isfinite(value) else math.inf

        _, (deg, se) = max(measures.items(), key=bound)
        passed = all(bound(item) <= self.threshold for item in measures.items())
        return Candidate(config, deg, bits, passed, plan, standard_error=se, measures=dict(measures))

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
    ) -> SearchResult:
        """Choose the configuration for the checkpoint whose exact weights are ``snapshot``
        (names as in ``model.state_dict()``; only the tensors to quantize are needed). With
        ``lockstep`` (a sharded model) ``snapshot`` and ``sensitivity`` hold this rank's shards
        and every rank evaluates every candidate together (see :class:`Lockstep`). ``where``
        (e.g. ``"step 40"``) names the checkpoint in warnings and errors. ``references`` offers
        residual coding: ``{kind: Reference}`` for the kinds available at this checkpoint (those
        of ``space.residuals``; ``"none"`` needs none). Not in lockstep (sharded models code directly).
        ``base_codes``: the codes of the entry this checkpoint will be a delta on, by tensor name;
        sizes then count each tensor's code delta where it is smaller (see :func:`measured_bits`),
        so that direct coding, whose codes change little between checkpoints, is sized as stored.

        A metric that is NaN or infinite on the unquantized model (weights holding NaN after a
        divergence) leaves nothing to compare candidates with: the checkpoint is stored
        losslessly, after the tensors at fault are named (or refused, see ``QuantConfig.non_finite``)."""
        with _preserved_state(model, self.owns_rng()):
            measured = self.metric.measure(model)
        baseline = lockstep.agree(measured.value) if lockstep is not None else measured.value
        if not math.isfinite(baseline):
            return self._non_finite_baseline(baseline, snapshot, where, lockstep)
        metrics = [m for m in self.space.metrics if m == "magnitude" or sensitivity]
        references = dict(references or {})
        if lockstep is not None and references:
            raise InvalidSettingError("residual coding is not available for sharded models (lockstep): direct only")
        residuals = [r for r in self.space.residuals if r == "none" or r in references] or ["none"]
        ctx = _Context(self, model, snapshot, types, sensitivity, measured, metrics, lockstep, where, references)
        ctx.residuals = residuals
        ctx.base_codes = dict(base_codes or {})
        if self.last is not None and self.last.metric in metrics and self.last.residual in residuals:
            found = ctx.neighbourhood(self.last, metrics)
            mode = "neighbourhood"
            if found is None:
                self.fallbacks += 1
                mode = "fallback"
                found = ctx.exhaustive(metrics)
        else:
            mode = "exhaustive"
            found = ctx.exhaustive(metrics)
        if found is None:
            warnings.warn(
                f"no configuration keeps the {self.metric.name} degradation within {self.threshold:.2%}: "
                "this checkpoint is stored losslessly",
                stacklevel=2,
            )
            return SearchResult(
                None, None, baseline, mode, ctx.tried, local_evaluations=ctx.local, sized=ctx.sized, z=self.z
            )
        found = ctx.embedding_bins(found)
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
        )

    def _non_finite_baseline(
        self, baseline: float, snapshot: Mapping[str, torch.Tensor], where: str | None, lockstep: Lockstep | None
    ) -> SearchResult:
        """The result for a checkpoint whose unquantized model scores NaN or inf: stored losslessly,
        after the tensors at fault are named (in lockstep: those with NaN or inf on any rank)."""
        names = [n for n, t in snapshot.items() if t.is_floating_point()]
        flags = np.array([0.0 if bool(torch.isfinite(snapshot[n]).all()) else 1.0 for n in names])
        if lockstep is not None and names:
            flags = lockstep.all_sum(flags)
        bad = [repr(n) for n, flag in zip(names, flags) if flag > 0]
        refuse_or_warn_non_finite(bad, self.base.non_finite, where)  # raises in mode "raise"
        warnings.warn(
            f"the {self.metric.name} of the unquantized model is {baseline}{f' at {where}' if where else ''}: "
            "no configuration can be judged, this checkpoint is stored losslessly",
            stacklevel=3,
        )
        return SearchResult(None, None, baseline, "non-finite")


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
        metrics: Sequence[str],
        lockstep: Lockstep | None = None,
        where: str | None = None,
        references: Mapping[str, Reference] | None = None,
    ) -> None:
        self.owner, self.model, self.snapshot = owner, model, snapshot
        self.references = dict(references or {})
        self.residuals = ["none", *self.references]  # offered residual kinds (the search narrows them)
        self.base_codes: dict[str, np.ndarray] = {}  # the base entry's codes, for sizes as stored
        self.lockstep, self.where = lockstep, where
        self.rank, self.world = (0, 1) if lockstep is not None else _world()  # in lockstep nothing is spread
        self.types, self.sensitivity, self.baseline = types, sensitivity, baseline
        self.metrics = list(metrics)
        self.tried: list[Candidate] = []
        self.local = 0
        self.sized = 0
        self.inversion = 0.0  # the most an evaluated configuration lost against one below it (see condemned)
        self.sketches: dict = {}  # per-tensor sketches, shared by every candidate of this checkpoint
        self._plans: dict[QuantConfig, QuantPlan] = {}  # made on this rank
        self._bits: dict[QuantConfig, float] = {}
        self._cache: dict[QuantConfig, Candidate] = {}
        self.has_embeddings = any((types or {}).get(n) == EMBEDDING for n in snapshot) or any(
            "embed" in n.lower() for n in snapshot
        )

    def _embedding_default(self) -> int:
        return self.owner.space.embedding_bins[-1]

    def config(
        self, point: tuple[int, int, int], metric: str, embedding_bins: int | None = None, residual: str = "none"
    ) -> QuantConfig:
        """The configuration at ``point``; without pruning the pruning metric changes nothing, so
        such points all take the first metric (one plan, one evaluation)."""
        space = self.owner.space
        metric = self.metrics[0] if space.prune[point[1]] == 0 and self.metrics else metric
        return space.config(point, metric, self.owner.base, embedding_bins or self._embedding_default(), residual)

    def plan(self, config: QuantConfig) -> QuantPlan:
        if config not in self._plans:
            ref = self.references.get(config.residual)
            self._plans[config] = (
                self.lockstep.plan(config)
                if self.lockstep is not None
                else plan_quantization(
                    self.snapshot,
                    config,
                    types=self.types,
                    sensitivity=ref.sensitivity if ref is not None and self.sensitivity else self.sensitivity,
                    sketch_cache=self.sketches,
                    where=self.where,
                    reference=ref.values if ref is not None else None,
                )
            )
        return self._plans[config]

    def size(self, configs: Sequence[QuantConfig]) -> list[float]:
        """Measured bits per quantized value of each configuration, without evaluating the model
        (spread over the ranks like evaluations)."""
        todo = [c for c in dict.fromkeys(configs) if c not in self._bits]
        rank, world = self.rank, self.world
        totals = [_code_totals(self.snapshot, self.plan(c), self.base_codes) for c in todo[rank::world]]
        if self.lockstep is not None and totals:
            totals = list(self.lockstep.all_sum(np.stack(totals)))  # every rank sized every candidate
        mine = [(c, float(t[0] / max(t[1], 1.0))) for c, t in zip(todo[rank::world], totals)]
        self._bits.update(_gather(mine) if world > 1 else mine)
        self.sized += len(todo)
        return [self._bits[c] for c in configs]

    def evaluate(self, configs: Sequence[QuantConfig]) -> list[Candidate]:
        """Evaluate a round: one configuration per rank, results shared by all ranks."""
        todo = [c for c in dict.fromkeys(configs) if c not in self._cache]
        rank, world = self.rank, self.world
        for start in range(0, len(todo), world):
            batch = todo[start : start + world]
            mine = []
            if rank < len(batch):
                plan = self.plan(batch[rank])
                metric, rng = self.owner.metric, self.owner.owns_rng()
                value, totals = _evaluate(self.model, self.snapshot, plan, metric, rng, self.base_codes)
                measures = metric.compare(self.baseline, value)
                if self.lockstep is not None:
                    measures, totals = self.agreed(measures, value.value), self.lockstep.all_sum(totals)
                bits = float(totals[0] / max(totals[1], 1.0))
                cand = self.owner.judge(batch[rank], measures, bits, plan)
                cand.weight_error = float(math.sqrt(totals[2] / max(totals[3], 1e-300)))
                mine.append(cand)
                self.local += 1
            gathered = _gather([replace(c, plan=None) for c in mine]) if world > 1 else mine
            for cand in gathered:
                for other in self.tried:
                    if self.below(other.config, cand.config):
                        self.inversion = max(self.inversion, cand.degradation - other.degradation)
                    elif self.below(cand.config, other.config):
                        self.inversion = max(self.inversion, other.degradation - cand.degradation)
                self._cache[cand.config] = cand
                self.tried.append(cand)
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
        along the axes, ``a`` would be no better); without pruning the pruning metric is moot."""
        space = self.owner.space
        return (
            (b.prune == 0 or a.metric == b.metric)
            and a.residual == b.residual
            and a.embedding_bins <= b.embedding_bins
            and all(x <= y for x, y in zip(space.point_of(a), space.point_of(b)))
        )

    def exhaustive(self, metrics: Sequence[str]) -> Candidate | None:
        """The passing configuration of fewest measured bits, every (pruning, metric, residual)
        column in one queue.

        The queue walks the cube from the most compressive corner of each column: a point leaves
        it in order of measured size, and its successors (one more step of bins; at the fewest
        bins, one more step of protection) join, sized, as it leaves. Size rises along both, so
        every point still to come is at least as large as the one leaving, and the first that
        passes is the answer. A point at or below a clear failure (see :meth:`condemned`) is
        skipped when its turn comes."""
        space, world = self.owner.space, self.world
        n_bins, n_prune, n_protect = space.shape
        columns = [(m, r) for r in self.residuals for m in metrics]
        queue: list[tuple[float, tuple[int, int, int], int]] = []  # (bits, point, column index)
        seen: set[QuantConfig] = set()

        def at(point: tuple[int, int, int], column: int) -> QuantConfig:
            metric, residual = columns[column]
            return self.config(point, metric, residual=residual)

        def push(points: list[tuple[int, int, int]], column: int) -> None:
            fresh = []
            for point in points:
                if (config := at(point, column)) not in seen:  # without pruning, both metrics meet
                    seen.add(config)
                    fresh.append((point, config))
            for (point, _), bits in zip(fresh, self.size([c for _, c in fresh])):
                heapq.heappush(queue, (bits, point, column))

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
            return self.config(point, config.metric, residual=config.residual)

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
            # a failure far past the margin hints that its whole column (pruning level, metric and
            # residual) fails: the column's top decides in one evaluation, and condemns the column
            # if it fails clearly
            self.evaluate([column_top(c.config) for c in cands if c.degradation > _FAR * self.margin()])
        return None

    def neighbourhood(self, last: QuantConfig, metrics: Sequence[str]) -> Candidate | None:
        """Round 1: the last point under its metric and residual, under the other metrics, and
        under the other available residuals. The answer is the passing candidate of fewest
        measured bits among round 1 and, when the centre fails, the points at most ``epsilon``
        steps less aggressive under the last residual kind (never bolder), evaluated smallest
        first and only where they measure smaller than round 1's best; they use the other metric
        when it passed clearly better at the centre."""
        space, eps = self.owner.space, self.owner.epsilon
        try:
            centre = space.point_of(last)
        except ValueError:
            return None
        emb, residual = last.embedding_bins, last.residual
        others = [m for m in metrics if m != last.metric]
        alternatives = [r for r in self.residuals if r != residual]
        same = self.config(centre, last.metric, emb, residual)
        first = self.evaluate(
            [same]
            + [self.config(centre, m, emb, residual) for m in others]
            + [self.config(centre, last.metric, emb, r) for r in alternatives]
        )
        metric = last.metric
        if others and first[1].passed and first[1].degradation < 0.9 * first[0].degradation:
            metric = others[0]
        chosen = self._cache[self.config(centre, metric, emb, residual)]
        best = min((c for c in first if c.passed), key=lambda c: c.bits, default=None)
        if chosen.passed:
            return best  # the smallest passing of round 1
        ranges = [range(c, min(n, c + eps + 1)) for c, n in zip(centre, space.shape)]
        points = [p for p in itertools.product(*ranges) if p != centre]  # never bolder
        near = [self.config(p, metric, emb, residual) for p in points]
        by_size = sorted(zip(self.size(near), near), key=lambda x: x[0])
        near = [c for bits, c in by_size if best is None or bits < best.bits]
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
        for bins in self.owner.space.embedding_bins:
            if bins >= found.config.embedding_bins:
                break
            cand = self.evaluate([replace(found.config, embedding_bins=bins)])[0]
            if cand.passed:
                return cand
        return found
