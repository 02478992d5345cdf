# session 45: the small tensors (< 1M values) of a 124M fp32 delta (KEY=1: a keyframe of the same checkpoint), encoded again one at a time under cProfile
import os, sys, time, tempfile, shutil, gc, threading, math, cProfile, pstats
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.codecs.dynaquant as dq, hf_dynaquant.codecs.lossless as ll
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
got = []; on = [False]
def wrap(cls):
    f = cls.encode
    def g(self, tensor, base=None):
        if on[0] and int(os.environ.get("ABOVE", "0")) <= math.prod(tensor.shape) < int(os.environ.get("BELOW", "1000000")): got.append((self, tensor, base))
        return f(self, tensor, base)
    cls.encode = g
wrap(dq.DynaQuantCodec); wrap(ll.LosslessCodec)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 100); train_step(model, opt, 200)
if os.environ.get("KEY"):
    c = Compressor(model, os.path.join(d, "k"), CONFIG, optimizer=opt)
on[0] = True; c.compress(3); on[0] = False
print(len(got), "tensors")
for rep in range(2):
    t = time.perf_counter()
    for codec, tensor, base in got: codec.encode(tensor, base)
    print(f"serial re-encode {time.perf_counter() - t:.3f} s")
pr = cProfile.Profile(); pr.enable()
for codec, tensor, base in got: codec.encode(tensor, base)
pr.disable()
pstats.Stats(pr).sort_stats(os.environ.get("SORT", "tottime")).print_stats(45)
shutil.rmtree(d)
