# session 41: in a 124M fp32 chain (bench_chain's setup, 10 saves two steps apart), each delta's sizes as the encoder weighs them
# (one delta a symbol, pairs, gaps) and which it chose, as chain_build_s40.py writes it; then what a slack for pairs (kept when within s of the smallest) would cost in bytes
# and how many rANS symbols it would take off a restore's replay
import runpy, collections
from pathlib import Path
import numpy as np
import hf_dynaquant.codecs.dynaquant as dq
from hf_dynaquant.core.delta import pair_up, gap_up, PAIRED_LEVELS
from hf_dynaquant.core.entropy import ans_bytes
from hf_dynaquant.core.varint import length_prefixed, uleb128_encode
rows = []
orig = dq._delta_payload
def spy(prev, delta, coding, pairs, estimate):
    out = orig(prev, delta, coding, pairs, estimate)
    levels = pairs.shape[0]; n = delta.size
    sizes = {"": estimate}
    if levels <= PAIRED_LEVELS:
        s, h = pair_up(delta, pairs.sum(axis=1), levels); sizes["pairs"] = ans_bytes(h)
    if int(pairs[:, 1:].sum()) <= dq._GAP_SHARE * n:
        s, h, tc = gap_up(delta, pairs)
        sizes["gaps"] = ans_bytes(h) + len(length_prefixed(uleb128_encode(tc.astype(np.uint64)).tobytes()))
    rows.append((levels, n, int(pairs[:, 1:].sum()), sizes, out[0].partition(":")[2]))
    return out
dq._delta_payload = spy
runpy.run_path(str(Path(__file__).with_name("chain_build_s40.py")))  # the chain, with the spy in place
chosen_bytes = 0.0
for s in (0.0, 0.01, 0.02, 0.03, 0.05, 0.1):
    total = 0.0; syms = 0; switched = 0
    for levels, n, changed, sizes, kind in rows:
        k = kind or ""
        if k == "gaps":
            total += sizes["gaps"]; syms += None or 0; continue
        best = min(sizes[""], sizes.get("pairs", np.inf))
        if "pairs" in sizes and sizes["pairs"] <= (1 + s) * best:
            total += sizes["pairs"]; syms += n // 2 + 1; switched += k != "pairs"
        else:
            total += sizes[k]; syms += n if k == "" else n // 2
    print(f"pair slack {s:.2f}: delta bytes {total / 1e6:.2f} MB, rANS symbols of non-gap deltas {syms / 1e6:.1f}M, tensors switched to pairs {switched}")
by = collections.Counter(); gap = collections.Counter()
for levels, n, changed, sizes, kind in rows:
    if "pairs" in sizes and kind == "":
        by[round(100 * (sizes["pairs"] / sizes[""] - 1))] += n
print("values of '' deltas by pairs' excess in %:", sorted(by.items())[:40])
