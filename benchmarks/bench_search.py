"""The DynaQuant configuration manager (section 5, Alg. 4, Table 7) on two small real models.

Run it with::

    python benchmarks/bench_search.py      # options: --thresholds 0.005,0.01,0.05 --sequence-threshold 0.01
                                           #   --brute-checkpoints 0,5 --models gpt2,cnn --gpt2-eval-batches 4
                                           #   --gpt2-grad-batches 4 --json PATH --retrain

Two workloads, each a sequence of ten real training checkpoints, searched over the whole cube
of Table 7 (bins 4-32, pruning 0.5-0, protection 0.0005-0.01, magnitude or sensitivity
pruning, 16 or 32 embedding bins):

* **gpt2**: the character-level GPT-2 of ``benchmarks/_gpt2_run.py`` (its cached run; 0.82 M
  parameters, 18 quantized tensors, the two embeddings among them). Metric: mean next-character
  loss on the first ``--gpt2-eval-batches`` of its held-out batches (16 x 128 characters each).
  Sensitivity ``|EMA(g) * w|``: the cached run kept no gradients, so the EMA (beta 0.9) is taken
  over the gradients of ``--gpt2-grad-batches`` training batches (seeded draw) at each
  checkpoint's weights rather than over the 50 optimizer steps before it.
* **cnn**: a small CNN trained here on sklearn's ``load_digits`` (1,797 8x8 images, stratified
  80/20 split): Conv2d(1,16,3)-ReLU-Conv2d(16,32,3)-ReLU-Linear(512,512)-ReLU-Linear(512,10),
  272,586 parameters, Adam (lr 1e-3), batch 32, 600 steps, a ``state_dict`` copy every 60 steps.
  The gradient EMA (beta 0.9) is fed during the 50 steps before each checkpoint (the paper's
  N = 50), as :class:`hf_dynaquant.Compressor` does. The layers are sized so that the default
  ``QuantConfig`` (``min_numel=4096``) quantizes the second convolution (4,608 weights) and both
  linear layers (262,144 and 5,120); the first convolution (144 weights, 0.05% of the model)
  and the biases stay lossless. Metric: mean cross-entropy on the 360 held-out images.

Part 1, guided search against brute force, at each checkpoint of ``--brute-checkpoints`` and
each threshold of ``--thresholds`` (relative degradation of the metric): the brute force
evaluates every point of the cube under both pruning criteria and, for a model with embeddings,
both embedding bin counts (432 points for GPT-2, 216 for the CNN), one evaluation each
(``evaluate_plan``); its optimum is the passing point of fewest measured bits per quantized
value (entropy of the codes plus 16 bits per protected value; ties by degradation). The guided
search is a fresh :class:`~hf_dynaquant.search.ConfigurationSearch` (so exhaustive mode). Both
see the same deterministic evaluations: metric calls are memoised by a digest of the model's
parameters, which lets the brute force and the searches at several thresholds share them;
evaluation counts are the search's own records (``result.evaluations``) and are unaffected, the
unquantized baseline (one more call for each) is not counted. Different configurations often
tie on bits (without pruning, the pruning metric makes no difference), so the guided choice
"reaches the optimum" when it has the optimum's bits, and "steps apart" is its largest per-axis
distance, in cube steps, to the nearest passing point with those bits. "non-monotone" counts
passing points that a failing point at least as good on every axis dominates (the search lets
only a clear failure skip the points below it: past the threshold by twice the larger of the
threshold and the largest inversion seen, ``search._Context.condemned``); "sized" is how many
configurations the search planned and measured (code entropy) without evaluating the model, to
order its candidates (``result.sized``; a size costs about a quarter of a GPT-2 evaluation here,
and two thirds of a CNN one).

Part 2, the sequence: one search object at ``--sequence-threshold`` over all ten checkpoints
(exhaustive at the first, epsilon-neighbourhood with epsilon 1 after), each checkpoint written to
a :class:`~hf_dynaquant.CheckpointStore` in a temporary folder with the chosen plan
(:func:`~hf_dynaquant.pipeline.write_planned`), delta-coded on the previous entry (the first is a keyframe). The ratio
is the ``model`` section's raw bytes over its stored blob bytes (``store.info``); the lossless
column writes the same checkpoints losslessly (also as a delta chain) for comparison. Each entry
is read back and its degradation measured again ("restored"). Metric calls are not memoised
here, so the search times are real.

It prints markdown tables and verdicts, writes ``benchmarks/out/search.png`` and, with ``--json``,
the raw numbers (every brute-force point included). 3.5 to 5 minutes on 2 CPU cores, most of it
the GPT-2 brute force (2 x 432 evaluations at 0.17-0.32 s each).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _gpt2_run import _split, add_arguments, get_run, new_model
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from hf_dynaquant import CheckpointStore
from hf_dynaquant.core.quantizer import EMBEDDING, QuantConfig, layer_types, plan_quantization
from hf_dynaquant.core.ranking import GradientEMA
from hf_dynaquant.pipeline import for_section, write_planned
from hf_dynaquant.search import (
    ConfigurationSearch,
    QualityMetric,
    SearchResult,
    SearchSpace,
    evaluate_plan,
    mean_loss,
)

PLOT_PATH = Path(__file__).resolve().parent / "out" / "search.png"
SPACE = SearchSpace(bins=(4, 6, 8, 12, 16, 32))  # the paper's Table 7 (our default adds 3 bins)
EMA_BETA = 0.9

StateDict = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# workloads


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: StateDict  # model.state_dict() at that step
    sensitivity: StateDict  # parameter name -> |EMA(g) * w|


@dataclass
class Workload:
    name: str
    description: str
    model: torch.nn.Module
    checkpoints: list[Checkpoint]
    metric: QualityMetric
    config: QuantConfig  # fixed knobs of every candidate

    @property
    def types(self) -> dict[str, str]:
        return layer_types(self.model)

    @property
    def has_embeddings(self) -> bool:
        return EMBEDDING in self.types.values()

    def load(self, index: int) -> StateDict:
        """Put checkpoint ``index`` into the live model; returns the snapshot the search restores from."""
        self.model.load_state_dict(self.checkpoints[index].state)
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def gradient_sensitivity(model: torch.nn.Module, losses: Iterable[Callable[[], torch.Tensor]]) -> StateDict:
    """``|EMA(g) * w|`` of every parameter, the EMA over the gradients of ``losses`` in turn."""
    ema = GradientEMA(model.named_parameters(), beta=EMA_BETA)
    for loss in losses:
        model.zero_grad(set_to_none=True)
        loss().backward()
        ema.start()
        ema.finish()
    model.zero_grad(set_to_none=True)
    return {n: ema.sensitivity(n, p) for n, p in model.named_parameters()}


def gpt2_workload(eval_batches: int, grad_batches: int, retrain: bool) -> Workload:
    run = get_run(retrain)
    s = run.settings
    model = new_model(s)
    _, blocks = _split(s)
    draw = torch.Generator().manual_seed(s.seed)
    checkpoints = []
    for ckpt in run.checkpoints:
        model.load_state_dict(ckpt.state)
        rows = torch.randint(blocks.shape[0], (grad_batches, s.batch), generator=draw)
        losses = [lambda b=blocks[r]: model(input_ids=b, labels=b).loss for r in rows]
        checkpoints.append(Checkpoint(ckpt.step, ckpt.state, gradient_sensitivity(model, losses)))
    metric = mean_loss({"input_ids": b, "labels": b} for b in run.eval_data[:eval_batches])
    first, last = run.checkpoints[0], run.checkpoints[-1]
    description = (
        f"GPT-2 (_gpt2_run.py, {'cached' if run.cached else 'trained now'}): {s.n_layer} layers, width {s.n_embd}, "
        f"{run.parameters:,} parameters, checkpoints every {s.every} of {s.steps} steps. Metric: mean loss on "
        f"{eval_batches} held-out batches of {s.batch} x {s.block} characters (all 20 batches: {first.eval_loss:.4f} "
        f"at step {first.step} -> {last.eval_loss:.4f} at step {last.step}). Sensitivity: gradient EMA over "
        f"{grad_batches} training batches at each checkpoint."
    )
    return Workload("gpt2", description, model, checkpoints, metric, QuantConfig())


def digits_cnn() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def cnn_workload(steps: int = 600, checkpoints: int = 10, batch: int = 32, ema_steps: int = 50) -> Workload:
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=0.2, stratify=digits.target, random_state=0
    )
    x_train, y_train, x_test, y_test = images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]
    torch.manual_seed(0)
    model = digits_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ema = GradientEMA(model.named_parameters(), beta=EMA_BETA)
    every = steps // checkpoints
    epochs = -(-steps * batch // len(y_train))
    order = torch.cat([torch.randperm(len(y_train)) for _ in range(epochs)])
    saved: list[Checkpoint] = []
    evals: list[tuple[float, float]] = []
    for step in range(steps):
        idx = order[step * batch : (step + 1) * batch]
        loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        if step % every >= every - ema_steps:
            ema.start()
            ema.finish()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % every == 0:
            state = {n: t.detach().clone() for n, t in model.state_dict().items()}
            sens = {n: ema.sensitivity(n, p) for n, p in model.named_parameters()}
            saved.append(Checkpoint(step + 1, state, sens))
            ema.reset()
            with torch.no_grad():
                logits = model(x_test)
                evals.append(
                    (
                        float(torch.nn.functional.cross_entropy(logits, y_test)),
                        float((logits.argmax(-1) == y_test).float().mean()),
                    )
                )
    parameters = sum(p.numel() for p in model.parameters())
    description = (
        f"CNN on load_digits ({len(y_train)} train / {len(y_test)} held-out images): {parameters:,} parameters, "
        f"Adam lr 1e-3, batch {batch}, {steps} steps, checkpoint every {every}. Held-out loss / accuracy "
        f"{evals[0][0]:.4f} / {evals[0][1]:.1%} at step {saved[0].step} -> {evals[-1][0]:.4f} / {evals[-1][1]:.1%} "
        f"at step {saved[-1].step}. Sensitivity: gradient EMA over the {ema_steps} steps before each checkpoint."
    )
    metric = mean_loss([(x_test, y_test)])
    return Workload("cnn", description, model, saved, metric, QuantConfig())


# ---------------------------------------------------------------------------------------------
# measurements


class _Memo:
    """A metric function memoised by a digest of the model's parameters."""

    def __init__(self, fn: Callable[[torch.nn.Module], float]) -> None:
        self.fn = fn
        self.values: dict[bytes, float] = {}

    def __call__(self, model: torch.nn.Module) -> float:
        digest = hashlib.blake2b(digest_size=16)
        for p in model.parameters():
            digest.update(p.detach().contiguous().numpy())
        key = digest.digest()
        if key not in self.values:
            self.values[key] = self.fn(model)
        return self.values[key]


def memoised(metric: QualityMetric) -> QualityMetric:
    return replace(metric, fn=_Memo(metric.fn))


@dataclass(frozen=True)
class Point:
    """One brute-force evaluation."""

    config: QuantConfig
    degradation: float
    bits: float


@dataclass(frozen=True)
class BruteForce:
    checkpoint: int
    step: int
    baseline: float
    points: list[Point]
    seconds: float


def brute_force(w: Workload, index: int, metric: QualityMetric) -> BruteForce:
    """Every point of the cube, under both pruning criteria (and both embedding bin counts)."""
    snapshot = w.load(index)
    types, sensitivity = w.types, w.checkpoints[index].sensitivity
    embedding_bins = SPACE.embedding_bins if w.has_embeddings else SPACE.embedding_bins[-1:]
    start = time.perf_counter()
    w.model.eval()
    with torch.no_grad():
        baseline = metric(w.model)
    points = []
    for point in itertools.product(*(range(n) for n in SPACE.shape)):
        for prune_by, emb in itertools.product(SPACE.prune_by, embedding_bins):
            config = SPACE.config(point, prune_by, w.config, emb)
            plan = plan_quantization(snapshot, config, types=types, sensitivity=sensitivity)
            value, bits = evaluate_plan(w.model, snapshot, plan, metric)
            points.append(Point(config, metric.degradation(baseline, value), bits))
    return BruteForce(index, w.checkpoints[index].step, baseline, points, time.perf_counter() - start)


def config_dict(config: QuantConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("bins", "prune", "protect", "prune_by", "embedding_bins")}


def steps_apart(a: QuantConfig, b: QuantConfig) -> int:
    """The largest distance, in cube steps, between two configurations over all axes."""
    axes = [
        (SPACE.bins, "bins"),
        (SPACE.prune, "prune"),
        (SPACE.protect, "protect"),
        (SPACE.prune_by, "prune_by"),
        (SPACE.embedding_bins, "embedding_bins"),
    ]
    return max(abs(values.index(getattr(a, k)) - values.index(getattr(b, k))) for values, k in axes)


def cube_point(config: Mapping[str, Any]) -> tuple[Any, ...]:
    return config["bins"], config["prune"], config["protect"]


def chosen_bits(result: SearchResult) -> float | None:
    return next((c.bits for c in result.candidates if c.config == result.config), None)


@dataclass(frozen=True)
class Comparison:
    model: str
    checkpoint: int
    step: int
    threshold: float
    passing: int  # brute-force points that pass
    non_monotone: int  # passing points that some failing point dominates (better on every cube axis)
    optimum_dominated: bool  # the optimum is one of them: the search's pruning rule would discard it
    brute_config: dict[str, Any] | None
    brute_bits: float | None
    brute_degradation: float | None
    brute_evaluations: int
    guided_config: dict[str, Any] | None
    guided_bits: float | None
    guided_degradation: float | None
    guided_evaluations: int
    guided_sized: int  # configurations planned and measured, not evaluated, to order the candidates
    reaches_optimum: bool  # the guided choice has the optimum's bits (ties are common)
    steps_apart: int | None  # from the guided choice to the nearest passing point with the optimum's bits

    @property
    def within_one_step(self) -> bool:
        return self.reaches_optimum or (self.steps_apart is not None and self.steps_apart <= 1)

    @property
    def fewer(self) -> float:
        return self.brute_evaluations / max(self.guided_evaluations, 1)


def dominated(p: Point, failing: list[Point]) -> bool:
    """Whether a failing point with the same pruning criterion and embedding bins is better on every cube axis."""
    at = SPACE.point_of(p.config)
    return any(
        f.config.prune_by == p.config.prune_by
        and f.config.embedding_bins == p.config.embedding_bins
        and all(a <= b for a, b in zip(at, SPACE.point_of(f.config)))
        for f in failing
    )


def compare(w: Workload, brute: BruteForce, threshold: float, metric: QualityMetric) -> Comparison:
    snapshot = w.load(brute.checkpoint)
    search = ConfigurationSearch(metric, threshold, search_space=SPACE, config=w.config)
    result = search.search(w.model, snapshot, types=w.types, sensitivity=w.checkpoints[brute.checkpoint].sensitivity)
    passing = [p for p in brute.points if p.degradation <= threshold]
    failing = [p for p in brute.points if p.degradation > threshold]
    best = min(passing, key=lambda p: (p.bits, p.degradation), default=None)
    bits = chosen_bits(result)
    if best is None or result.config is None or bits is None:
        reaches, apart = best is None and result.config is None, None
    else:
        optima = [p for p in passing if p.bits <= best.bits + 1e-9]
        reaches = bits <= best.bits + 1e-9
        apart = min(steps_apart(p.config, result.config) for p in optima)
    return Comparison(
        w.name,
        brute.checkpoint,
        brute.step,
        threshold,
        len(passing),
        sum(dominated(p, failing) for p in passing),
        best is not None and dominated(best, failing),
        config_dict(best.config) if best else None,
        best.bits if best else None,
        best.degradation if best else None,
        len(brute.points),
        config_dict(result.config) if result.config else None,
        bits,
        result.degradation,
        result.evaluations,
        result.sized,
        reaches,
        apart,
    )


@dataclass(frozen=True)
class SequenceRow:
    checkpoint: int
    step: int
    mode: str
    evaluations: int
    config: dict[str, Any] | None
    degradation: float | None
    restored_degradation: float
    bits: float | None
    raw_nbytes: int
    stored_nbytes: int
    lossless_stored_nbytes: int
    search_s: float
    write_s: float

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.stored_nbytes

    @property
    def lossless_ratio(self) -> float:
        return self.raw_nbytes / self.lossless_stored_nbytes


def restore(w: Workload, store: CheckpointStore, entry: str, baseline: float) -> float:
    """Degradation of the model with the weights of ``entry`` as read back from the store."""
    with store.open(entry) as reader:
        w.model.load_state_dict(reader.load_section("model"))
    w.model.eval()
    with torch.no_grad():
        return w.metric.degradation(baseline, w.metric(w.model))


def sequence(w: Workload, threshold: float, folder: Path) -> tuple[list[SequenceRow], int]:
    """One search over the whole run, each checkpoint written with its plan; (rows, fallbacks)."""
    search = ConfigurationSearch(w.metric, threshold, search_space=SPACE, config=w.config)
    store, lossless = CheckpointStore(folder / w.name), CheckpointStore(folder / f"{w.name}-lossless")
    entry = lossless_entry = None
    rows = []
    for i, ckpt in enumerate(w.checkpoints):
        snapshot = w.load(i)
        start = time.perf_counter()
        result = search.search(w.model, snapshot, types=w.types, sensitivity=ckpt.sensitivity)
        searched = time.perf_counter()
        plan = for_section(result.plan) if result.plan is not None else None
        state = w.model.state_dict()
        entry = write_planned(store, {"model": state}, plan, base=entry, ref=f"ckpt-{i}")
        written = time.perf_counter()
        lossless_entry = lossless.write({"model": state}, base=lossless_entry, ref=f"ckpt-{i}")
        raw, stored = store.info(entry).sections["model"]
        restored = restore(w, store, entry, result.baseline)
        rows.append(
            SequenceRow(
                i,
                ckpt.step,
                result.mode,
                result.evaluations,
                config_dict(result.config) if result.config else None,
                result.degradation,
                restored,
                chosen_bits(result),
                raw,
                stored,
                lossless.info(lossless_entry).sections["model"][1],
                searched - start,
                written - searched,
            )
        )
    return rows, search.fallbacks


# ---------------------------------------------------------------------------------------------
# output


def fmt_config(c: Mapping[str, Any] | None, embeddings: bool) -> str:
    if c is None:
        return "none (lossless)"
    text = f"{c['bins']} / {c['prune']:g} / {c['protect']:g} / {c['prune_by'][:4]}"
    return f"{text} / {c['embedding_bins']}" if embeddings else text


def fmt_bits(bits: float | None) -> str:
    return "-" if bits is None else f"{bits:.3f} ({32 / bits:.1f}x)"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def comparison_table(rows: list[Comparison], embeddings: bool) -> str:
    axes = "bins / prune / protect / metric" + (" / emb bins" if embeddings else "")
    lines = [
        f"| ckpt (step) | threshold | passing (non-monotone) | brute-force optimum ({axes}) | bits (32/bits) | "
        "degradation | guided choice | bits (32/bits) | degradation | optimum bits | steps apart | guided evals | "
        "guided sized | brute evals | fewer |",
        "|---|---:|---:|---|---:|---:|---|---:|---:|:---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.checkpoint} ({r.step}) | {r.threshold:.1%} | {r.passing} ({r.non_monotone}"
            f"{'*' if r.optimum_dominated else ''}) | {fmt_config(r.brute_config, embeddings)} | "
            f"{fmt_bits(r.brute_bits)} | {fmt_pct(r.brute_degradation)} | {fmt_config(r.guided_config, embeddings)} | "
            f"{fmt_bits(r.guided_bits)} | {fmt_pct(r.guided_degradation)} | {'yes' if r.reaches_optimum else 'no'} | "
            f"{'-' if r.steps_apart is None else r.steps_apart} | {r.guided_evaluations} | {r.guided_sized} | "
            f"{r.brute_evaluations} | "
            f"{r.fewer:.1f}x |"
        )
    return "\n".join(lines)


def sequence_table(rows: list[SequenceRow], embeddings: bool) -> str:
    axes = "bins / prune / protect / metric" + (" / emb bins" if embeddings else "")
    lines = [
        f"| ckpt | step | mode | evals | chosen ({axes}) | degradation | restored | bits | weights raw -> stored B | "
        "ratio | lossless ratio | search s | write s |",
        "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.checkpoint} | {r.step} | {r.mode} | {r.evaluations} | {fmt_config(r.config, embeddings)} | "
            f"{fmt_pct(r.degradation)} | {fmt_pct(r.restored_degradation)} | "
            f"{'-' if r.bits is None else f'{r.bits:.3f}'} | {r.raw_nbytes:,} -> {r.stored_nbytes:,} | "
            f"{r.ratio:.2f} | {r.lossless_ratio:.3f} | {r.search_s:.1f} | {r.write_s:.2f} |"
        )
    return "\n".join(lines)


def comparison_verdict(rows: list[Comparison]) -> str:
    found = [r for r in rows if r.brute_config is not None]
    reached = sum(r.reaches_optimum for r in found)
    near = sum(r.within_one_step for r in found)
    gaps = [r.guided_bits / r.brute_bits - 1 for r in found if r.guided_bits and r.brute_bits]
    gap_text = f"{min(gaps):.1%} to {max(gaps):.1%} (median {statistics.median(gaps):.1%})" if gaps else "-"
    fewer = [r.fewer for r in rows]
    met = near == len(found) and min(fewer) >= 3
    return (
        f"guided reaches the brute-force optimum's bits in {reached}/{len(found)} cases, is within one step of an "
        f"optimum in {near}/{len(found)}; its bits exceed the optimum's by {gap_text}; evaluations "
        f"{min(fewer):.1f}x to {max(fewer):.1f}x fewer (median {statistics.median(fewer):.1f}x); the optimum is "
        f"dominated by a failing point in {sum(r.optimum_dominated for r in found)}/{len(found)} cases. "
        f"Bar (optimum or within one step, several (>= 3x) fewer evaluations): {'MET' if met else 'NOT MET'}."
    )


def sequence_verdict(rows: list[SequenceRow], fallbacks: int) -> str:
    later = rows[1:]
    evals = [r.evaluations for r in later]
    modes = {m: sum(r.mode == m for r in later) for m in ("neighbourhood", "fallback", "exhaustive")}
    kept = sum(
        r.config is not None and q.config is not None and cube_point(r.config) == cube_point(q.config)
        for q, r in zip(rows, later)
    )
    exact = all(r.degradation is None or abs(r.restored_degradation - r.degradation) < 1e-9 for r in rows)
    return (
        f"first checkpoint: {rows[0].evaluations} evaluations ({rows[0].mode}); later checkpoints: "
        f"{', '.join(f'{n} {m}' for m, n in modes.items() if n)}; evaluations {evals} "
        f"(median {statistics.median(evals):g}, mean {statistics.mean(evals):.1f}; a first round is the last choice "
        f"under both pruning criteria, 2 evaluations); the cube point (bins, prune, protect) was kept at "
        f"{kept}/{len(later)}; "
        f"{fallbacks} exhaustive fallback(s). Checkpoints read back from the store reproduce the searched "
        f"degradation: {'yes' if exact else 'NO'}."
    )


def plot(results: dict[str, dict[str, Any]], threshold: float, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(14, 9))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2)
    ax_evals, ax_bits, ax_bars = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    markers = {"exhaustive": "s", "neighbourhood": "o", "fallback": "X"}
    most = 1
    for (name, res), color in zip(results.items(), ("tab:blue", "tab:orange")):
        rows: list[SequenceRow] = res["sequence"]
        most = max(most, *(r.evaluations for r in rows))
        ax_evals.plot([r.checkpoint for r in rows], [r.evaluations for r in rows], color=color, label=name)
        ax_bits.plot([r.checkpoint for r in rows], [r.bits or np.nan for r in rows], color=color, label=name)
        for r in rows:
            ax_evals.scatter(r.checkpoint, r.evaluations, color=color, marker=markers[r.mode], zorder=3)
            ax_bits.annotate(
                f"{r.ratio:.1f}x",
                (r.checkpoint, r.bits or np.nan),
                fontsize=7,
                color=color,
                xytext=(0, 5),
                textcoords="offset points",
                ha="center",
            )
    for mode, marker in markers.items():
        ax_evals.scatter([], [], color="grey", marker=marker, label=mode)
    ax_evals.set_yscale("log")
    ax_evals.set_yticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200) if t <= 2 * most])
    ax_evals.yaxis.set_major_formatter(ScalarFormatter())
    ax_evals.yaxis.set_minor_formatter(NullFormatter())
    ax_evals.set_title(f"one search over the run (threshold {threshold:.1%}): evaluations per checkpoint")
    ax_evals.set_xlabel("checkpoint")
    ax_evals.legend(fontsize=8)
    ax_bits.set_title("chosen bits per quantized value (labels: stored weights ratio)")
    ax_bits.set_xlabel("checkpoint")
    ax_bits.legend(fontsize=8)
    ax_bits.margins(y=0.1)

    comparisons = [c for res in results.values() for c in res["comparisons"]]
    labels = [
        f"{c.model} c{c.checkpoint} {c.threshold:.1%}\n"
        + (f"bits {c.guided_bits / c.brute_bits - 1:+.0%}" if c.guided_bits and c.brute_bits else "bits -")
        for c in comparisons
    ]
    x = np.arange(len(comparisons))
    guided = ax_bars.bar(x - 0.2, [c.guided_evaluations for c in comparisons], 0.4, label="guided", color="tab:green")
    brute = ax_bars.bar(x + 0.2, [c.brute_evaluations for c in comparisons], 0.4, label="brute force", color="tab:grey")
    ax_bars.bar_label(guided, fontsize=8)
    ax_bars.bar_label(brute, fontsize=8)
    ax_bars.set_xticks(x, labels, fontsize=8)
    ax_bars.set_ylabel("evaluations")
    ax_bars.set_title("guided search (fresh, exhaustive mode) vs brute force; labels: guided bits over the optimum's")
    ax_bars.legend(fontsize=8)
    ax_bars.margins(y=0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_list(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", default="0.005,0.01,0.05", help="part 1 thresholds (default 0.005,0.01,0.05)")
    parser.add_argument("--sequence-threshold", type=float, default=0.01, help="part 2 threshold (default 0.01)")
    parser.add_argument("--brute-checkpoints", default="0,5", help="checkpoint indices brute-forced (default 0,5)")
    parser.add_argument("--models", default="gpt2,cnn", help="workloads to run (default gpt2,cnn)")
    parser.add_argument("--gpt2-eval-batches", type=int, default=4, help="held-out GPT-2 batches in the metric (4)")
    parser.add_argument("--gpt2-grad-batches", type=int, default=4, help="training batches in the gradient EMA (4)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers to PATH as JSON")
    add_arguments(parser)
    args = parser.parse_args()
    thresholds = parse_list(args.thresholds, float)
    brute_at = parse_list(args.brute_checkpoints, int)
    models = parse_list(args.models, str)
    if not set(models) <= {"gpt2", "cnn"}:
        parser.error("--models takes gpt2 and/or cnn")

    print(
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads.\n"
    )
    results: dict[str, dict[str, Any]] = {}
    for name in models:
        start = time.perf_counter()
        if name == "gpt2":
            w = gpt2_workload(args.gpt2_eval_batches, args.gpt2_grad_batches, args.retrain)
        else:
            w = cnn_workload()
        prepared = time.perf_counter()
        print(f"## {name}\n\n{w.description} (prepared in {prepared - start:.0f} s)\n")

        metric = memoised(w.metric)
        brutes = [brute_force(w, i, metric) for i in brute_at]
        for b in brutes:
            print(
                f"- brute force at checkpoint {b.checkpoint} (step {b.step}): {len(b.points)} evaluations in "
                f"{b.seconds:.0f} s ({b.seconds / len(b.points):.2f} s each); baseline {w.metric.name} {b.baseline:.4f}"
            )
        comparisons = [compare(w, b, t, metric) for b in brutes for t in thresholds]
        compared = time.perf_counter()
        print(f"\n### Guided search vs brute force\n\n{comparison_table(comparisons, w.has_embeddings)}\n")
        print(
            "non-monotone: passing points that a failing point dominates (at least as good on every cube axis, "
            "same metric and embedding bins); * the optimum is one of them. steps apart: to the nearest passing "
            "point with the optimum's bits. guided sized: configurations the search planned and measured without "
            "evaluating the model, to order its candidates.\n"
        )
        print(comparison_verdict(comparisons) + "\n")

        with tempfile.TemporaryDirectory() as tmp:
            rows, fallbacks = sequence(w, args.sequence_threshold, Path(tmp))
        done = time.perf_counter()
        print(
            f"### One search over the run, threshold {args.sequence_threshold:.1%}\n\n"
            f"{sequence_table(rows, w.has_embeddings)}\n"
        )
        print(sequence_verdict(rows, fallbacks) + "\n")
        print(
            f"time: preparation {prepared - start:.0f} s, part 1 {compared - prepared:.0f} s, "
            f"part 2 {done - compared:.0f} s\n"
        )
        results[name] = {
            "description": w.description,
            "brute_force": brutes,
            "comparisons": comparisons,
            "sequence": rows,
            "fallbacks": fallbacks,
            "seconds": {"prepare": prepared - start, "part1": compared - prepared, "part2": done - compared},
        }

    plot(results, args.sequence_threshold, PLOT_PATH)
    print(f"plot: {PLOT_PATH}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "cpus": os.cpu_count(),
            "thresholds": thresholds,
            "sequence_threshold": args.sequence_threshold,
            "gpt2_eval_batches": args.gpt2_eval_batches,
            "gpt2_grad_batches": args.gpt2_grad_batches,
            "models": {
                name: {
                    **{k: v for k, v in res.items() if k not in ("brute_force", "comparisons", "sequence")},
                    "brute_force": [
                        {
                            "checkpoint": b.checkpoint,
                            "step": b.step,
                            "baseline": b.baseline,
                            "seconds": b.seconds,
                            "points": [
                                {**config_dict(p.config), "degradation": p.degradation, "bits": p.bits}
                                for p in b.points
                            ],
                        }
                        for b in res["brute_force"]
                    ],
                    "comparisons": [asdict(c) for c in res["comparisons"]],
                    "sequence": [
                        {**asdict(r), "ratio": r.ratio, "lossless_ratio": r.lossless_ratio} for r in res["sequence"]
                    ],
                }
                for name, res in results.items()
            },
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
