# session 38: the rANS streams of one 124M fp32 delta (bench_scale's setup: a keyframe, two AdamW steps, a delta),
# captured as the encoder is called, then coded again eight lanes at a time by the plain loops and by the AVX-512
# encoder (native.allow_simd), by the largest alphabet of a stream's groups; log: rans_encoder_by_alphabet_s38.log.
# With DUMP=path it also writes them for rans_lanes16_prototype_s38.c (int64 count, then per stream six
# length-prefixed buffers: the encoder's arguments).
import os, sys, time, tempfile, shutil, struct
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.core.ans as ans
from hf_dynaquant.core.kernels import native

calls, recording = [], [False]


class Capture:
    def __getattr__(self, name):
        if name != "ans_encode":
            return getattr(native, name)

        def encode(*args):
            if recording[0]:
                calls.append([bytes(a) if not isinstance(a, int) else a for a in args])
            return native.ans_encode(*args)
        return encode


ans.native = Capture()
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.float32)
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/tmp")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 1), train_step(model, opt, 2)
recording[0] = True
c.compress(3)
shutil.rmtree(d)
if os.environ.get("DUMP"):
    with open(os.environ["DUMP"], "wb") as f:
        f.write(struct.pack("<q", len(calls)))
        for call in calls:
            for b in call[:6]:
                f.write(struct.pack("<q", len(b)) + b)
tiers = {}
for call in calls:
    k = int(np.frombuffer(call[3], np.int64).max()) if len(call[3]) else 0
    tiers.setdefault("k<=16" if k <= 16 else "k<=32" if k <= 32 else "k<=64" if k <= 64 else "k>64", []).append(call)
for tier, streams in sorted(tiers.items()):
    n = sum(len(s[0]) for s in streams)
    for vector in (False, True):
        native.allow_simd(vector)
        t = time.perf_counter()
        for _ in range(2):
            for s in streams:
                native.ans_encode(*s[:-1], 8)
        print(tier, f"{n / 1e6:.1f}M", "simd" if vector else "scalar", f"{(time.perf_counter() - t) / 2 / n * 1e9:.2f} ns/sym")
native.allow_simd(True)
