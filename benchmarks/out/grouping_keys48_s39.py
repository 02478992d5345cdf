# session 39: the delta's grouping (encode: grouped_delta) and its undoing (restore: undo_regrouped_delta, in place,
# given the base's histogram, as a restore calls it) at 10-64 groups, with the vector path's reach raised from 32 to 48
# groups (GROUP_SIMD_KEYS) and the byte counter's value-by-value path from below 32 to below 36 values (SMALL_SYMBOLS);
# 40M codes, 5% of them changed, best of three, ns a value; and the counting of 50M bytes whose largest is one below
# the count named, spread over their values or a delta's (98% one value).
# builds: "before" (32, 32), "after" (48, 36), "wider" (64, 48: what the limits were chosen against)
# usage: one process per build, alternating: PYTHONPATH=<build> python grouping_keys48_s39.py <tag>
import sys
import time

import numpy as np

from hf_dynaquant.core.delta import grouped_delta, undo_regrouped_delta
from hf_dynaquant.core.histogram import byte_counts

tag = sys.argv[1] if len(sys.argv) > 1 else "?"
rng = np.random.default_rng(0)
for keys in (10, 34, 48, 64):
    prev = rng.integers(0, keys, 40_000_000).astype(np.uint8)
    cur = np.where(rng.random(prev.size) < 0.95, prev, rng.integers(0, keys, prev.size)).astype(np.uint8)
    counts = byte_counts(prev)
    bg = bu = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        g, _ = grouped_delta(prev, cur, keys)
        bg = min(bg, time.perf_counter() - t0)
        base = prev.copy()
        t0 = time.perf_counter()
        undo_regrouped_delta(g, base, keys, in_place=True, groups=counts)
        bu = min(bu, time.perf_counter() - t0)
    print(f"{tag} {keys} groups: grouped_delta {bg * 1e9 / prev.size:.2f} ns, undo {bu * 1e9 / prev.size:.2f} ns")
for top in (34, 36, 48, 64):
    for share in (0.0, 0.98):
        x = np.where(rng.random(50_000_000) < share, 0, rng.integers(0, top, 50_000_000)).astype(np.uint8)
        x[0] = top - 1
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            byte_counts(x)
            best = min(best, time.perf_counter() - t0)
        print(f"{tag} count {top} values, {share:.0%} one value: {best * 1e9 / x.size:.3f} ns a byte")
