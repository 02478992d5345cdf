import os, sys, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
import hf_dynaquant
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "7M")]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
ids = []
for step in (1, 3, 5, 7, 9, 11):
    if step > 1: train_step(model, opt, step - 1); train_step(model, opt, step)
    c.compress(step); ids.append(c.last_entry[:12])
print(hf_dynaquant.__file__.split("/hf_dynaquant/")[0], ids)
