# session 43: DynaQuantCodec._encode_state on each captured tensor of the 124M delta, with its base (a delta save) and without (a keyframe save), single thread
import time, numpy as np, collections, cProfile, pstats, sys
from hf_dynaquant.codecs import dynaquant as dq
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
codec = dq.DynaQuantCodec()
def st(c, lv): return dq.QuantState(c, lv, np.zeros(max(lv - 3, 1), np.float32), np.zeros(0, np.uint16), "F32", c.shape)
items = [(st(z[f"b{i}"], int(L[i])), st(z[f"c{i}"], int(L[i]))) for i in range(len(L))]
for rep in range(2):
    tk = td = 0.0; modes = collections.Counter()
    for b, c in items:
        t = time.perf_counter(); codec._encode_state(c, None, {}); t1 = time.perf_counter()
        e = codec._encode_state(c, b, {}); t2 = time.perf_counter()
        tk += t1 - t; td += t2 - t1; modes[e.params["mode"]] += c.codes.size
    print(f"keyframe {tk:.3f} s, delta {td:.3f} s", dict(modes))
if len(sys.argv) > 1:
    pr = cProfile.Profile(); pr.enable()
    for b, c in items: codec._encode_state(c, b, {})
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
