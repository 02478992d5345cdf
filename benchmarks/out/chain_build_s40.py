# session 40: builds the 124M fp32 default chain (bench_scale setup, ten saves two steps apart) that chain_restore_perf_s40.py restores the end of
import sys, shutil
sys.path.insert(0, "/work/main/benchmarks")
import torch
from pathlib import Path
from bench_scale import CONFIG, SIZES, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
store = Path("/tmp/s40/chainstore"); shutil.rmtree(store, ignore_errors=True)
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.float32)
train_step(model, opt, 0)
c = Compressor(model, store, CONFIG, optimizer=opt, keyframe_every=10)
for i in range(10):
    step = 1 + 2 * i
    if i:
        train_step(model, opt, step - 1); train_step(model, opt, step)
    c.compress(step)
print("built")
