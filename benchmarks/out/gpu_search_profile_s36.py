"""Session 36: where a background save's configuration search spends its time on a GPU (issue 16).

The 353M GPT-2 of ``bench_gpu.py`` on the device after two AdamW steps in bf16 autocast, a gradient
window of two steps, then one detached snapshot (staged on the device, settled) and its search
(threshold 1%, 16 evaluation examples, 40 s bound) under cProfile; prints the search's wall time
and the functions by cumulative and own time. Size from the environment (LAYERS, WIDTH, HEADS,
CONTEXT) so that it runs on a CPU at toy size too."""

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import datasets, make_model  # noqa: E402

from hf_dynaquant import Compressor  # noqa: E402

a = argparse.Namespace(
    layers=int(os.environ.get("LAYERS", 28)), width=int(os.environ.get("WIDTH", 1024)),
    heads=int(os.environ.get("HEADS", 16)), context=int(os.environ.get("CONTEXT", 512)), seed=0,
)
dev = "cuda" if torch.cuda.is_available() else "cpu"
train, evals, vocab = datasets(a.context, 16)
model = make_model(a, vocab).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
eval_data = [{k: v[None].to(dev) for k, v in evals[i].items()} for i in range(16)]
comp = Compressor(model, None, optimizer=opt, threshold=0.01, eval_data=eval_data, search_seconds=40)
out = Path(os.environ.get("OUT", "/tmp"))
for n in range(2):  # the first search also makes its stream's cuBLAS workspace; both profiled
    for step in range(2):  # a gradient window before each checkpoint
        rows = range(8 * (2 * n + step), 8 * (2 * n + step + 1))
        batch = {k: torch.stack([train[i][k] for i in rows]).to(dev) for k in ("input_ids", "labels")}
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        comp.on_backward_pass_end()
        opt.step()
        comp.before_gradient_flush()
        opt.zero_grad()
    snap = comp.snapshot(n + 1, detach_model=True)
    t0 = time.perf_counter()
    snap.settle()
    t1 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    result = comp.search_snapshot(snap)
    prof.disable()
    t2 = time.perf_counter()
    print(f"search {n + 1}: settle {t1 - t0:.2f} s, search {t2 - t1:.2f} s, {result.evaluations} evaluations, "
          f"device {snap.search_device}, chosen {result.config}", flush=True)
    del snap
    with open(out / f"search_profile_{n + 1}.txt", "w") as f:
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(50)
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(12)
