# session 36: a 124M keyframe's phases (plan, optimizer-state decisions, write), timed by wrapping them; see keyframe_timeline_s36.log
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.training.compressor as cm
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
T = {}
def wrap(mod, name):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T.setdefault(name, []).append((t - T0, time.perf_counter() - T0)); return r
    setattr(mod, name, g)
for n in ("encode_optimizer_state", "write_planned"): wrap(cm, n)
orig = cm.Compressor.plan_snapshot
def ps(self, snap):
    t = time.perf_counter(); r = orig(self, snap); T.setdefault("plan_snapshot", []).append((t - T0, time.perf_counter() - T0)); return r
cm.Compressor.plan_snapshot = ps
for i in range(4):
    d = tempfile.mkdtemp(dir="/tmp")
    c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
    gc.collect(); time.sleep(0.2); T.clear()
    T0 = time.perf_counter(); c0 = time.process_time()
    c.compress(1)
    print(f"keyframe {time.perf_counter()-T0:.2f} cpu {time.process_time()-c0:.2f} |", {k: [(round(a,2), round(b,2)) for a, b in v] for k, v in T.items()}, flush=True)
    shutil.rmtree(d)
