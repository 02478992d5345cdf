# One process of benchmarks/out/before_after_session35.log: run with PYTHONPATH set to the tree under test and TAG naming it.
import os, sys, tempfile, shutil
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step, measure
import hf_dynaquant
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/tmp")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
k, kp, _, kc = measure(lambda: c.compress(1))
torch.manual_seed(7); train_step(model, opt, 1); train_step(model, opt, 2)
dl, dp, _, dc = measure(lambda: c.compress(3))
size = sum(f.stat().st_size for f in __import__("pathlib").Path(d).rglob("*") if f.is_file())
print(f"{os.environ.get('TAG')}: keyframe {k:.2f} s cpu {kc:.2f} peak {kp/1e9:.2f} GB | delta {dl:.2f} s cpu {dc:.2f} peak {dp/1e9:.2f} GB | {size/1e6:.2f} MB | {hf_dynaquant.__file__}", flush=True)
shutil.rmtree(d)
