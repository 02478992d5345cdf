# session 43: py-spy (--gil: only the thread holding the GIL) over three 124M fp32 keyframes in one process
import os, sys, time, tempfile, subprocess, signal
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, measure
from transformers import GPT2Config
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
tmp = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(tmp, "warm"), CONFIG, optimizer=opt); c.compress(1)
spy = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "--gil", "-r", "500", "-f", "raw", "-o", "/tmp/s43/kf_gil.txt", "-p", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1.5)
for i in range(3):
    c = Compressor(model, os.path.join(tmp, f"s{i}"), CONFIG, optimizer=opt)
    sec, extra, _, cpu = measure(lambda: c.compress(1))
    print(f"keyframe {i}: {sec:.2f} s (CPU {cpu:.2f})", flush=True)
spy.send_signal(signal.SIGINT); spy.wait()
