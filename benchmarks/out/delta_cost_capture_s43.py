# session 43: the (base codes, current codes, levels) of each tensor a 124M fp32 delta codes (bench_scale flow)
import os, sys, pickle, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.codecs import dynaquant as dq
got = []
orig = dq.DynaQuantCodec._encode_state
def spy(self, state, base, extra):
    if isinstance(base, dq.QuantState) and base.codes.size == state.codes.size and not state.trellis:
        got.append((base.codes.copy(), state.codes.copy(), max(base.levels, state.levels)))
    return orig(self, state, base, extra)
dq.DynaQuantCodec._encode_state = spy
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 1); train_step(model, opt, 2)
c.compress(3)
print(len(got), sum(g[0].size for g in got))
np.savez("/dev/shm/s43_delta.npz", **{f"b{i}": g[0] for i, g in enumerate(got)}, **{f"c{i}": g[1] for i, g in enumerate(got)}, levels=np.array([g[2] for g in got]))
