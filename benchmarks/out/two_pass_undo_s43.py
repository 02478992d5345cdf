# session 43: undo_regrouped_delta (a restore's ungrouping with the cyclic difference, in place, the base's histogram given) by level count, single thread, best of 3, the captured 124M delta
import time, numpy as np, collections
from hf_dynaquant.core.delta import grouped_delta, undo_regrouped_delta
from hf_dynaquant.core.histogram import byte_counts
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
T = collections.defaultdict(lambda: np.zeros(2))
for i in range(len(L)):
    b, c, lv = z[f"b{i}"], z[f"c{i}"], int(L[i])
    diff, _ = grouped_delta(b, c, lv); g = byte_counts(b)
    best = 9
    for _ in range(3):
        base = b.copy(); t = time.perf_counter(); out = undo_regrouped_delta(diff, base, lv, in_place=True, groups=g); best = min(best, time.perf_counter() - t)
    assert np.array_equal(out, c)
    T[lv] += (b.size, best)
for lv, (n, t) in sorted(T.items()):
    if n > 1e6: print(f"L{lv:3d} {n/1e6:6.1f} M undo {t:.3f} s ({1e9*t/n:.2f} ns a value)")
