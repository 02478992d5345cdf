# session 45: ans_decode over the captured streams of a 124M delta (ans_capture_s45.py), one thread: seconds and ns a symbol, and a hash of the symbols
import os, sys, time, hashlib
import numpy as np
import hf_dynaquant
from hf_dynaquant.core.ans import ans_encode, ans_decode
d = np.load("/dev/shm/s45_ans.npz")
n = len(d["lanes"])
streams = []
for i in range(n):
    s, hist, lanes = d[f"s{i}"], d[f"h{i}"], int(d["lanes"][i])
    streams.append((ans_encode(s, lanes=lanes, histograms=hist), s.size, hist.sum(axis=1), lanes))
total = sum(x[1] for x in streams)
best = []
for rep in range(int(os.environ.get("REPS", "5"))):
    h = hashlib.sha256()
    t = time.perf_counter()
    for payload, size, groups, lanes in streams:
        h.update(ans_decode(payload, size, groups, lanes))
    best.append(time.perf_counter() - t)
print(hf_dynaquant.__file__.split("/hf_dynaquant/")[0], f"{min(best):.4f} s best of {len(best)} ({1e9*min(best)/total:.3f} ns a symbol; median {sorted(best)[len(best)//2]:.4f} s)", h.hexdigest()[:16])
