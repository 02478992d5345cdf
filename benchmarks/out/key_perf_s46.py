# session 46: perf over one 124M fp32 keyframe (DELTA=1: the delta after it)
import os, sys, time, tempfile, shutil, gc, subprocess, signal
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 100); train_step(model, opt, 200)
if not os.environ.get("DELTA"):
    c = Compressor(model, os.path.join(d, "k"), CONFIG, optimizer=opt)
gc.collect(); release_freed(); time.sleep(0.2)
perf = subprocess.Popen(["perf", "record", *os.environ.get("PERFARGS", "").split(), "-p", str(os.getpid()), "-o", os.environ.get("OUT", "/tmp/s46/perf.data")], stderr=subprocess.DEVNULL); time.sleep(1.0)
t = time.perf_counter(); c0 = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
c.compress(3)
print(f"save {time.perf_counter()-t:.3f} s, CPU {time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)-c0:.3f}")
perf.send_signal(signal.SIGINT); perf.wait()
shutil.rmtree(d)
