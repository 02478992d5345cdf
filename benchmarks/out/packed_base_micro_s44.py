import time, numpy as np, sys
from hf_dynaquant.core.delta import grouped_delta
from hf_dynaquant.core.bitplanes import PackedCodes, pack_bits
rng = np.random.default_rng(0)
for n, levels in ((2_359_296, 11), (38_597_376, 15)):
    prev = rng.integers(0, levels, n).astype(np.uint8)
    cur = np.where(rng.random(n) < 0.05, rng.integers(0, levels, n), prev).astype(np.uint8)
    packed = PackedCodes(pack_bits(prev, 4), 4, 0, n)
    def best(f, k=7):
        ts = []
        for _ in range(k):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        return min(ts) / n * 1e9, sorted(ts)[k // 2] / n * 1e9
    print(n, levels, "unpacked warm %.3f/%.3f ns" % best(lambda: grouped_delta(prev, cur, levels)),
          "| packed %.3f/%.3f" % best(lambda: grouped_delta(packed, cur, levels)),
          "| unpack+grouped %.3f/%.3f" % best(lambda: grouped_delta(packed.unpacked(), cur, levels)))
