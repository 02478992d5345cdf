# session 42: a 124M fp32 chain of a keyframe and 5 deltas, two steps apart (bench_scale's setup), in /dev/shm/s42chain
import sys, shutil
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
shutil.rmtree("/dev/shm/s42chain", ignore_errors=True)
c = Compressor(model, "/dev/shm/s42chain", CONFIG, optimizer=opt)
for step in range(1, 12, 2):
    c.compress(step); train_step(model, opt, step); train_step(model, opt, step + 1)
print("built")

# ---- rtime.py (run alternately with and without NOTRIM=1) ----
# # session 42: restore of the chain's last entry (step 11: five deltas) into a fresh model; NOTRIM=1: no hand-back while the moments convert
# import os, sys, time, resource
# sys.path.insert(0, "/work/main/benchmarks")
# import torch
# from bench_scale import SIZES, CONFIG, fresh, _cpu_seconds
# from transformers import GPT2Config
# from hf_dynaquant import Compressor
# import hf_dynaquant.training.optimizer_state as os_
# if os.environ.get("NOTRIM"): os_._RESTORE_TRIM_EVERY = 1 << 50
# m, o = fresh(GPT2Config(**SIZES["124M"]))
# r = Compressor(m, "/dev/shm/s42chain", CONFIG, optimizer=o)
# before = int(open("/proc/self/statm").read().split()[1]) * 4096
# c0, t = _cpu_seconds(), time.perf_counter(); f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# r.restore(11)
# w, cpu = time.perf_counter() - t, _cpu_seconds() - c0
# hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
# print(f"{'notrim' if os.environ.get('NOTRIM') else 'trim  '}: restore {w:.2f} s (CPU {cpu:.2f}), faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}, peak extra {(hwm - before)/1.493e9:.2f}x", flush=True)
