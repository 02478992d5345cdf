# session 40: restores the end of the chain chain_build_s40.py wrote, perf recording only the restore:
#   mkfifo ctl ack; perf record -F 999 -g -D -1 --control fifo:ctl,ack -- python chain_restore_perf_s40.py
# (the fifo paths below are /tmp/s40/ctl and /tmp/s40/ack). Log: chain_restore_perf_s40.log
import sys, time, os
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, fresh
from transformers import GPT2Config
from hf_dynaquant import Compressor
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.float32)
r = Compressor(model, "/tmp/s40/chainstore", optimizer=opt)
ctl, ack = open("/tmp/s40/ctl", "w"), open("/tmp/s40/ack", "r")
ctl.write("enable\n"); ctl.flush(); ack.readline()
t = time.perf_counter(); r.restore(19); print(f"restore {time.perf_counter() - t:.2f} s")
ctl.write("disable\n"); ctl.flush(); ack.readline()
