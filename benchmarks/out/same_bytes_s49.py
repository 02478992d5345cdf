import os, sys, hashlib, tempfile, shutil
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
from bench_scale import CONFIG, SIZES, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
size = os.environ.get("SIZE", "7M"); dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[size]), dtype); train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
ids = [c.compress(1)]
train_step(model, opt, 1); train_step(model, opt, 2); ids.append(c.compress(3))
h = hashlib.sha256()
for root, _, files in sorted(os.walk(os.path.join(d, "s", "entries"))):
    for f in sorted(files):
        if f.endswith(".safetensors") or "payload" in f:
            h.update(open(os.path.join(root, f), "rb").read())
m3, o3 = fresh(GPT2Config(**SIZES[size]), dtype)
Compressor(m3, os.path.join(d, "s"), CONFIG, optimizer=o3).restore(3)
r = hashlib.sha256(b"".join(t.detach().float().numpy().tobytes() for t in m3.state_dict().values()))
for st in o3.state_dict()["state"].values():
    for k in sorted(st): r.update(st[k].detach().float().numpy().tobytes())
print(size, dtype, "entries", ids, "payload", h.hexdigest()[:16], "restored", r.hexdigest()[:16])
shutil.rmtree(d)
