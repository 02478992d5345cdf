"""The quantization configuration manager (DynaQuant section 5, Alg. 4, Table 7).

The user states how much quality one checkpoint may lose (a metric, its direction, a threshold
of relative degradation and a few evaluation batches); the manager finds the most compressive
configuration that keeps to it, at every checkpoint, cheaply:

* **First checkpoint: guided exhaustive search.** The cube's axes (bins up, pruning down,
  protection up) each raise quality, so a failing point condemns every point below it and a
  passing point makes every point above it pointless. A binary search along the cube's diagonal
  finds a first passing configuration; the feasible sub-cubes around it are then explored
  best-first (most compressive first), skipping every candidate that the known results already
  decide. Size is measured (entropy of the codes), not assumed: it is monotone in bins and
  protection but not in pruning, so the lighter-pruning points at the best's bins and protection
  are measured too. Done for both pruning metrics; the smaller result wins.
* **Later checkpoints: epsilon-neighbourhood.** Candidates are the last choice (under both
  metrics) and the configurations at most ``epsilon`` steps away that are *not more aggressive*,
  most compressive first; the first that passes ends the round. If none passes, the exhaustive
  search runs again (counted as a fallback).
* **Data-parallel.** With ``torch.distributed`` initialised, each round hands one candidate to
  each rank; results are all-gathered, so every rank picks the same configuration.
* **Safe evaluation.** A candidate is evaluated by writing its dequantized values into the live
  model in place and copying the originals back from the checkpoint's CPU snapshot (which the
  compressor holds anyway: no deep copy of the model), under ``torch.no_grad``, in eval mode,
  with the train/eval mode and every RNG state restored: the weights are bit-identical after.
"""

from __future__ import annotations

import itertools
import math
import random
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from .core.quantizer import EMBEDDING, QuantConfig, QuantPlan, dequantize, plan_quantization, quantize

__all__ = [
    "held_out",
    "QualityMetric",
    "SearchSpace",
    "SearchResult",
    "ConfigurationSearch",
    "mean_loss",
    "accuracy",
    "perplexity",
    "output_distortion",
]


# ---------------------------------------------------------------------------------------------
# quality metrics


@dataclass
class QualityMetric:
    """A model-quality measure and its direction; :meth:`degradation` is relative (0.01 = 1%)."""

    fn: Callable[[torch.nn.Module], float]
    higher_is_better: bool = False
    name: str = "metric"
    relative: bool = True  # False for a metric that is itself a distortion (0 = perfect)

    def __call__(self, model: torch.nn.Module) -> float:
        return float(self.fn(model))

    def degradation(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline``, relative to it (negative: better)."""
        worse = baseline - value if self.higher_is_better else value - baseline
        return worse / max(abs(baseline), 1e-12) if self.relative else worse


def _batches(data: Iterable[Any]) -> list[Any]:
    return list(data)


def held_out(data: Iterable[Any], n: int) -> list[Any]:
    """The first ``n`` batches of ``data`` (a DataLoader, a list, any iterable), materialised,
    to evaluate candidates on; keep them out of training."""
    return list(itertools.islice(iter(data), n))


def _loss_of(model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    if isinstance(batch, Mapping):
        out = model(**batch)
        return out.loss if loss_fn is None else loss_fn(out, batch)
    inputs, target = batch
    out = model(inputs)
    logits = getattr(out, "logits", out)
    return (loss_fn or torch.nn.functional.cross_entropy)(logits, target)


def mean_loss(data: Iterable[Any], loss_fn: Callable | None = None) -> QualityMetric:
    """Mean loss over evaluation batches (lower is better). A batch is a dict for a Hugging Face
    model (``model(**batch).loss``) or an ``(inputs, target)`` pair (cross-entropy by default)."""
    batches = _batches(data)
    device_of = _device_of

    def fn(model: torch.nn.Module) -> float:
        dev = device_of(model)
        return float(np.mean([_loss_of(model, _to(b, dev), loss_fn).item() for b in batches]))

    return QualityMetric(fn, higher_is_better=False, name="loss")


def perplexity(data: Iterable[Any]) -> QualityMetric:
    """``exp`` of the mean loss (lower is better)."""
    loss = mean_loss(data)
    return QualityMetric(lambda m: math.exp(loss(m)), higher_is_better=False, name="perplexity")


def accuracy(data: Iterable[Any]) -> QualityMetric:
    """Top-1 accuracy over ``(inputs, labels)`` batches (higher is better)."""
    batches = _batches(data)

    def fn(model: torch.nn.Module) -> float:
        dev = _device_of(model)
        right = total = 0
        for inputs, labels in batches:
            out = model(_to(inputs, dev))
            pred = getattr(out, "logits", out).argmax(-1).cpu()
            right += int((pred == labels).sum())
            total += labels.numel()
        return right / max(total, 1)

    return QualityMetric(fn, higher_is_better=True, name="accuracy")


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
    """The configuration cube (Table 7 by default). Each axis is listed from the most
    compressive to the highest-quality value."""

    bins: tuple[int, ...] = (4, 6, 8, 12, 16, 32)
    prune: tuple[float, ...] = (0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
    protect: tuple[float, ...] = (0.0005, 0.005, 0.01)
    metrics: tuple[str, ...] = ("magnitude", "sensitivity")
    embedding_bins: tuple[int, ...] = (16, 32)

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.bins), len(self.prune), len(self.protect)

    def config(self, point: tuple[int, int, int], metric: str, base: QuantConfig, embedding_bins: int) -> QuantConfig:
        return replace(
            base,
            bins=self.bins[point[0]],
            prune=self.prune[point[1]],
            protect=self.protect[point[2]],
            metric=metric,
            embedding_bins=embedding_bins,
        )

    def point_of(self, config: QuantConfig) -> tuple[int, int, int]:
        return self.bins.index(config.bins), self.prune.index(config.prune), self.protect.index(config.protect)


def estimated_bits(config: QuantConfig) -> float:
    """Expected bits per quantized value, for ordering candidates (lower compresses more):
    the entropy of the code distribution plus 16 bits per protected value."""
    rest = max(1.0 - config.prune - config.protect, 1e-9)
    probs = [p for p in (config.prune, config.protect, rest) if p > 0]
    return -sum(p * math.log2(p) for p in probs) + rest * math.log2(config.bins) + 16 * config.protect


@dataclass
class Candidate:
    """One evaluated configuration."""

    config: QuantConfig
    degradation: float
    bits: float  # measured: entropy of the codes + 16 per protected value, per quantized value
    passed: bool
    plan: QuantPlan | None = field(default=None, repr=False, compare=False)  # kept on the rank that made it

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "bins": c.bins,
            "prune": c.prune,
            "protect": c.protect,
            "metric": c.metric,
            "embedding_bins": c.embedding_bins,
            "degradation": self.degradation,
            "bits": self.bits,
            "passed": self.passed,
        }


@dataclass
class SearchResult:
    """What the manager chose for one checkpoint and how."""

    config: QuantConfig | None  # None: nothing passed; store this checkpoint losslessly
    degradation: float | None
    baseline: float
    mode: str  # "exhaustive" | "neighbourhood" | "fallback"
    candidates: list[Candidate] = field(default_factory=list)
    local_evaluations: int = 0  # candidates this process evaluated itself (the rest came from other ranks)
    plan: QuantPlan | None = field(default=None, repr=False)

    @property
    def evaluations(self) -> int:
        return len(self.candidates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict() if self.config else None,
            "degradation": self.degradation,
            "baseline": self.baseline,
            "mode": self.mode,
            "evaluations": self.evaluations,
            "candidates": [c.to_dict() for c in self.candidates],
        }


# ---------------------------------------------------------------------------------------------
# evaluation


@contextmanager
def _preserved_state(model: torch.nn.Module):
    """Eval mode, no gradients, and every RNG state restored afterwards."""
    was_training = model.training
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng, np_rng = random.getstate(), np.random.get_state()
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)


def _live_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def evaluate_plan(
    model: torch.nn.Module, snapshot: Mapping[str, torch.Tensor], plan: QuantPlan, metric: QualityMetric
) -> tuple[float, float]:
    """``(metric value, measured bits per value)`` of the model with the plan's tensors
    quantized; the live weights are restored from ``snapshot`` bit-exactly afterwards."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    bits = total = 0.0
    with _preserved_state(model):
        try:
            for name, tp in plan.tensors.items():
                codes, protected = quantize(snapshot[name], tp)
                counts = np.bincount(codes)
                p = counts[counts > 0] / codes.size
                bits += float(-(p * np.log2(p)).sum()) * codes.size + 16 * protected.size
                total += codes.size
                live = _live_tensor(model, name)
                values = torch.from_numpy(dequantize(codes, tp.centres, protected)).view(live.shape)
                swapped.append((live, snapshot[name]))
                live.copy_(values.to(live.dtype))
            value = metric(model)
        finally:
            for live, original in swapped:
                live.copy_(original)
    return value, bits / max(total, 1.0)


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


# ---------------------------------------------------------------------------------------------
# the manager

# Quality is not exactly monotone along the cube's axes (pruning can even help), so a failure
# condemns the configurations below it only when it fails clearly: by more than this factor.
_CLEAR_FAIL = 2.0


class ConfigurationSearch:
    """Chooses a :class:`QuantConfig` per checkpoint (see the module docstring).

    Args:
        metric: the quality measure (see :func:`mean_loss`, :func:`accuracy`, ...).
        threshold: the relative degradation one checkpoint may cost (0.01 = 1%). The default,
            1%, comes from our GPT-2 and CNN runs (benchmarks/RESULTS.md): it keeps 4-16 bins and
            15-55x on the weights; at 0.1% the later GPT-2 checkpoints need 48-128 bins, beyond
            the cube's 32, and would be stored losslessly; 5% lets 4 bins through everywhere.
        space: the configuration cube.
        epsilon: neighbourhood radius, in cube steps, at later checkpoints.
        base: the fixed knobs (sigma, alpha, min_numel, seed) of every candidate.
    """

    def __init__(
        self,
        metric: QualityMetric,
        threshold: float = 0.01,
        *,
        space: SearchSpace | None = None,
        epsilon: int = 1,
        base: QuantConfig | None = None,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.metric, self.threshold = metric, threshold
        self.space, self.epsilon, self.base = space or SearchSpace(), epsilon, base or QuantConfig()
        self.last: QuantConfig | None = None
        self.fallbacks = 0

    def search(
        self,
        model: torch.nn.Module,
        snapshot: Mapping[str, torch.Tensor],
        *,
        types: Mapping[str, str] | None = None,
        sensitivity: Mapping[str, torch.Tensor] | None = None,
    ) -> SearchResult:
        """Choose the configuration for the checkpoint whose exact weights are ``snapshot``
        (names as in ``model.state_dict()``; only the tensors to quantize are needed)."""
        with _preserved_state(model):
            baseline = self.metric(model)
        metrics = [m for m in self.space.metrics if m == "magnitude" or sensitivity]
        ctx = _Context(self, model, snapshot, types, sensitivity, baseline)
        if self.last is not None and self.last.metric in metrics:
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
            return SearchResult(None, None, baseline, mode, ctx.tried, local_evaluations=ctx.local)
        found = ctx.embedding_bins(found)
        self.last = found.config
        plan = found.plan or plan_quantization(snapshot, found.config, types=types, sensitivity=sensitivity)
        return SearchResult(found.config, found.degradation, baseline, mode, ctx.tried, ctx.local, plan)


class _Context:
    """The state of one checkpoint's search: evaluated points and the rules they imply."""

    def __init__(
        self,
        owner: ConfigurationSearch,
        model: torch.nn.Module,
        snapshot: Mapping[str, torch.Tensor],
        types: Mapping[str, str] | None,
        sensitivity: Mapping[str, torch.Tensor] | None,
        baseline: float,
    ) -> None:
        self.owner, self.model, self.snapshot = owner, model, snapshot
        self.types, self.sensitivity, self.baseline = types, sensitivity, baseline
        self.tried: list[Candidate] = []
        self.local = 0
        self.sketches: dict = {}  # per-tensor sketches, shared by every candidate of this checkpoint
        self._cache: dict[QuantConfig, Candidate] = {}
        self.has_embeddings = any((types or {}).get(n) == EMBEDDING for n in snapshot) or any(
            "embed" in n.lower() for n in snapshot
        )

    def _embedding_default(self) -> int:
        return self.owner.space.embedding_bins[-1]

    def config(self, point: tuple[int, int, int], metric: str, embedding_bins: int | None = None) -> QuantConfig:
        return self.owner.space.config(point, metric, self.owner.base, embedding_bins or self._embedding_default())

    def evaluate(self, configs: Sequence[QuantConfig]) -> list[Candidate]:
        """Evaluate a round: one configuration per rank, results shared by all ranks."""
        todo = [c for c in dict.fromkeys(configs) if c not in self._cache]
        rank, world = _world()
        for start in range(0, len(todo), world):
            batch = todo[start : start + world]
            mine = []
            if rank < len(batch):
                plan = plan_quantization(
                    self.snapshot,
                    batch[rank],
                    types=self.types,
                    sensitivity=self.sensitivity,
                    sketch_cache=self.sketches,
                )
                value, bits = evaluate_plan(self.model, self.snapshot, plan, self.owner.metric)
                deg = self.owner.metric.degradation(self.baseline, value)
                mine.append(Candidate(batch[rank], deg, bits, deg <= self.owner.threshold, plan))
                self.local += 1
            gathered = _gather([replace(c, plan=None) for c in mine]) if world > 1 else mine
            for cand in gathered:
                self._cache[cand.config] = cand
                self.tried.append(cand)
        return [self._cache[c] for c in configs]

    def exhaustive(self, metrics: Sequence[str]) -> Candidate | None:
        results = [r for r in (self._cube(m) for m in metrics) if r is not None]
        return min(results, key=lambda c: (c.bits, c.degradation), default=None)

    def _cube(self, metric: str) -> Candidate | None:
        """Guided exhaustive search of the cube for one pruning metric."""
        space, world = self.owner.space, _world()[1]
        shape = space.shape
        points = list(itertools.product(*(range(n) for n in shape)))
        passed: list[tuple[int, int, int]] = []
        failed: list[tuple[int, int, int]] = []

        def record(cands: list[Candidate], pts: list[tuple[int, int, int]]) -> None:
            for c, p in zip(cands, pts):
                if c.passed:
                    passed.append(p)
                elif c.degradation > _CLEAR_FAIL * self.owner.threshold:
                    failed.append(p)  # only a clear failure condemns the points below it

        # 1. binary search on the diagonal for the first passing point
        steps = max(shape)
        diagonal = [tuple(round(t * (n - 1) / (steps - 1)) if steps > 1 else 0 for n in shape) for t in range(steps)]
        lo, hi = 0, steps - 1
        if not self.evaluate([self.config(diagonal[hi], metric)])[0].passed:
            return None  # even the highest-quality configuration fails
        passed.append(diagonal[hi])
        while lo < hi:
            probes = sorted({lo + (hi - lo) * (i + 1) // (world + 1) for i in range(world)})
            cands = self.evaluate([self.config(diagonal[t], metric) for t in probes])
            record(cands, [diagonal[t] for t in probes])
            first_pass = next((t for t, c in zip(probes, cands) if c.passed), None)
            last_fail = max((t for t, c in zip(probes, cands) if not c.passed), default=lo - 1)
            hi = first_pass if first_pass is not None else hi
            lo = last_fail + 1
        best = self._cache[self.config(diagonal[hi], metric)]

        # 2. the feasible sub-cubes, best-first, skipping what the results already decide
        def open_points() -> list[tuple[int, int, int]]:
            out = []
            for p in points:
                if self.config(p, metric) in self._cache:
                    continue  # evaluated already
                if any(all(a <= b for a, b in zip(p, f)) for f in failed):
                    continue  # at most as good as a failing point: fails
                if any(all(a >= b for a, b in zip(p, q)) for q in passed):
                    continue  # at least as good as a passing point: passes, compresses no better
                if estimated_bits(self.config(p, metric)) >= estimated_bits(best.config):
                    continue  # cannot beat the best found
                out.append(p)
            return sorted(out, key=lambda p: estimated_bits(self.config(p, metric)))

        while frontier := open_points()[:world]:
            cands = self.evaluate([self.config(p, metric) for p in frontier])
            record(cands, frontier)
            for c in cands:
                if c.passed and c.bits < best.bits:
                    best = c

        # 3. less pruning at the best's bins and protection: quality only rises along this axis,
        # but entropy-coded size need not fall with more pruning (pruned zeros are one more symbol
        # next to centres that may already be skewed), so measure it rather than assume
        b, p, r = space.point_of(best.config)
        lighter = [(b, q, r) for q in range(p + 1, shape[1])]
        for start in range(0, len(lighter), world):
            for c in self.evaluate([self.config(q, metric) for q in lighter[start : start + world]]):
                if c.passed and c.bits < best.bits:
                    best = c
        return best

    def neighbourhood(self, last: QuantConfig, metrics: Sequence[str]) -> Candidate | None:
        space, eps = self.owner.space, self.owner.epsilon
        try:
            centre = space.point_of(last)
        except ValueError:
            return None
        emb = last.embedding_bins
        others = [m for m in metrics if m != last.metric]
        # round 1: the same configuration under both metrics; switch only if clearly better
        first = self.evaluate([self.config(centre, last.metric, emb)] + [self.config(centre, m, emb) for m in others])
        metric = last.metric
        if len(first) > 1 and first[1].passed and first[1].degradation < 0.9 * first[0].degradation:
            metric = others[0]
        if self._cache[self.config(centre, metric, emb)].passed:
            return self._cache[self.config(centre, metric, emb)]
        ranges = [range(c, min(n, c + eps + 1)) for c, n in zip(centre, space.shape)]
        near = [p for p in itertools.product(*ranges) if p != centre]  # never more aggressive
        near.sort(key=lambda p: estimated_bits(self.config(p, metric, emb)))
        world = _world()[1]
        for start in range(0, len(near), world):
            batch = near[start : start + world]
            for cand in self.evaluate([self.config(p, metric, emb) for p in batch]):
                if cand.passed:
                    return cand
        return None

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
