# session 44: scratch per save (buffers dropped at each save's start), variants alternating:
# none / grouped+unpacked (gu) / gu + pair symbols (gup)
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
MODE = ["none"]; GEN = [0]
def scratch(name, n):
    if getattr(tl, "gen", None) != GEN[0]:
        tl.__dict__.clear(); tl.gen = GEN[0]
    buf = getattr(tl, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1), np.uint8); setattr(tl, name, buf)
    return buf[:n]
orig_gd = D.grouped_delta
def gd(prev, cur, levels):
    if MODE[0] == "none": return orig_gd(prev, cur, levels)
    grouped, pairs = scratch("g", prev.size), np.empty(65536, dtype=np.int64)
    native.cyclic_u8(prev, cur, levels, grouped, pairs)
    return grouped, pairs.reshape(256, 256)[:levels, :levels]
Q.grouped_delta = gd
orig_unpacked = B.PackedCodes.unpacked
def unpacked(self):
    if MODE[0] == "none": return orig_unpacked(self)
    out = scratch("u", self.size)
    native.unpack(np.ascontiguousarray(self.data), self.width, out, self.base)
    return out
B.PackedCodes.unpacked = unpacked
orig_pu = D.pair_up
def pu(grouped, sizes, levels):
    if MODE[0] != "gup": return orig_pu(grouped, sizes, levels)
    sizes = D._group_sizes(sizes, levels)
    lengths = D.paired_sizes(sizes)
    symbols = scratch("p", int(lengths.sum()))
    counts = np.zeros((lengths.size, 256), dtype=np.int64)
    native.pair_up_u8(np.ascontiguousarray(grouped, dtype=np.uint8), sizes, levels, symbols, counts)
    return symbols, counts
Q.pair_up = pu
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
c.compress(1)
step = 1
modes = ["none", "gu", "gup"]
res = {m: [] for m in modes}
for i in range(12):
    MODE[0] = modes[i % 3] if (i // 3) % 2 == 0 else modes[::-1][i % 3]
    GEN[0] += 1
    train_step(model, opt, step); train_step(model, opt, step + 1); step += 2
    c0, t = _cpu_seconds(), time.perf_counter(); c.compress(step); w, cpu = time.perf_counter() - t, _cpu_seconds() - c0
    res[MODE[0]].append((w, cpu))
    print(f"delta step {step} {MODE[0]}: {w:.2f} s (CPU {cpu:.2f})", flush=True)
for k, v in res.items():
    print(k, "wall", sorted(round(a, 2) for a, _ in v), "cpu", sorted(round(b, 2) for _, b in v))
