"""What a restore costs along a delta chain, against torch.load, and what ``keyframe_every`` trades.

Run it with::

    OMP_NUM_THREADS=2 python benchmarks/bench_chain.py
    # options: --size 7M|45M|124M|350M --entries 10 --dtype bfloat16 --restore-depth 3 --json PATH --plot PATH

``bench_scale`` restores the first delta of a chain. A run resumes from its latest checkpoint,
which with the default ``keyframe_every=10`` follows up to nine deltas: each one is decoded in
turn, since a delta holds the change of each weight's level from the checkpoint before it. Here
a GPT-2 built from its config (bench_scale's sizes, setup and fixed configuration: bins 8,
prune 0.1, protect 0.005, AdamW state compressed) is checkpointed every two training steps
``--entries`` times, one chain (a keyframe, then deltas), and every entry is restored into a
fresh model and optimizer, timed, with its peak extra host memory. ``--restore-depth D`` sets
``restore_depth``: a delta that would make a restore replay more than D is coded on the
keyframe instead (an anchor). In the same process and on
the same disk: ``torch.save`` of the last state and ``torch.load`` of it (the median of three,
then ``load_state_dict``, as a resume does).

Prints one row per entry and, derived from them, what each ``keyframe_every`` costs: the mean
bytes stored per checkpoint (a keyframe, then ``keyframe_every - 1`` deltas) against the mean
and the slowest restore; writes ``benchmarks/out/chain.png``. Each restore is timed once, in
chain order (its CPU seconds, printed beside, move less with the machine's speed); the chain
starts at the first step of a randomly initialised model, whose early deltas are the largest,
so the bytes of short chains are overstated against a run in its steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
from transformers import GPT2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import CONFIG, OUT, SIZES, disk_mb, flat, fresh, measure, torch_restore, train_step  # noqa: E402

from hf_dynaquant import Compressor  # noqa: E402


def timed_torch_load(pt: Path, config: GPT2Config, dtype: torch.dtype) -> float:
    """Seconds of ``torch.load`` and ``load_state_dict`` into a fresh model and optimizer (made
    before the timing, as a restore's are)."""
    into, into_optimizer = fresh(config, dtype)
    return measure(partial(torch_restore, pt, into, into_optimizer))[0]


def timed_restore(store: Path, step: int, config: GPT2Config, dtype: torch.dtype) -> tuple[float, int, float]:
    """``(seconds, peak extra bytes, CPU seconds)`` of restoring ``step`` into a fresh model and
    optimizer."""
    model, optimizer = fresh(config, dtype)
    reader = Compressor(model, store, optimizer=optimizer)
    seconds, extra, _, cpu = measure(lambda: reader.restore(step))
    return seconds, extra, cpu


def chain(size: str, entries: int, folder: Path, dtype: torch.dtype, restore_depth: int | None = None) -> dict:
    """The chain's figures: per entry, its save's seconds, bytes, the deltas its restore replays,
    and the restore's seconds and peak."""
    config = GPT2Config(**SIZES[size])
    torch.manual_seed(0)
    model, optimizer = fresh(config, dtype)
    train_step(model, optimizer, 0)
    checkpoint = sum(t.numel() * t.element_size() for t in flat(model, optimizer).values())
    store = folder / "dynaquant"
    compressor = Compressor(
        model, store, CONFIG, optimizer=optimizer, keyframe_every=entries, restore_depth=restore_depth
    )
    steps, saves, sizes, depths = [], [], [], []
    for i in range(entries):
        step = 1 + 2 * i
        if i:
            train_step(model, optimizer, step - 1)
            train_step(model, optimizer, step)
        before = disk_mb(store) if store.exists() else 0.0
        seconds = measure(partial(compressor.compress, step))[0]
        steps.append(step)
        saves.append(seconds)
        sizes.append(disk_mb(store) - before)
        depths.append(len(compressor.store.chain(f"step-{step}")) - 1)
        print(f"  save {i} (step {step}): {seconds:.2f} s, {sizes[-1]:.1f} MB, {depths[-1]} deltas deep", flush=True)
    pt = folder / "plain.pt"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    save_seconds = measure(partial(torch.save, state, pt))[0]
    loads = [timed_torch_load(pt, config, dtype) for _ in range(3)]
    load = statistics.median(loads)
    runs = ", ".join(f"{t:.2f}" for t in loads)
    print(f"  torch.save {save_seconds:.2f} s; torch.load {load:.2f} s (median of {runs})")
    restores, peaks, cpus = [], [], []
    for i, step in enumerate(steps):
        seconds, extra, cpu = timed_restore(store, step, config, dtype)
        restores.append(seconds)
        peaks.append(extra / checkpoint)
        cpus.append(cpu)
        print(
            f"  restore {i} ({depths[i]} deltas replayed): {seconds:.2f} s (CPU {cpu:.2f} s), "
            f"{seconds / load:.2f}x torch.load, peak extra {peaks[-1]:.2f}x",
            flush=True,
        )
    return {
        "size": size, "dtype": str(dtype)[6:], "checkpoint_mb": checkpoint / 1e6, "torch_save": save_seconds,
        "torch_load": load, "save": saves, "stored_mb": sizes, "restore": restores, "restore_cpu": cpus, "peak": peaks,
        "restore_depth": restore_depth, "depth": depths,
    }  # fmt: skip


def trade(r: dict) -> list[tuple[int, float, float, float]]:
    """``(keyframe_every, mean MB a checkpoint, mean restore s, slowest restore s)`` for every
    chain length the measured one holds: a chain of K is its first K entries."""
    rows = []
    for k in range(1, len(r["restore"]) + 1):
        rows.append((k, statistics.mean(r["stored_mb"][:k]), statistics.mean(r["restore"][:k]), max(r["restore"][:k])))
    return rows


def report(r: dict) -> str:
    load = r["torch_load"]
    depth = r.get("restore_depth")
    lines = [
        f"{r['size']} {r['dtype']}: checkpoint {r['checkpoint_mb']:.0f} MB; torch.save {r['torch_save']:.2f} s, "
        f"torch.load {load:.2f} s; restore_depth {depth}",
        "",
        "| entry | deltas replayed | stored | save | restore (CPU) | restore / torch.load | peak extra |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i in range(len(r["restore"])):
        lines.append(
            f"| {i} | {r['depth'][i]} | {r['stored_mb'][i]:.1f} MB | {r['save'][i]:.2f} s | {r['restore'][i]:.2f} s "
            f"({r['restore_cpu'][i]:.2f} s) | {r['restore'][i] / load:.2f}x | {r['peak'][i]:.2f}x |"
        )
    lines += [
        "",
        "| keyframe_every | mean stored a checkpoint | whole-checkpoint ratio | mean restore | slowest restore |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, mb, mean_s, worst in trade(r):
        lines.append(
            f"| {k} | {mb:.1f} MB | {r['checkpoint_mb'] / mb:.1f}x | {mean_s:.2f} s ({mean_s / load:.2f}x) | "
            f"{worst:.2f} s ({worst / load:.2f}x) |"
        )
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    times, trades = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    x = list(range(len(r["restore"])))
    times.plot(x, r["restore"], "r-o", label="restore")
    times.axhline(r["torch_load"], color="k", ls=":", label="torch.load")
    times.axhline(2 * r["torch_load"], color="grey", ls="--", lw=0.8, label="2x torch.load")
    times.set_xlabel("entry in the chain")
    times.set_ylabel("seconds")
    times.set_title(f"restore along a chain, {r['size']} {r['dtype']}, restore_depth {r.get('restore_depth')}")
    rows = trade(r)
    trades.plot([mb for _, mb, _, _ in rows], [s for _, _, s, _ in rows], "b-o", label="mean restore")
    trades.plot([mb for _, mb, _, _ in rows], [w for _, _, _, w in rows], "m-o", label="slowest restore")
    for k, mb, mean_s, _ in rows:
        trades.annotate(str(k), (mb, mean_s), textcoords="offset points", xytext=(4, -10), fontsize=7)
    trades.set_xlabel("mean MB stored a checkpoint (labels: keyframe_every)")
    trades.set_ylabel("seconds")
    trades.set_title("what keyframe_every trades")
    for ax in (times, trades):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="124M", choices=list(SIZES))
    parser.add_argument("--entries", type=int, default=10, help="checkpoints in the chain (the keyframe's included)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and moments")
    parser.add_argument("--restore-depth", type=int, help="restore_depth (default none: each delta on the one before)")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--plot", type=Path, default=OUT / "chain.png")
    args = parser.parse_args()
    if args.entries < 1:
        parser.error("--entries must be at least 1")
    if args.restore_depth is not None and args.restore_depth < 1:
        parser.error("--restore-depth must be at least 1")
    for path in (args.json, args.plot):  # (checked before minutes of work, not after)
        if path is not None and not path.resolve().parent.is_dir():
            parser.error(f"{path}: its folder does not exist")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(dir=OUT if OUT.exists() else None) as tmp:
        r = chain(args.size, args.entries, Path(tmp), getattr(torch, args.dtype), args.restore_depth)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(report(r))
    plot(r, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
