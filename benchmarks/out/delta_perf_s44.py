import os, sys, time, tempfile, subprocess, signal
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt); c.compress(1)
train_step(model, opt, 1); train_step(model, opt, 2)
for what in ("delta", "keyframe"):
    if what == "keyframe":
        c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
    release_freed(); time.sleep(0.3)
    perf = subprocess.Popen(["perf", "record", "-q", "-F", "2999", "-g", "-p", str(os.getpid()), "-o", f"/tmp/s44/{what}.data"])
    time.sleep(1.0)
    c0, t = _cpu_seconds(), time.perf_counter(); c.compress(3); w, cpu = time.perf_counter() - t, _cpu_seconds() - c0
    perf.send_signal(signal.SIGINT); perf.wait()
    print(f"{what}: {w:.2f} s (CPU {cpu:.2f})", flush=True)
