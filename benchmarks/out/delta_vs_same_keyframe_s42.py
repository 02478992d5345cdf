# session 42: a 124M fp32 delta (step 3 on the keyframe of step 1) against a keyframe of the same step-3 checkpoint, alternating order
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_scale import SIZES, CONFIG, fresh, train_step, _cpu_seconds
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")]))
train_step(model, opt, 0)
def timed(fn):
    gc.collect(); release_freed(); time.sleep(0.2)
    c0, t = _cpu_seconds(), time.perf_counter(); fn(); return time.perf_counter() - t, _cpu_seconds() - c0
for rep in range(int(os.environ.get("REPS", "3"))):
    if rep == 0:
        d1 = tempfile.mkdtemp(dir="/dev/shm"); chain = Compressor(model, d1, CONFIG, optimizer=opt)
        k1 = timed(lambda: chain.compress(1))
        train_step(model, opt, 1); train_step(model, opt, 2)
        print(f"keyframe step 1: {k1[0]:.2f} s (CPU {k1[1]:.2f})")
    d2 = tempfile.mkdtemp(dir="/dev/shm"); alone = Compressor(model, d2, CONFIG, optimizer=opt)
    order = ["delta", "keyframe"] if rep % 2 == 0 else ["keyframe", "delta"]
    out = {}
    for what in order:
        if what == "delta":
            # a fresh chain compressor each time: keyframe of step 1 is in d1; re-delta by a new compressor continuing the chain
            c = Compressor(model, d1, CONFIG, optimizer=opt); c.continue_chain("step-1")
            out[what] = timed(lambda: c.compress(3 + 100 * rep))
        else:
            out[what] = timed(lambda: alone.compress(3 + 100 * rep))
    print(f"rep {rep}: delta on step 1 {out['delta'][0]:.2f} s (CPU {out['delta'][1]:.2f}); keyframe of the same checkpoint {out['keyframe'][0]:.2f} s (CPU {out['keyframe'][1]:.2f})", flush=True)
    shutil.rmtree(d2)
