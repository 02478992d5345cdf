# session 43: a 124M fp32 keyframe written to the disk (bench_scale's directory), timed as bench_scale times it, with the store's fsyncs counted and timed (os.fsync wrapped)
import os, sys, time, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, measure
from transformers import GPT2Config
from hf_dynaquant import Compressor
_fsync = os.fsync
spent = [0.0, 0]
def timed_fsync(fd):
    t = time.perf_counter(); _fsync(fd); spent[0] += time.perf_counter() - t; spent[1] += 1
os.fsync = timed_fsync
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
tmp = tempfile.mkdtemp(dir=os.environ.get("DIR", "/work/main/benchmarks/out"))
for i in range(4):
    c = Compressor(model, os.path.join(tmp, f"s{i}"), CONFIG, optimizer=opt)
    spent[:] = [0.0, 0]
    sec, extra, _, cpu = measure(lambda: c.compress(1))
    print(f"keyframe {i}: {sec:.2f} s (CPU {cpu:.2f}), {spent[1]} fsyncs took {spent[0]:.3f} s", flush=True)
