# session 45: the rANS streams (symbols and histograms) a 124M fp32 delta codes, over 1M symbols each, saved for ans_bench_s45.py
import os, sys, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
import hf_dynaquant.core.ans as ans, hf_dynaquant.codecs.dynaquant as dq
got = []
orig = ans.ans_encode
def spy(symbols, groups=None, lanes=1, *, histograms=None):
    if symbols.size > 1_000_000 and histograms is not None:
        got.append((np.array(symbols, copy=True), np.array(histograms, copy=True), lanes))
    return orig(symbols, groups, lanes, histograms=histograms)
dq.ans_encode = spy
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 1); train_step(model, opt, 2)
c.compress(3)
print(len(got), "streams", sum(g[0].size for g in got), "symbols")
np.savez("/dev/shm/s45_ans.npz", **{f"s{i}": g[0] for i, g in enumerate(got)}, **{f"h{i}": g[1] for i, g in enumerate(got)}, lanes=np.array([g[2] for g in got]))
