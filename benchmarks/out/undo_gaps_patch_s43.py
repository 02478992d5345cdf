# session 43: a gaps delta undone as a restore does: ungap then undo_regrouped_delta in place (before) against undo_gaps in place (the base patched), by level count, single thread, best of 3, the captured 124M delta
import time, numpy as np, collections
from hf_dynaquant.core.delta import grouped_delta, gap_up, ungap, undo_regrouped_delta, undo_gaps
from hf_dynaquant.core.histogram import byte_counts
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
T = collections.defaultdict(lambda: np.zeros(3))
for i in range(len(L)):
    b, c, lv = z[f"b{i}"], z[f"c{i}"], int(L[i])
    diff, pairs = grouped_delta(b, c, lv)
    if pairs[:, 1:].sum() > diff.size / 8: continue
    s, h, tc = gap_up(diff, pairs)
    g = byte_counts(b); sizes = np.zeros(lv, np.int64); sizes[: g.size] = g
    old = new = 9
    for _ in range(3):
        base = b.copy(); t0 = time.perf_counter()
        out = undo_regrouped_delta(ungap(s, tc, sizes, lv), base, lv, in_place=True, groups=g); t1 = time.perf_counter()
        assert np.array_equal(out, c)
        base = b.copy(); t2 = time.perf_counter()
        out = undo_gaps(s, tc, sizes, lv, base, in_place=True); t3 = time.perf_counter()
        assert np.array_equal(out, c) and out is base
        old, new = min(old, t1 - t0), min(new, t3 - t2)
    T[lv] += (b.size, old, new)
for lv, v in sorted(T.items()):
    print(f"L{lv:3d} {v[0]/1e6:6.1f} M values: ungap + undo {v[1]:.4f} s ({1e9*v[1]/v[0]:.2f} ns a value), undo_gaps {v[2]:.4f} s ({1e9*v[2]/v[0]:.2f} ns)")
tot = sum(T.values()); print(f"all {tot[0]/1e6:.1f} M: {tot[1]:.4f} s against {tot[2]:.4f} s")
