import time, numpy as np
from hf_dynaquant.core.kernels import native
rng = np.random.default_rng(0); n = 32 << 20
pairs = np.empty(65536, dtype=np.int64); out = np.empty(n, dtype=np.uint8)
print("keys changed  sparse  loop  (ns a value, best of 5)")
for keys, p in ((3, .1), (15, .1), (15, .33), (16, .1), (4, .013)):
    prev = rng.integers(0, keys, n).astype(np.uint8)
    cur = np.where(rng.random(n) < p, rng.integers(0, keys, n).astype(np.uint8), prev)
    r = []
    for simd in (True, False):
        native.allow_simd(simd); best = 1e9
        for _ in range(5):
            t = time.perf_counter(); native.cyclic_u8(prev, cur, keys, out, pairs); best = min(best, time.perf_counter() - t)
        r.append(best / n * 1e9)
    native.allow_simd(True)
    print(f"{keys:4d} {p:7.3f} {r[0]:6.2f} {r[1]:6.2f}")
