# session 44: the interpreter's cyclic collections during 124M saves (gc.callbacks: each collection's generation and time)
import os, sys, time, tempfile, gc, collections
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
log = []; started = {}
def cb(phase, info):
    if phase == "start": started["t"] = time.perf_counter()
    else: log.append((info["generation"], time.perf_counter() - started["t"], info["collected"]))
gc.callbacks.append(cb)
print("tracked objects:", len(gc.get_objects()), "thresholds", gc.get_threshold())
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
for step in (1, 3, 5, 7, 9):
    if step > 1: train_step(model, opt, step - 1); train_step(model, opt, step)
    log.clear()
    t = time.perf_counter(); c.compress(step); w = time.perf_counter() - t
    by = collections.defaultdict(lambda: [0, 0.0])
    for g, s, _ in log: by[g][0] += 1; by[g][1] += s
    print(f"save {step}: {w:.2f} s; collections " + ", ".join(f"gen{g}: {n} in {s*1e3:.1f} ms" for g, (n, s) in sorted(by.items())), "| tracked", len(gc.get_objects()), flush=True)
