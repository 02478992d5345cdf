# session 43: the codec's seconds a tensor on the 124M delta's 196 tensors of at most 65536 values (LayerNorm and bias weights and their Adam codes), a keyframe save's and a delta save's, single thread; run with PYTHONPATH at a copy of the package (old: 28a9648, new: compiled varints)
import time, numpy as np, cProfile, pstats
from hf_dynaquant.codecs import dynaquant as dq
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
codec = dq.DynaQuantCodec()
def st(c, lv): return dq.QuantState(c, lv, np.zeros(max(lv - 3, 1), np.float32), np.zeros(0, np.uint16), "F32", c.shape)
items = [(st(z[f"b{i}"], int(L[i])), st(z[f"c{i}"], int(L[i]))) for i in range(len(L)) if z[f"c{i}"].size <= 65536]
print(len(items), "tensors of at most 65536 values,", sum(c.codes.size for _, c in items), "values")
for rep in range(3):
    t = time.perf_counter()
    for b, c in items: codec._encode_state(c, None, {})
    t1 = time.perf_counter()
    for b, c in items: codec._encode_state(c, b, {})
    t2 = time.perf_counter()
    print(f"keyframe {1e3*(t1-t)/len(items):.3f} ms a tensor, delta {1e3*(t2-t1)/len(items):.3f} ms")

