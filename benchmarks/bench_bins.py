"""Bins needed for a given quality: DynaQuant against min-max uniform quantization (the paper's
Table 4 and section 9.3.1).

Run it with::

    python benchmarks/bench_bins.py            # options: --protect P (default 0.005), --every N,
                                               # --retrain, --json PATH

The checkpoints are the ten of the small GPT-2 run of ``benchmarks/_gpt2_run.py`` (trained on
the first use, then cached in ``benchmarks/out/gpt2_run/``); quality is the mean next-character
loss on its 20 held-out batches, and the degradation of a quantized checkpoint is
``(loss_q - loss) / loss`` against the same checkpoint's fp32 weights on the same batches.

Both methods quantize the same tensors, the floating ones with at least 2 dimensions and 4,096
elements (``is_quantizable`` under the default ``min_numel``: the token and position embeddings,
tied to the LM head, and every attention and MLP matrix); every other tensor keeps its fp32
values. The script checks that exactly these tensors change under both methods.

* **DynaQuant**: ``compress_state_dict`` into a scratch store with ``QuantConfig(bins=K,
  embedding_bins=K, prune=0, protect=P)`` and decoded back with ``load_section("model")``: K
  approximate-K-means centres per tensor (for the embeddings too, so that every quantized tensor
  has K levels as under uniform), no pruning (as in the paper's experiment), and the top ``P`` of
  the values by magnitude kept as bfloat16 (``P`` = 0.005 is the package's default; ``--protect
  0`` gives plain K-means levels).
* **uniform**: per tensor, K evenly spaced levels from the tensor's minimum to its maximum,
  each value rounded to the nearest (implemented here).

K runs over 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 254 (DynaQuant's codes allow at
most 254 centres), and 256 too for uniform. For each checkpoint and method the script finds the
smallest K whose degradation is at most 0.1%, 1% and 5% (scanning K upwards until the strictest
is met), then prints the median (and the paper's mean) over the checkpoints. The bar, from the
paper (uniform needs 2-4x the bins): DynaQuant needs at least 2x fewer bins than uniform at each
threshold, on the medians. The degradation of every K on the last checkpoint is plotted to
``benchmarks/out/bins_vs_uniform.png``; ``--json`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from _gpt2_run import GPT2Run, StateDict, add_arguments, describe, get_run
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hf_dynaquant import CheckpointStore
from hf_dynaquant.core.quantizer import QuantConfig, is_quantizable
from hf_dynaquant.pipeline import MODEL, compress_state_dict

PLOT_PATH = Path(__file__).resolve().parent / "out" / "bins_vs_uniform.png"
BINS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 254)
UNIFORM_BINS = (*BINS, 256)
THRESHOLDS = (0.001, 0.01, 0.05)
BAR = 2.0  # uniform must need at least this many times DynaQuant's bins
DYNAQUANT, UNIFORM = "DynaQuant", "uniform"

Quantizer = Callable[[StateDict, int], StateDict]


def uniform_quantize(state: StateDict, k: int) -> StateDict:
    """Every quantizable tensor on ``k`` evenly spaced levels between its min and max (nearest);
    tensors shared under two names (tied weights) stay shared."""
    config = QuantConfig()
    done: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        if not is_quantizable(t, config):
            out[name] = t
            continue
        if id(t) not in done:
            lo, hi = t.min(), t.max()
            step = (hi - lo) / (k - 1)
            done[id(t)] = t if step == 0 else lo + torch.round((t - lo) / step) * step
        out[name] = done[id(t)]
    return out


def dynaquant_quantizer(run: GPT2Run, protect: float) -> Quantizer:
    """Quantize-then-decode through a scratch store, ``k`` centres for every quantized tensor."""
    types = run.layer_types()

    def quantize(state: StateDict, k: int) -> StateDict:
        config = QuantConfig(bins=k, embedding_bins=k, prune=0.0, protect=protect)
        with tempfile.TemporaryDirectory() as tmp:
            store = CheckpointStore(tmp)
            entry = compress_state_dict(store, state, config, types=types)
            with store.open(entry) as reader:
                return reader.load_section(MODEL)

    return quantize


@dataclass
class Search:
    """One method on one checkpoint: degradation per K tried, smallest K per threshold."""

    degradation: dict[int, float] = field(default_factory=dict)
    needed: dict[float, int | None] = field(default_factory=dict)  # None: no K met it
    seconds: float = 0.0


def search(run: GPT2Run, state: StateDict, quantize: Quantizer, bins: tuple[int, ...], full: bool) -> Search:
    """Degradation for increasing K until every threshold is met (or all K, with ``full``)."""
    result = Search(needed=dict.fromkeys(THRESHOLDS))
    start = time.perf_counter()
    loss = run.eval_loss(state)
    expected = {n for n, t in state.items() if is_quantizable(t, QuantConfig())}
    for k in bins:
        quantized = quantize(state, k)
        changed = {n for n, t in state.items() if not torch.equal(quantized[n], t)}
        if changed != expected:
            raise AssertionError(f"K={k} changed {sorted(changed ^ expected)} contrary to the quantizable set")
        result.degradation[k] = (run.eval_loss(quantized) - loss) / loss
        for threshold in THRESHOLDS:
            if result.needed[threshold] is None and result.degradation[k] <= threshold:
                result.needed[threshold] = k
        if not full and None not in result.needed.values():
            break
    result.seconds = time.perf_counter() - start
    return result


def _median(values: list[int | None]) -> float:
    """Median with "not met" as infinitely many bins."""
    return statistics.median(math.inf if v is None else v for v in values)


def _mean(values: list[int | None]) -> float:
    return math.inf if None in values else statistics.fmean(values)


def _fmt(value: float | int | None, ceiling: int) -> str:
    if value is None or value == math.inf:
        return f">{ceiling}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def summarize(results: dict[str, list[Search]]) -> list[dict[str, float | bool]]:
    rows = []
    for threshold in THRESHOLDS:
        dq = [s.needed[threshold] for s in results[DYNAQUANT]]
        un = [s.needed[threshold] for s in results[UNIFORM]]
        dq_median, un_median = _median(dq), _median(un)
        # uniform "not met" is a lower bound (> 256), which still counts towards the bar
        un_floor = UNIFORM_BINS[-1] + 1 if un_median == math.inf else un_median
        ratio = un_floor / dq_median
        rows.append(
            {
                "threshold": threshold,
                "dynaquant_median": dq_median,
                "uniform_median": un_median,
                "ratio": ratio,
                "ratio_is_lower_bound": un_median == math.inf,
                "dynaquant_mean": _mean(dq),
                "uniform_mean": _mean(un),
                "passed": ratio >= BAR,
            }
        )
    return rows


def markdown_tables(run: GPT2Run, picked: list[int], results: dict[str, list[Search]], rows: list[dict]) -> str:
    pct = [f"{t:.1%}" for t in THRESHOLDS]
    lines = [
        "| degradation <= | median bins DynaQuant | median bins uniform | ratio uniform / DynaQuant | "
        f"mean bins DynaQuant | mean bins uniform | bar (ratio >= {BAR:g}) |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for label, row in zip(pct, rows):
        ratio = f"{'>' if row['ratio_is_lower_bound'] else ''}{row['ratio']:.2f}"
        lines.append(
            f"| {label} | {_fmt(row['dynaquant_median'], BINS[-1])} | {_fmt(row['uniform_median'], UNIFORM_BINS[-1])} "
            f"| {ratio} | {_fmt(row['dynaquant_mean'], BINS[-1])} | {_fmt(row['uniform_mean'], UNIFORM_BINS[-1])} "
            f"| {'PASS' if row['passed'] else 'FAIL'} |"
        )
    lines += [
        "",
        "| ckpt | step | fp32 loss | "
        + " | ".join(f"DynaQuant bins @{p}" for p in pct)
        + " | "
        + " | ".join(f"uniform bins @{p}" for p in pct)
        + " | seconds (DQ / uniform) |",
        "|---:|---:|---:|" + "---:|" * (2 * len(THRESHOLDS)) + "---:|",
    ]
    for j, i in enumerate(picked):
        dq, un = results[DYNAQUANT][j], results[UNIFORM][j]
        ckpt = run.checkpoints[i]
        lines.append(
            f"| {i} | {ckpt.step} | {ckpt.eval_loss:.4f} | "
            + " | ".join(_fmt(dq.needed[t], BINS[-1]) for t in THRESHOLDS)
            + " | "
            + " | ".join(_fmt(un.needed[t], UNIFORM_BINS[-1]) for t in THRESHOLDS)
            + f" | {dq.seconds:.0f} / {un.seconds:.0f} |"
        )
    return "\n".join(lines)


def plot(run: GPT2Run, last: dict[str, Search], protect: float, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for (method, s), style in zip(last.items(), ("o-", "s-")):
        ax.plot(list(s.degradation), [100 * d for d in s.degradation.values()], style, label=method)
    for threshold in THRESHOLDS:
        ax.axhline(100 * threshold, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_ylim(bottom=-0.01)  # a K past the last threshold can come out marginally better than fp32
    ax.set_xticks(BINS, [*map(str, BINS[:-1]), f"{BINS[-1]}/{UNIFORM_BINS[-1]}"], fontsize=7)
    ax.set_xlabel("bins (levels per tensor)")
    ax.set_ylabel("held-out loss degradation, % (symlog)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    ckpt = run.checkpoints[-1]
    ax.set_title(
        f"GPT-2 {run.parameters / 1e6:.2f} M params, step {ckpt.step} (loss {ckpt.eval_loss:.3f}); "
        f"DynaQuant prune=0, protect={protect:g}; dotted: 0.1%, 1%, 5%",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument(
        "--protect", type=float, default=QuantConfig().protect, help="DynaQuant's protected fraction (default 0.005)"
    )
    parser.add_argument(
        "--every", type=int, default=1, help="use every N-th checkpoint, ending at the last (default 1)"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers to PATH as JSON")
    args = parser.parse_args()
    if args.every < 1:
        parser.error("--every must be at least 1")

    started = time.perf_counter()
    run = get_run(args.retrain)
    last = len(run.checkpoints) - 1
    picked = list(range(last, -1, -args.every))[::-1]
    methods: dict[str, tuple[Quantizer, tuple[int, ...]]] = {
        DYNAQUANT: (dynaquant_quantizer(run, args.protect), BINS),
        UNIFORM: (uniform_quantize, UNIFORM_BINS),
    }
    results: dict[str, list[Search]] = {m: [] for m in methods}
    for i in picked:
        for method, (quantize, bins) in methods.items():
            results[method].append(search(run, run.checkpoints[i].state, quantize, bins, full=i == last))
    rows = summarize(results)

    print(describe(run))
    print(
        f"\nCheckpoints {picked}; DynaQuant: QuantConfig(bins=K, embedding_bins=K, prune=0, protect={args.protect:g}) "
        f"through a store and back; uniform: K min-max levels per tensor. {os.cpu_count()} CPUs.\n"
    )
    print(markdown_tables(run, picked, results, rows))
    print()
    for label, row in zip([f"{t:.1%}" for t in THRESHOLDS], rows):
        print(
            f"Bar at {label}: uniform needs {'>' if row['ratio_is_lower_bound'] else ''}{row['ratio']:.2f}x "
            f"DynaQuant's bins (>= {BAR:g}x) -> {'PASS' if row['passed'] else 'FAIL'}"
        )
    plot(run, {m: results[m][-1] for m in methods}, args.protect, PLOT_PATH)
    print(f"\nplot: {PLOT_PATH}")
    print(f"total time: {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "protect": args.protect,
            "run": {"parameters": run.parameters, "settings": asdict(run.settings), "cached": run.cached},
            "checkpoints": picked,
            "thresholds": list(THRESHOLDS),
            "summary": [{k: None if v == math.inf else v for k, v in row.items()} for row in rows],  # None: > max K
            "searches": {m: [asdict(s) for s in results[m]] for m in methods},
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
