"""Delta coding variants over a real training run (the paper's section 6 and Fig. 11).

Run it with::

    python benchmarks/bench_delta.py            # options: --retrain, --json PATH

The checkpoints are the ten of the small GPT-2 run of ``benchmarks/_gpt2_run.py`` (trained on
the first use, then cached in ``benchmarks/out/gpt2_run/``). Each checkpoint is written with
``compress_state_dict`` under ``QuantConfig(bins=16, prune=0.2, protect=0.005)`` into one
:class:`~hf_dynaquant.CheckpointStore` per variant, as a delta on the previous checkpoint of the
same store (the first is a keyframe: it has no base). The variants differ only in how the cyclic
delta of the codes is coded:

* **HE** (``delta_coding="entropy"``): the delta bytes straight into zstd (Huffman stage);
* **RLE** (``"rle"``): run-length tokens of the delta (negated values, lengths only for runs
  longer than one), LEB128 varints, zstd;
* **PE** (``"regroup"``, the paper's): the delta regrouped by the previous checkpoint's code
  before the run-length coding;
* **PE + rANS** (``"ans"``, our default): the delta regrouped the same way, each group
  (previous code) coded by order-0 rANS with its own histogram instead of RLE + zstd.

The coding also decides the keyframe (checkpoint 0): rANS under ``ans``, zstd under the
paper's three, as the codec does.

For reference, a fifth store holds every checkpoint as a keyframe (quantized, no delta). The
codec falls back to a keyframe for any tensor whose delta would be larger, so the "delta
tensors" column counts the quantized tensors that were actually delta-coded.

Sizes are what :meth:`CheckpointStore.info` reports: ``raw_nbytes`` (every tensor uncompressed,
the tied ``lm_head.weight`` once) and ``nbytes`` (the entry's files on disk: manifest and
payload). The overall ratio is the sum of raw bytes over the sum of stored bytes. Every
checkpoint is then restored from each store (``load_section("model")``, replaying the chain to
the keyframe); the restores must be identical across the stores, since all quantize the same
way, and the script fails if they are not. The held-out loss of the restored checkpoint is
shown next to the original's. Prints markdown tables, writes ``benchmarks/out/delta_variants.png``
and, with ``--json``, the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from _gpt2_run import GPT2Run, StateDict, add_arguments, describe, get_run
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hf_dynaquant import CheckpointStore
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.pipeline import MODEL, compress_state_dict

PLOT_PATH = Path(__file__).resolve().parent / "out" / "delta_variants.png"
CONFIG = QuantConfig(bins=16, prune=0.2, protect=0.005)
KEYFRAMES = "keyframes"  # the reference store: no deltas
VARIANTS = {  # delta_coding -> label (the paper's Fig. 11 names)
    "entropy": "HE: entropy only",
    "rle": "RLE: run-length + entropy",
    "regroup": "PE: regrouped + RLE + entropy",
    "ans": "PE + rANS: regrouped, rANS per group (default)",
    KEYFRAMES: "keyframes only (no delta)",
}
DELTAS = ("entropy", "rle", "regroup", "ans")  # the bar: each beats the one before it


@dataclass
class Variant:
    """One store's numbers, per checkpoint."""

    coding: str
    label: str
    raw_nbytes: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    delta_tensors: list[int] = field(default_factory=list)  # quantized tensors stored as deltas
    quantized_tensors: list[int] = field(default_factory=list)
    write_s: float = 0.0
    restore_s: float = 0.0

    @property
    def ratios(self) -> list[float]:
        return [r / n for r, n in zip(self.raw_nbytes, self.nbytes)]

    @property
    def overall(self) -> float:
        return sum(self.raw_nbytes) / sum(self.nbytes)


def write_variant(store: CheckpointStore, run: GPT2Run, coding: str) -> Variant:
    """Write every checkpoint of the run, each a delta on the previous (except for ``keyframes``)."""
    variant = Variant(coding, VARIANTS[coding])
    types = run.layer_types()
    prev = None
    for i, ckpt in enumerate(run.checkpoints):
        start = time.perf_counter()
        entry = compress_state_dict(
            store,
            ckpt.state,
            CONFIG,
            types=types,
            base=None if coding == KEYFRAMES else prev,
            ref=f"ckpt-{i}",
            delta_coding="ans" if coding == KEYFRAMES else coding,  # the default codec's keyframes
        )
        variant.write_s += time.perf_counter() - start
        prev = entry
        info = store.info(entry)
        if (info.base is None) != (i == 0 or coding == KEYFRAMES):
            raise AssertionError(f"{coding} ckpt-{i}: base {info.base} is not what was asked for")
        variant.raw_nbytes.append(info.raw_nbytes)
        variant.nbytes.append(info.nbytes)
        with store.open(entry) as reader:
            modes = [rec["params"]["mode"] for _, _, rec in reader.tensor_records() if rec.get("codec") == "dynaquant"]
        variant.delta_tensors.append(modes.count("delta"))
        variant.quantized_tensors.append(len(modes))
    return variant


def restore(store: CheckpointStore, i: int) -> StateDict:
    with store.open(f"ckpt-{i}") as reader:
        return reader.load_section(MODEL)


def check_restores(stores: dict[str, CheckpointStore], variants: dict[str, Variant], n: int) -> list[StateDict]:
    """Restore every checkpoint from every store; all stores must decode identical tensors.
    Returns the restored checkpoints (from the first store)."""
    restored = []
    for i in range(n):
        states = {}
        for coding, store in stores.items():
            start = time.perf_counter()
            states[coding] = restore(store, i)
            variants[coding].restore_s += time.perf_counter() - start
        (first, reference), *others = states.items()
        for coding, state in others:
            if state.keys() != reference.keys():
                raise AssertionError(f"ckpt-{i}: {coding} restores other tensors than {first}")
            for name, tensor in reference.items():
                if not torch.equal(state[name], tensor):
                    raise AssertionError(f"ckpt-{i}: {name} differs between the {first} and {coding} restores")
        restored.append(reference)
    return restored


def markdown_tables(run: GPT2Run, variants: dict[str, Variant], restored_loss: list[float]) -> str:
    codings = list(variants)
    head = " | ".join(f"{VARIANTS[c]} ratio" for c in codings)
    lines = [
        f"| ckpt | step | raw bytes | {head} | delta tensors (HE / RLE / PE / PE + rANS) "
        "| held-out loss: fp32 -> restored |",
        "|---:|---:|---:|" + "---:|" * len(codings) + ":---:|---|",
    ]
    for i, ckpt in enumerate(run.checkpoints):
        ratios = " | ".join(f"{variants[c].ratios[i]:.2f}" for c in codings)
        deltas = " / ".join(str(variants[c].delta_tensors[i]) for c in DELTAS)
        total = variants[DELTAS[0]].quantized_tensors[i]
        lines.append(
            f"| {i} | {ckpt.step} | {variants[codings[0]].raw_nbytes[i]:,} | {ratios} | {deltas} of {total} | "
            f"{ckpt.eval_loss:.4f} -> {restored_loss[i]:.4f} |"
        )
    lines += [
        "",
        "| variant | stored bytes (all checkpoints) | overall ratio | ratio, deltas only (ckpt 1-9) | "
        "write s | restore s (every ckpt, chain replayed) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in variants.values():
        later = sum(v.raw_nbytes[1:]) / sum(v.nbytes[1:])
        lines.append(
            f"| {v.label} | {sum(v.nbytes):,} | {v.overall:.2f} | {later:.2f} | {v.write_s:.1f} | {v.restore_s:.1f} |"
        )
    return "\n".join(lines)


def plot(run: GPT2Run, variants: dict[str, Variant], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [c.step for c in run.checkpoints]
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    styles = {"entropy": "o-", "rle": "s-", "regroup": "^-", "ans": "D-", KEYFRAMES: "x--"}
    for coding, v in variants.items():
        ax.plot(steps, v.ratios, styles[coding], label=f"{v.label} (overall {v.overall:.2f})")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("training step of the checkpoint")
    ax.set_ylabel("compression ratio (raw / stored)")
    ax.set_xticks(steps)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"Delta coding, GPT-2 {run.parameters / 1e6:.2f} M params, bins={CONFIG.bins}, prune={CONFIG.prune}, "
        f"protect={CONFIG.protect}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers to PATH as JSON")
    args = parser.parse_args()

    started = time.perf_counter()
    run = get_run(args.retrain)
    with tempfile.TemporaryDirectory() as tmp:
        stores = {c: CheckpointStore(Path(tmp) / c) for c in VARIANTS}
        variants = {c: write_variant(stores[c], run, c) for c in VARIANTS}
        restored = check_restores(stores, variants, len(run.checkpoints))
    restored_loss = [run.eval_loss(state) for state in restored]

    print(describe(run))
    print(
        f"\nQuantConfig(bins={CONFIG.bins}, prune={CONFIG.prune}, protect={CONFIG.protect}; embedding_bins="
        f"{CONFIG.embedding_bins}, min_numel={CONFIG.min_numel}); ckpt 0 is a keyframe in every store. "
        f"{os.cpu_count()} CPUs.\n"
    )
    print(markdown_tables(run, variants, restored_loss))
    print("\nRestores: every checkpoint decodes to identical tensors from all five stores (asserted).")

    overall = {c: variants[c].overall for c in DELTAS}
    passed = overall["ans"] > overall["regroup"] > overall["rle"] > overall["entropy"]
    print(
        f"\nBar: overall ratio PE+rANS > PE > RLE > HE: {overall['ans']:.2f} > {overall['regroup']:.2f} > "
        f"{overall['rle']:.2f} > {overall['entropy']:.2f} -> {'PASS' if passed else 'FAIL'}"
    )
    plot(run, variants, PLOT_PATH)
    print(f"\nplot: {PLOT_PATH}")
    print(f"total time: {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "quant_config": CONFIG.to_dict(),
            "run": {"parameters": run.parameters, "settings": asdict(run.settings), "cached": run.cached},
            "steps": [c.step for c in run.checkpoints],
            "eval_loss": [c.eval_loss for c in run.checkpoints],
            "restored_eval_loss": restored_loss,
            "variants": {c: {**asdict(v), "ratios": v.ratios, "overall": v.overall} for c, v in variants.items()},
            "bar_passed": passed,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
