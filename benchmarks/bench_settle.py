"""How fast a snapshot staged on a GPU moves into host memory, and what would move it faster
(issue 16, item 7).

A background save on a GPU copies the model's and optimizer's state on the device (milliseconds of
stall), and the background thread then moves that copy into host memory
(:meth:`hf_dynaquant.training.snapshot.Snapshot.settle`: each tensor ``.to("cpu")`` on a CUDA
stream of its own). Session 36 measured that move at 6.2 and 5.5 s for the 4.24 GB snapshot of a
353M GPT-2 on an H200 machine (0.7-0.8 GB/s; ``benchmarks/RESULTS.md``, "On a GPU, session 36"):
a quarter of the background's time per checkpoint. Each save's host copy lands in new memory (the
previous snapshot's is handed back after its write), so first touches of memory may be what it
costs. This script times ways of moving the same tensors, in rounds, the variants alternating:

* ``to_cpu``: each tensor ``t.to("cpu")`` on a side stream, as ``Snapshot.settle`` does today;
* ``prefault``: host tensors allocated and first touched by torch's threads (``zero_()``), then
  ``copy_`` from the device;
* ``reused``: host tensors kept from the round before, ``copy_`` alone (what holding the snapshot's
  host memory between saves would give: the lower bound, at 1.0x the checkpoint held);
* ``pinned``: page-locked host tensors asked for each round (``pin_memory=True``), ``copy_`` with
  ``non_blocking=True``, then a synchronize (torch keeps freed page-locked memory cached, so after
  the first round this is a copy into page-locked memory reused);
* ``threads``: ``to_cpu`` split over 4 threads, each with a stream of its own.

The tensors are the weights and two AdamW moments in float32 of ``bench_gpu.py``'s character-level
GPT-2 (``--layers 28 --width 1024 --heads 16 --context 512``: 353M parameters, 4.24 GB), random. Between rounds the
host copies are dropped and freed memory is handed back (:func:`hf_dynaquant.core.memory.release_freed`),
as after a save. Without CUDA it runs on the CPU (host to host), which says nothing of a GPU but
checks the script. Prints a table (seconds and GB/s per variant, median and range) and writes a
plot (``benchmarks/out/settle.png``) and, with ``--json``, the figures::

    python benchmarks/bench_settle.py                 # options: --layers 28 --width 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_dynaquant.core.memory import release_freed  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
THREADS = 4


def snapshot_shapes(layers: int, width: int, heads: int, context: int) -> list[torch.Size]:
    """The shapes of ``bench_gpu.py``'s character-level GPT-2 (built on the meta device: no
    memory), each three times: the weights and AdamW's two moments."""
    from bench_gpu import make_model

    from hf_dynaquant.pretrained.corpus import CharTokenizer

    shape = argparse.Namespace(layers=layers, width=width, heads=heads, context=context, seed=0)
    with torch.device("meta"):
        model = make_model(shape, CharTokenizer().vocab_size)
    return [p.shape for p in model.parameters()] * 3  # (tied weights once, as a state dict holds them)


def to_cpu(tensors: list[torch.Tensor], stream: Callable[[], object]) -> list[torch.Tensor]:
    with stream():
        return [t.to("cpu") for t in tensors]


def prefault(tensors: list[torch.Tensor], stream: Callable[[], object]) -> list[torch.Tensor]:
    out = [torch.empty(t.shape, dtype=t.dtype).zero_() for t in tensors]
    with stream():
        for o, t in zip(out, tensors):
            o.copy_(t)
    return out


def pinned(tensors: list[torch.Tensor], stream: Callable[[], object]) -> list[torch.Tensor]:
    cuda = tensors[0].is_cuda
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    with stream():
        for o, t in zip(out, tensors):
            o.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream().synchronize()
    return out


def threaded(tensors: list[torch.Tensor], stream: Callable[[], object]) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(tensors)

    def part(j: int) -> None:
        with stream():
            for i in range(j, len(tensors), THREADS):
                out[i] = tensors[i].to("cpu")

    workers = [threading.Thread(target=part, args=(j,)) for j in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=str(OUT / "settle.png"))
    a = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    tensors = [torch.randn(s, device=device) for s in snapshot_shapes(a.layers, a.width, a.heads, a.context)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def stream() -> object:
        """A fresh side stream's context on CUDA (the background's own, as in ``settle``), else none."""
        return torch.cuda.stream(torch.cuda.Stream(device)) if cuda else contextlib.nullcontext()

    kept: list[torch.Tensor] = []

    def reused(ts: list[torch.Tensor], stream: Callable[[], object]) -> list[torch.Tensor]:
        if not kept:  # (the first round makes them; its time is that of a first copy, not counted)
            kept.extend(torch.empty(t.shape, dtype=t.dtype).zero_() for t in ts)
        with stream():
            for o, t in zip(kept, ts):
                o.copy_(t)
        return kept

    variants = {"to_cpu": to_cpu, "prefault": prefault, "reused": reused, "pinned": pinned, "threads": threaded}
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    reused(tensors, stream)
    for r in range(a.rounds):
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = variants[name](tensors, stream)
            seconds[name].append(time.perf_counter() - started)
            for o, t in zip(out[:3], tensors[:3]):  # (a spot check that the copy is the device's)
                assert torch.equal(o, t.cpu()), name
            del out
            release_freed()
    where = torch.cuda.get_device_name() if cuda else "CPU (host to host: checks the script, says nothing of a GPU)"
    params = sum(s.numel() for s in snapshot_shapes(a.layers, a.width, a.heads, a.context)) // 3
    print(f"\n{where}: GPT-2 {a.layers}x{a.width} ({params / 1e6:.0f} M parameters), weights + AdamW in float32: "
          f"{len(tensors)} tensors, {nbytes / 1e9:.2f} GB; {a.rounds} rounds\n")
    print("| variant | seconds (median) | range | GB/s (median) |\n|---|---:|---:|---:|")
    for name, s in seconds.items():
        med = statistics.median(s)
        print(f"| {name} | {med:.2f} | {min(s):.2f}-{max(s):.2f} | {nbytes / med / 1e9:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": where, "bytes": nbytes, "seconds": seconds}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(seconds), [statistics.median(s) for s in seconds.values()])
    ax.set_ylabel("seconds to host memory (median)")
    ax.set_title(f"{where[:40]}: {nbytes / 1e9:.2f} GB snapshot")
    fig.tight_layout()
    Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
