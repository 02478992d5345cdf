# session 38: 124M keyframes in one process, rounded to the nearest centre and stochastically (as every save after a resume is), alternately; DTYPE=bf16 for pure bf16; prints seconds/CPU seconds and the entry id of each
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
dtype = torch.bfloat16 if os.environ.get("DTYPE") == "bf16" else torch.float32
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), dtype)
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/tmp")
res = []
for step, mode in ((1, "nearest"), (2, "stochastic"), (3, "nearest"), (4, "stochastic")):
    gc.collect()
    c = Compressor(model, os.path.join(d, f"s{step}"), CONFIG, optimizer=opt)
    if mode == "stochastic":
        c.resumed_from("step-0")
    t0 = time.perf_counter(); c0 = time.process_time()
    c.compress(step)
    res.append(f"{mode} {time.perf_counter()-t0:.3f}/{time.process_time()-c0:.2f} {c.last_report.entry[:6]}")
print(" | ".join(res))
shutil.rmtree(d)
