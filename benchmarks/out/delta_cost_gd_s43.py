# session 43: grouped_delta's ns a value by level count, and byte_counts of the base, the captured 124M delta
import time, numpy as np, collections
from hf_dynaquant.core.delta import grouped_delta
from hf_dynaquant.core.histogram import byte_counts
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
T = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
for i in range(len(L)):
    b, c, lv = z[f"b{i}"], z[f"c{i}"], int(L[i])
    best = min((lambda t: (grouped_delta(b, c, lv), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(3))
    bc = min((lambda t: (byte_counts(b, 256), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(3))
    r = T[lv]; r[0] += b.size; r[1] += best; r[2] += bc; r[3] += np.count_nonzero(b != c)
for lv, (n, t, bc, ch) in sorted(T.items()):
    print(f"L{lv:3d} {n/1e6:7.1f} M  grouped_delta {t:.3f} s ({1e9*t/n:.2f} ns)  byte_counts(base) {bc:.3f} s ({1e9*bc/n:.2f} ns)  changed {ch/n:.1%}")
