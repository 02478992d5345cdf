# session 43: a 124M fp32 delta's phases (keyframe at step 1, two steps, delta at step 3, each rep in a store of its own) against the keyframe's with each phase's wall and CPU seconds (cores busy)
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, "/work/main/benchmarks")
import torch, resource
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
import hf_dynaquant.training.compressor as cm
import hf_dynaquant.core.memory as mem
_trims = [0]
_orig = mem.release_freed
def _counted():
    _trims[0] += 1; _orig()
mem.release_freed = _counted
if os.environ.get("ALLOW"): cm.SAVE_ALLOWANCE = float(os.environ["ALLOW"])
print("allowance", cm.SAVE_ALLOWANCE)
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
T = {}
def timed(name, f):
    def g(*a, **k):
        t, c = time.perf_counter(), _cpu_seconds(); r = f(*a, **k); T[name] = (time.perf_counter() - t, _cpu_seconds() - c); return r
    return g
cm.encode_optimizer_state = timed("decisions", cm.encode_optimizer_state)
cm.write_planned = timed("write", cm.write_planned)
cm.Compressor.plan_snapshot = timed("plan", cm.Compressor.plan_snapshot)
for i in range(2):
    d = tempfile.mkdtemp(dir="/dev/shm")
    c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
    for step, what in ((1, "keyframe"), (3, "delta")):
      if step == 3: train_step(model, opt, 100 + i); train_step(model, opt, 200 + i)
      gc.collect(); release_freed(); time.sleep(0.2); T.clear(); _trims[0] = 0
      t0, c0 = time.perf_counter(), _cpu_seconds(); f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      c.compress(step)
      w, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
      print(f"{what} {w:.2f} s CPU {cpu:.2f} faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0} trims {_trims[0]} |", "  ".join(f"{k} {a:.2f} s CPU {b:.2f} ({b/a:.2f} cores)" for k, (a, b) in T.items()), flush=True)
    shutil.rmtree(d)
