# session 39: decode speed of one 124M delta's rANS streams at 8 lanes (today) and re-encoded at 32 lanes (the
# prototype in rans_decoder_avx512_prototype_s39.c, built in a scratch copy of the package: PYTHONPATH=<copy>), vector
# decoder and plain loops (native.allow_simd), ns a symbol, by stream kind; the same symbols checked. The streams:
# /tmp/s39/payloads.pkl, one 124M delta's (bench_scale's setup) payloads as the codec coded them, with their group
# sizes and lanes. Log: rans_decoder_lanes32_s39.log.
import pickle
import sys
import time

import numpy as np

from hf_dynaquant.core.ans import ans_decode, ans_encode
from hf_dynaquant.core.kernels import native

print(native.__file__, file=sys.stderr)
items = pickle.load(open("/tmp/s39/payloads.pkl", "rb"))
res: dict = {}
sizes = {8: 0, 32: 0}
for coding, levels, payload, m, g, lanes in items:
    if lanes != 8:
        continue
    sym = ans_decode(payload, m, g, lanes)
    p32 = ans_encode(sym, g, 32)
    sizes[8] += len(payload)
    sizes[32] += len(p32)
    kind = "pairs" if coding.endswith("pairs") else f"single k<={16 if levels <= 16 else 64}"
    for name, (pl, n_lanes) in {"8": (payload, 8), "32": (p32, 32)}.items():
        for simd in (True, False):
            native.allow_simd(simd)
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                out = ans_decode(pl, m, g, n_lanes)
                best = min(best, time.perf_counter() - t0)
            assert np.array_equal(out, sym)
            res[(kind, name, simd)] = res.get((kind, name, simd), 0.0) + best
    res[(kind, "n")] = res.get((kind, "n"), 0) + m
native.allow_simd(True)
for kind in sorted({k[0] for k in res}):
    n = res[(kind, "n")]
    ns = {key: res[(kind,) + key] * 1e9 / n for key in [("8", False), ("8", True), ("32", True), ("32", False)]}
    print(
        f"{kind:14} {n / 1e6:6.1f}M symbols: 8 lanes plain {ns['8', False]:.2f} "
        f"(vector = plain: {ns['8', True]:.2f}) ns; "
        f"32 lanes vector {ns['32', True]:.2f}, plain {ns['32', False]:.2f} ns"
    )
print("bytes", sizes)
