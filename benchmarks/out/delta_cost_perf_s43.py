# session 43: perf over one 124M fp32 delta (bench_scale flow: keyframe step 1, two steps, delta step 3) and, separately, a keyframe of the same checkpoint
import os, sys, time, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
WHAT = os.environ.get("WHAT", "delta")
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d1 = tempfile.mkdtemp(dir="/dev/shm"); c = Compressor(model, d1, CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 1); train_step(model, opt, 2)
if WHAT == "keyframe":
    c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
release_freed(); time.sleep(0.3)
import subprocess, signal
perf = subprocess.Popen(["perf", "record", "-q", "-F", "1999", "-g", "-p", str(os.getpid()), "-o", f"/tmp/s43_{WHAT}.data"])
time.sleep(1.0)
c0, t = _cpu_seconds(), time.perf_counter(); c.compress(3); w, cpu = time.perf_counter() - t, _cpu_seconds() - c0
perf.send_signal(signal.SIGINT); perf.wait()
print(f"{WHAT}: {w:.2f} s (CPU {cpu:.2f})")
