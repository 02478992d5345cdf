import os, sys, time, tempfile, shutil
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import CONFIG, SIZES, fresh, train_step, measure
from transformers import GPT2Config
from hf_dynaquant import Compressor
import hf_dynaquant.core.sketch as S
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"])); train_step(model, opt, 0)
if os.environ.get("WARM_TABLES"):
    t = time.perf_counter(); S._slot_table(0.001); S._slot_table(CONFIG.alpha); print(f"tables {time.perf_counter()-t:.3f}")
d = tempfile.mkdtemp(dir="/dev/shm")
out = []
for i in range(3):
    c = Compressor(model, os.path.join(d, f"s{i}"), CONFIG, optimizer=opt)
    out.append(measure(lambda: c.compress(1))[0])
print(os.environ.get("WARM_TABLES", "-"), " ".join(f"{x:.3f}" for x in out))
shutil.rmtree(d)
