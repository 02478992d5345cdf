# session 46: what a keyframe and a delta would take if Adam's update cost nothing (made before the save)
import os, sys, time, tempfile, shutil, gc, resource
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.training.optimizer_state as OS
from hf_dynaquant.core.moments import adam_update
FREE = bool(os.environ.get("FREE"))
cache = {}
orig = OS._Moment.target
def target(self):
    if FREE and self.kind == OS.ADAM:
        return cache[self.entry["exp_avg"].data_ptr()]
    return orig(self)
OS._Moment.target = target
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
out = []
def timed(step):
    cache.clear()
    if FREE:
        for st in opt.state.values():
            cache[st["exp_avg"].data_ptr()] = adam_update(st["exp_avg"], st["exp_avg_sq"], 1e-8).reshape(-1)
    gc.collect(); time.sleep(0.1)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    c.compress(step)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.append(f"{time.perf_counter()-t:.3f}/{r1.ru_utime-r0.ru_utime:.2f}/{r1.ru_stime-r0.ru_stime:.2f}/{r1.ru_minflt-r0.ru_minflt}")
timed(1)
train_step(model, opt, 100); train_step(model, opt, 200)
timed(3)
train_step(model, opt, 300)
timed(4)
print("free" if FREE else "real", "keyframe, deltas (wall/user/sys/faults):", " ".join(out))
shutil.rmtree(d)
