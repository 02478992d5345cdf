import os, sys, time, tempfile, shutil
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
from bench_scale import CONFIG, SIZES, fresh, train_step, measure
from transformers import GPT2Config
from hf_dynaquant import Compressor
torch.manual_seed(0)
config = GPT2Config(**SIZES["124M"])
model, opt = fresh(config); train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
k = measure(lambda: c.compress(1))[0]
train_step(model, opt, 1); train_step(model, opt, 2)
dl = measure(lambda: c.compress(3))[0]
out = []
for i in range(5):
    m3, o3 = fresh(config)
    r = Compressor(m3, os.path.join(d, "s"), CONFIG, optimizer=o3)
    out.append(measure(lambda: r.restore(3))[0])
    del m3, o3, r
print(f"keyframe {k:.2f} delta {dl:.2f} restores " + " ".join(f"{x:.2f}" for x in out))
shutil.rmtree(d)
