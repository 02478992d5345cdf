# session 43: the kept bases of the captured 124M delta unpacked (a delta save unpacks each base before coding), and the new codes packed for the next delta, single thread
import time, numpy as np
from hf_dynaquant.codecs import dynaquant as dq
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
codec = dq.DynaQuantCodec()
def st(c, lv): return dq.QuantState(c, lv, np.zeros(max(lv - 3, 1), np.float32), np.zeros(0, np.uint16), "F32", c.shape)
kept = [codec.kept(st(z[f"b{i}"], int(L[i]))) for i in range(len(L))]
cur = [st(z[f"c{i}"], int(L[i])) for i in range(len(L))]
for rep in range(2):
    t = time.perf_counter(); u = [k.unpacked() for k in kept]; t1 = time.perf_counter()
    del u
    t2 = time.perf_counter(); kk = [codec.kept(c) for c in cur]; t3 = time.perf_counter()
    t4 = time.perf_counter()
    for k in kept: k.unpacked()  # (each dropped at once, as a save drops a base once its delta is coded)
    t5 = time.perf_counter()
    print(f"unpack the bases, all held {t1-t:.3f} s, one at a time {t5-t4:.3f} s; pack the new codes for the next delta {t3-t2:.3f} s")
