# session 44: time a delta save spends reading base states from the previous entry (store._base_state, on the writing thread)
import os, sys, time, tempfile, collections
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
from hf_dynaquant import Compressor
import hf_dynaquant.store.store as S
orig = S._base_state
T = collections.Counter()
def timed(base, section, name, raw):
    t = time.perf_counter(); r = orig(base, section, name, raw); T["s"] += time.perf_counter() - t; T["n"] += 1
    if base is not None:
        rec = base.manifest["sections"].get(section, {}).get(name) or {}
        T["codec " + str(rec.get("codec"))] += 1
        T["uses_base"] += bool(rec.get("uses_base"))
    return r
S._base_state = timed
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
for step in (1, 3, 5, 7, 9):
    if step > 1: train_step(model, opt, step - 1); train_step(model, opt, step)
    T.clear()
    t = time.perf_counter(); c.compress(step); w = time.perf_counter() - t
    print(f"save {step}: {w:.2f} s; base states read: {T['n']} in {T['s']:.3f} s;", {k: v for k, v in T.items() if k not in ('n', 's')}, flush=True)
