# Log: chain_anchored_sizes_s40.log. # session 40: how large is a delta of entry j on entry i (i < j) of a 124M chain (bench_chain's setup)? Estimated
# per tensor as the codec weighs it: min(ans_bytes of the grouped delta (one a symbol), the codes' order-0 entropy),
# summed over the tensors whose records are dynaquant codes. The diagonal (i = j - 1) is today's chain.
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from bench_scale import CONFIG, SIZES, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.store.store import CheckpointStore
from hf_dynaquant.codecs.dynaquant import QuantState
from hf_dynaquant.core.delta import grouped_delta, current_counts
from hf_dynaquant.core.entropy import ans_bytes, entropy_bits

N = 10
config = GPT2Config(**SIZES["124M"])
torch.manual_seed(0)
model, opt = fresh(config, torch.float32)
train_step(model, opt, 0)
folder = Path(tempfile.mkdtemp())
store_path = folder / "s"
c = Compressor(model, store_path, CONFIG, optimizer=opt, keyframe_every=N)
stored = []
for i in range(N):
    step = 1 + 2 * i
    if i:
        train_step(model, opt, step - 1); train_step(model, opt, step)
    c.compress(step)
store = CheckpointStore(store_path)
ids = list(reversed(store.chain(f"step-{1 + 2 * (N - 1)}")))
print("chain", len(ids))
codes = []
for e in ids:
    r = store.open(e)
    mine = {}
    for section, name, rec in r.tensor_records():
        if rec.get("codec") != "dynaquant":
            continue
        st = r.state(section, name)
        st = st.unpacked() if hasattr(st, "unpacked") else st
        if isinstance(st, QuantState) and not st.trellis:
            mine[(section, name)] = (st.codes.copy(), st.levels)
    r.close()
    codes.append(mine)
    print("read", e[:8], len(mine), flush=True)
M = np.zeros((N, N))
for j in range(1, N):
    for i in range(j):
        total = 0.0
        for key, (cur, lv) in codes[j].items():
            if key not in codes[i]:
                continue
            prev, lp = codes[i][key]
            if prev.size != cur.size:
                continue
            levels = max(lv, lp)
            _, pairs = grouped_delta(prev, cur, levels)
            total += min(ans_bytes(pairs), entropy_bits(current_counts(pairs, levels)) / 8)
        M[i, j] = total / 1e6
    print(f"entry {j}: " + " ".join(f"on {i}: {M[i, j]:.1f}" for i in range(j)), flush=True)
key = sum(entropy_bits(np.bincount(cc, minlength=256)) / 8 for cc, _ in codes[0].values()) / 1e6
print(f"keyframe codes' entropy {key:.1f} MB")
np.save("/tmp/s40/drift.npy", M)
