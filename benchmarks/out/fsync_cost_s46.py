# session 46: how long a 124M fp32 save waits in fsync, the store on this machine's disk (as bench_scale's is)
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
spent = []
real = os.fsync
def timed_fsync(fd):
    t = time.perf_counter(); real(fd); spent.append(time.perf_counter() - t)
os.fsync = timed_fsync
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/work/main/benchmarks/out")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
for step in (1, 3, 4):
    if step == 3: train_step(model, opt, 100); train_step(model, opt, 200)
    if step == 4: train_step(model, opt, 300)
    gc.collect(); spent.clear(); t = time.perf_counter()
    c.compress(step)
    wall = time.perf_counter() - t
    print(f"step {step}: save {wall:.3f} s, fsync {sum(spent):.3f} s in {len(spent)} calls (largest {max(spent):.3f}), entry {c.last_report.weights_stored + c.last_report.optimizer_stored + c.last_report.other_stored:,} bytes")
# torch.save with an fsync, for scale
sd = {"m": model.state_dict(), "o": opt.state_dict()}
p = os.path.join(d, "plain.pt"); t = time.perf_counter(); torch.save(sd, p); a = time.perf_counter() - t
fd = os.open(p, os.O_RDONLY); t = time.perf_counter(); real(fd); b = time.perf_counter() - t; os.close(fd)
print(f"torch.save {a:.3f} s, then its fsync {b:.3f} s ({os.path.getsize(p):,} bytes)")
shutil.rmtree(d)
