# session 45 (from session 44): a 124M fp32 keyframe (step 1) then deltas two steps apart, wall and CPU each (package from PYTHONPATH)
import os, sys, time, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
import hf_dynaquant
from hf_dynaquant import Compressor
assert hf_dynaquant.__file__.startswith(os.environ["EXPECT"]), hf_dynaquant.__file__
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
out = []
for step in (1, 3, 5, 7, 9):
    if step > 1:
        train_step(model, opt, step - 1); train_step(model, opt, step)
    c0, t = _cpu_seconds(), time.perf_counter(); c.compress(step); w, cpu = time.perf_counter() - t, _cpu_seconds() - c0
    out.append(f"{w:.2f}/{cpu:.2f}")
print(os.environ["EXPECT"], "keyframe, deltas (wall/CPU):", " ".join(out), flush=True)
