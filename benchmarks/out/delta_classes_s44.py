# session 44: which tensors' deltas are weighed (grouped), coded, kept, in a 124M delta save
import os, sys, time, tempfile, threading, collections
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
import hf_dynaquant.codecs.dynaquant as Q
tl = threading.local()
og, op, oe = Q.grouped_delta, Q._delta_payload, Q.DynaQuantCodec._encode_state
def g(*a, **k):
    tl.grouped = True; return og(*a, **k)
def p(*a, **k):
    tl.coded = True; return op(*a, **k)
stats = collections.Counter()
def e(self, state, base, extra):
    tl.grouped = tl.coded = False
    r = oe(self, state, base, extra)
    if tl.grouped:
        key = ("coded" if tl.coded else "weighed only") + " -> " + r.params["mode"]
        stats[key] += state.codes.size; stats[key + " n"] += 1
    return r
Q.grouped_delta, Q._delta_payload, Q.DynaQuantCodec._encode_state = g, p, e
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 1); train_step(model, opt, 2)
c.compress(3)
for k, v in sorted(stats.items()): print(k, v)
