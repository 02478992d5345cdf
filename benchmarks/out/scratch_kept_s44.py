# session 44: do a delta's fresh grouped output and unpacked base cost page faults? thread-local
# scratch buffers (patched in) against today's np.empty, alternating over successive deltas
import os, sys, time, tempfile, threading, resource
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
from hf_dynaquant import Compressor
import hf_dynaquant.core.delta as D
import hf_dynaquant.core.bitplanes as B
import hf_dynaquant.codecs.dynaquant as Q
from hf_dynaquant.core.kernels import native
tl = threading.local()
ON = [False]
def scratch(name, n):
    buf = getattr(tl, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1), np.uint8); setattr(tl, name, buf)
    return buf[:n]
orig_gd = D.grouped_delta
def gd(prev, cur, levels):
    if not ON[0]: return orig_gd(prev, cur, levels)
    grouped, pairs = scratch("g", prev.size), np.empty(65536, dtype=np.int64)
    native.cyclic_u8(prev, cur, levels, grouped, pairs)
    return grouped, pairs.reshape(256, 256)[:levels, :levels]
Q.grouped_delta = gd
orig_unpacked = B.PackedCodes.unpacked
def unpacked(self):
    if not ON[0]: return orig_unpacked(self)
    out = scratch("u", self.size)
    native.unpack(np.ascontiguousarray(self.data), self.width, out, self.base)
    return out
B.PackedCodes.unpacked = unpacked
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
c.compress(1)
step = 1
res = {False: [], True: []}
for i in range(8):
    ON[0] = (i % 2 == 1)
    train_step(model, opt, step); train_step(model, opt, step + 1); step += 2
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t = _cpu_seconds(), time.perf_counter(); c.compress(step); w, cpu = time.perf_counter() - t, _cpu_seconds() - c0
    flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
    res[ON[0]].append((w, cpu))
    print(f"delta step {step} scratch={ON[0]}: {w:.2f} s (CPU {cpu:.2f}) minflt {flt}", flush=True)
for k, v in res.items():
    print(k, "wall", sorted(round(a, 2) for a, _ in v), "cpu", sorted(round(b, 2) for _, b in v))
