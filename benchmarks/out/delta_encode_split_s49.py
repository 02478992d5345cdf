import os, sys, gc, time, threading, collections
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main/benchmarks/out")
from bench_scale import CONFIG, train_step
from s46_first_keyframe import first_keyframe
from hf_dynaquant import Compressor
import hf_dynaquant.codecs.dynaquant as D
import hf_dynaquant.core.quantizer as Q
from hf_dynaquant.core.memory import release_freed
model, opt, d, c = first_keyframe()
train_step(model, opt, 100); train_step(model, opt, 200)
pass
st = collections.defaultdict(lambda: [0, 0, 0.0]); lock = threading.Lock()
def wrap(obj, name, label, size=lambda a: 0):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); dt = time.perf_counter() - t
        with lock: s = st[label]; s[0] += 1; s[1] += size(a); s[2] += dt
        return r
    setattr(obj, name, g)
wrap(D, "encode_codes_packed", "encode_codes_packed", lambda a: a[0].size)
wrap(D._Factored, "code", "factored.code", lambda a: a[0].state.codes.size if hasattr(a[0], "state") else 0)
wrap(D._Factored, "tried", "factored.tried", lambda a: a[0].codes.size)
wrap(D, "quantize", "quantize", lambda a: 0)
wrap(D.LosslessCodec, "encode", "lossless(protected etc)", lambda a: 0)
wrap(D, "grouped_delta", "grouped_delta", lambda a: a[1].size)
wrap(D, "_delta_payload", "_delta_payload", lambda a: 0)
wrap(D, "codes_size_floor", "codes_size_floor", lambda a: 0)
wrap(D.DynaQuantCodec, "encode", "dq.encode total", lambda a: 0)
gc.collect(); release_freed()
t0 = time.perf_counter(); c.compress(3); print("save", time.perf_counter() - t0)
for k, (n, v, t) in sorted(st.items(), key=lambda kv: -kv[1][2]): print(f"{k:28s} {n:5d} calls {v/1e6:7.1f}M {t:.3f} s")
