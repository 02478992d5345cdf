# session 45: when each tensor of a 124M fp32 delta is encoded, and on which thread (keyframe at step 1, two steps, delta at step 3)
import os, sys, time, tempfile, shutil, gc, threading
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
import hf_dynaquant.codecs.dynaquant as dq, hf_dynaquant.codecs.lossless as ll
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
rec = []
def wrap(cls):
    f = cls.encode
    def g(self, tensor, base=None):
        t = time.perf_counter(); r = f(self, tensor, base); rec.append((t, time.perf_counter(), threading.current_thread().name, cls.__name__, tensor.shape, r.params.get("mode"))); return r
    cls.encode = g
wrap(dq.DynaQuantCodec); wrap(ll.LosslessCodec)
STEP = int(os.environ.get("STEP", "3"))
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
c.compress(1)
if STEP == 3:
    train_step(model, opt, 100); train_step(model, opt, 200)
if os.environ.get("KEY"):
    c = Compressor(model, os.path.join(d, "k"), CONFIG, optimizer=opt)
gc.collect(); release_freed(); time.sleep(0.2)
rec.clear(); t0 = time.perf_counter(); c.compress(STEP); t1 = time.perf_counter()
print(f"save {t1-t0:.2f} s")
import math
for a, b, th, cl, shape, mode in sorted(rec):
    n = math.prod(shape)
    if n >= 1_000_000:
        print(f"{a-t0:6.3f} {b-t0:6.3f} {b-a:6.3f} {th:14s} {cl:16s} {n/1e6:6.1f}M {mode}")
import collections
agg = collections.defaultdict(lambda: [0, 0.0, 0])
for a, b, th, cl, shape, mode in rec:
    n = math.prod(shape); k = (cl, mode, "<1M" if n < 1_000_000 else ">=1M")
    agg[k][0] += 1; agg[k][1] += b - a; agg[k][2] += n
for k, (cnt, t, n) in sorted(agg.items()):
    print(f"class {k}: {cnt} tensors, {n/1e6:.1f}M values, {t:.3f} s, {1e3*t/cnt:.2f} ms each")
small = [r for r in rec if math.prod(r[4]) < 1_000_000]
print(f"small tensors {len(small)}: {sum(r[1]-r[0] for r in small):.3f} s, from {min(r[0] for r in small)-t0:.3f} to {max(r[1] for r in small)-t0:.3f}")
shutil.rmtree(d)
