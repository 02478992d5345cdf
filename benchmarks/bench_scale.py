"""Compressed saves and restores at real scale, against torch.save / torch.load and safetensors.

Run it with::

    OMP_NUM_THREADS=2 python benchmarks/bench_scale.py
    # options: --sizes 7M,45M,124M,350M --dtype bfloat16 --repeat 3 --json PATH

For each size, a GPT-2 built from its config (no download; random init) takes one AdamW step
on random tokens, so the optimizer holds both Adam moments. The checkpoint is the weights plus
the optimizer state (fp32, 3x the weights' bytes). In the same process, on the same disk:

* **torch.save** of ``{"model": state_dict, "optimizer": optimizer.state_dict()}`` and
  **torch.load** of it (``weights_only=True``, then ``load_state_dict`` into a model and an
  optimizer: what a resume does); the same with **safetensors** (every tensor flattened into one
  file, the tied head once);
* our **keyframe** (``Compressor.compress`` with the fixed configuration of the issue: bins 8,
  prune 0.1, protect 0.005, optimizer state compressed), two more training steps, then a
  **delta** on it, and a **restore** of the delta into a fresh model and optimizer (decoding the
  chain: the keyframe, then the delta); then one training step of the restored model and the
  **save after resume** (the chain continued as the Trainer's callback continues it: a delta on
  the restored entry, rounded stochastically as every save after a resume is).

Every operation is timed and its **peak extra host memory** measured: the peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``) above the resident set before it, in units
of the checkpoint's bytes. ``--dtype bfloat16`` does the same for a model trained in pure bf16
(weights and moments stored in bf16). The restored weights' and Adam update's relative L2 error
are printed (the model is random, so no loss is meaningful here; the fidelity that matters, the
user's metric after restores, is measured on real fine-tunes in bench_trainer / bench_finetune).
Prints a markdown table (and each operation's CPU seconds) and the growth exponent of each time
with size (1.0 is linear), and writes ``benchmarks/out/scale.png``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from hf_dynaquant import Compressor, QuantConfig

OUT = Path(__file__).resolve().parent / "out"

# GPT-2 shapes by parameter count (vocabulary 50257, context 1024): the four sizes
SIZES = {
    "7M": dict(n_layer=2, n_embd=128, n_head=4),
    "45M": dict(n_layer=6, n_embd=512, n_head=8),
    "124M": dict(n_layer=12, n_embd=768, n_head=12),
    "350M": dict(n_layer=24, n_embd=1024, n_head=16),
}
CONFIG = QuantConfig(bins=8, prune=0.1, protect=0.005)

_libc = ctypes.CDLL("libc.so.6")


def _rss() -> tuple[int, int]:
    """(current, peak) resident set in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process so far, every thread's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(fn: Callable[[], object]) -> tuple[float, int, object, float]:
    """(seconds, peak extra resident bytes, result, CPU seconds) of ``fn()``. The CPU seconds
    (every thread's, user and system) move less between identical runs on a shared machine than
    the wall time does, so they show a change in the work done that the wall time hides. The
    dirty pages an earlier measurement left are flushed first (``torch.save`` and safetensors
    write 1.5 GB at 124M to the page cache and return before the disk has it): their writeback,
    on this machine's two cores, would be charged to whatever is timed next, not to them."""
    os.sync()
    gc.collect()
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before, _ = _rss()
    cpu = _cpu_seconds()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    return seconds, _rss()[1] - before, result, _cpu_seconds() - cpu


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fresh(config: GPT2Config, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A GPT-2 in ``dtype`` (bfloat16: weights and Adam moments stored in bf16, as pure-bf16
    training keeps them) and its AdamW."""
    model = GPT2LMHeadModel(config).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def relative_error(restored: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> float:
    """``||restored - original|| / ||original||`` over every floating tensor of a state."""
    num = den = 0.0
    for name, t in original.items():
        if t.is_floating_point():
            num += float((restored[name].double() - t.double()).square().sum())
            den += float(t.double().square().sum())
    return (num / den) ** 0.5


def flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights (tied head once) and optimizer moments as one flat dict, for safetensors."""
    out = {f"model.{n}": t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    for pid, state in optimizer.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def unflat(tensors: dict[str, torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.load_state_dict({n[6:]: t for n, t in tensors.items() if n.startswith("model.")}, strict=False)
    sd = optimizer.state_dict()
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, pid, key = name.split(".", 2)
            sd["state"].setdefault(int(pid), {})[key] = t
    optimizer.load_state_dict(sd)


@dataclass
class Row:
    size: str
    params: int
    checkpoint_mb: float
    seconds: dict[str, float]
    peak_extra: dict[str, float]  # in checkpoints
    stored_mb: dict[str, float]
    dtype: str = "float32"
    weights_error: float = 0.0  # relative L2 error of the restored weights
    update_error: float = 0.0  # relative L2 error of the restored Adam update m / (sqrt(v) + eps)
    search: dict[str, float] | None = None  # with --search: seconds, evaluations, peak extra memory
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # each operation's, every thread's


def disk_mb(path: Path) -> float:
    """MB a file holds, or every file under a folder."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6
    return path.stat().st_size / 1e6


def torch_restore(pt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a plain resume does: ``torch.load`` (``weights_only``), then ``load_state_dict``."""
    sd = torch.load(pt, weights_only=True)
    model.load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optimizer"])


def plain(
    config: GPT2Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    record: Callable[..., object],
    dtype: torch.dtype,
) -> None:
    """The plain saves and restores: torch.save / torch.load and safetensors."""
    pt = folder / "plain.pt"
    record("torch.save", lambda: torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, pt), pt)
    into, into_optimizer = fresh(config, dtype)
    record("torch.load", lambda: torch_restore(pt, into, into_optimizer))
    st = folder / "plain.safetensors"
    record("safetensors save", lambda: save_file(flat(model, optimizer), st), st)
    record("safetensors load", lambda: unflat(load_file(st), into, into_optimizer))


def bench(size: str, folder: Path, dtype: torch.dtype = torch.float32) -> Row:
    config = GPT2Config(**SIZES[size])
    torch.manual_seed(0)
    model, optimizer = fresh(config, dtype)
    train_step(model, optimizer, 0)
    params = sum(p.numel() for p in model.parameters())
    ckpt = sum(t.numel() * t.element_size() for t in flat(model, optimizer).values())
    seconds, peak, stored, cpu = {}, {}, {}, {}

    def record(name: str, fn: Callable[[], object], path: Path | None = None) -> object:
        seconds[name], extra, result, cpu[name] = measure(fn)
        peak[name] = extra / ckpt
        if path is not None:
            stored[name] = disk_mb(path)
        line = f"  {size} {name}: {seconds[name]:.2f} s (CPU {cpu[name]:.2f} s), peak extra {peak[name]:.2f}x"
        print(line, flush=True)
        return result

    plain(config, model, optimizer, folder, record, dtype)
    store = folder / "dynaquant"
    compressor = Compressor(model, store, CONFIG, optimizer=optimizer)
    record("keyframe", lambda: compressor.compress(1), store)
    key_mb = stored["keyframe"]
    train_step(model, optimizer, 1)
    train_step(model, optimizer, 2)
    record("delta", lambda: compressor.compress(3), store)
    stored["delta"] -= key_mb
    m3, o3 = fresh(config, dtype)
    reader = Compressor(m3, store, CONFIG, optimizer=o3)  # (its save after the resume keeps the run's configuration)
    record("restore", lambda: reader.restore(3))
    weights_error = relative_error(m3.state_dict(), model.state_dict())
    restored, original = (
        {str(pid): _update(st) for pid, st in o.state_dict()["state"].items()} for o in (o3, optimizer)
    )
    update_error = relative_error(restored, original)
    name = str(dtype)[6:]
    print(f"  {size} {name}: restored weights rel. error {weights_error:.4f}, Adam update {update_error:.4f}")
    chain_mb = key_mb + stored["delta"]
    reader.continue_chain("step-3")  # as the Trainer's callback does on a resume: the chain goes on
    train_step(m3, o3, 3)
    record("save after resume", lambda: reader.compress(4), store)
    stored["save after resume"] -= chain_mb
    return Row(size, params, ckpt / 1e6, seconds, peak, stored, name, weights_error, update_error, cpu_seconds=cpu)


def combined(runs: list[Row]) -> Row:
    """One row from repeated runs of a size: the median of each time (timings here vary by
    +-25% between identical runs, torch.save's the most), the largest of each peak."""
    row = runs[0]
    row.seconds = {op: statistics.median(r.seconds[op] for r in runs) for op in row.seconds}
    row.cpu_seconds = {op: statistics.median(r.cpu_seconds[op] for r in runs) for op in row.cpu_seconds}
    row.peak_extra = {op: max(r.peak_extra[op] for r in runs) for op in row.peak_extra}
    return row


def search_cost(size: str, batches: int = 16, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds, candidates evaluated and peak extra memory of the threshold search (1%, the
    default cube) at one keyframe, on ``batches`` batches of 4 x 64 random tokens, evaluated on a
    CPU copy of the model (what a background save does on one process)."""
    config = GPT2Config(**SIZES[size])
    torch.manual_seed(0)
    model, optimizer = fresh(config, dtype)
    train_step(model, optimizer, 0)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, config.vocab_size, (4, 64), generator=g) for _ in range(batches)]
    with tempfile.TemporaryDirectory() as tmp:
        compressor = Compressor(
            model, tmp, optimizer=optimizer, threshold=0.01, eval_data=[{"input_ids": x, "labels": x} for x in ids]
        )
        snap = compressor.snapshot(1, detach_model=True)
        seconds, extra, result, _ = measure(lambda: compressor.search_snapshot(snap))
    checkpoint = snap.nbytes()
    print(f"  {size} search: {seconds:.1f} s, {result.evaluations} candidates, peak extra {extra / checkpoint:.2f}x")
    return {"seconds": seconds, "evaluations": float(result.evaluations), "peak_extra": extra / checkpoint}


def _update(state: dict[str, torch.Tensor], eps: float = 1e-8) -> torch.Tensor:
    """The step Adam takes from its moments (before the learning rate)."""
    return state["exp_avg"].float() / (state["exp_avg_sq"].float().sqrt() + eps)


def exponent(rows: list[Row], key: str) -> float:
    """Least-squares slope of log(seconds) on log(params): 1.0 is linear growth."""
    xs = [math.log(r.params) for r in rows]
    ys = [math.log(max(r.seconds[key], 1e-6)) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def table(rows: list[Row]) -> str:
    ops = [
        "torch.save", "keyframe", "delta", "safetensors save", "torch.load", "restore", "safetensors load",
        "save after resume",
    ]  # fmt: skip
    head = "| size | params | checkpoint | " + " | ".join(ops) + " | keyframe / save | restore / load |"
    lines = [head, "|" + "---|" * (len(ops) + 5)]
    for r in rows:
        cells = [f"{r.seconds[o]:.2f} s ({r.peak_extra[o]:.2f}x)" for o in ops]
        lines.append(
            f"| {r.size} | {r.params / 1e6:.1f}M | {r.checkpoint_mb:,.0f} MB | " + " | ".join(cells)
            + f" | {r.seconds['keyframe'] / r.seconds['torch.save']:.2f}x"
            + f" | {r.seconds['restore'] / r.seconds['torch.load']:.2f}x |"
        )
    if len(rows) > 1:
        lines.append("")
        lines.append("growth exponent of time with size (1.0 = linear): " + ", ".join(
            f"{o} {exponent(rows, o):.2f}" for o in ops
        ))
    lines.append("")
    lines.append("CPU seconds (user + system, every thread's; medians): " + "; ".join(
        f"{r.size}: " + ", ".join(f"{o} {r.cpu_seconds[o]:.2f}" for o in ops) for r in rows
    ))
    lines.append("restored (relative L2 error): " + "; ".join(
        f"{r.size} {r.dtype}: weights {r.weights_error:.4f}, Adam update {r.update_error:.4f}" for r in rows
    ))
    searched = [r for r in rows if r.search]
    if searched:
        lines.append("threshold search (1%, 16 batches of 4 x 64 tokens, CPU copy of the model): " + "; ".join(
            f"{r.size}: {r.search['seconds']:.1f} s, {r.search['evaluations']:.0f} candidates, "
            f"peak extra {r.search['peak_extra']:.2f}x" for r in searched
        ))
    lines.append("stored MB: " + "; ".join(
        f"{r.size}: torch.save {r.stored_mb['torch.save']:,.0f}, keyframe {r.stored_mb['keyframe']:,.1f} "
        f"({r.checkpoint_mb / r.stored_mb['keyframe']:.1f}x), delta {r.stored_mb['delta']:,.1f}, "
        f"save after resume {r.stored_mb['save after resume']:,.1f}"
        for r in rows
    ))
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    times, mem = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    x = [r.params / 1e6 for r in rows]
    for op, style in [("torch.save", "k--"), ("torch.load", "k:"), ("safetensors save", "c--"),
                      ("keyframe", "b-o"), ("delta", "g-o"), ("restore", "r-o"), ("save after resume", "m-o")]:
        times.plot(x, [r.seconds[op] for r in rows], style, label=op)
        mem.plot(x, [r.peak_extra[op] for r in rows], style, label=op)
    for ax, title in [(times, "seconds"), (mem, "peak extra host memory (checkpoints)")]:
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    times.set_yscale("log")
    mem.axhline(1.0, color="grey", lw=0.8)
    times.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, of " + ", ".join(SIZES))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and moments")
    parser.add_argument("--search", action="store_true", help="also time the threshold search at each size")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per size: each time is the median, each peak the largest"
    )
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--plot", type=Path, default=OUT / "scale.png")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    rows = []
    for size in args.sizes.split(","):
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(dir=OUT if OUT.exists() else None) as tmp:
                runs.append(bench(size, Path(tmp), getattr(torch, args.dtype)))
            gc.collect()
        rows.append(combined(runs))
        if args.search:
            rows[-1].search = search_cost(size, dtype=getattr(torch, args.dtype))
    print(table(rows))
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
