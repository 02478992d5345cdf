import sys, tempfile, collections
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
import hf_dynaquant.codecs.dynaquant as dq
orig = dq.grouped_delta
rec = []
def wrapped(prev, cur, levels):
    g, pairs = orig(prev, cur, levels)
    n = cur.size; changed = 1 - pairs[:, 0].sum() / n
    rec.append((type(prev).__name__, int(levels), n, float(changed)))
    return g, pairs
dq.grouped_delta = wrapped
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
c = Compressor(model, tempfile.mkdtemp(dir="/dev/shm"), CONFIG, optimizer=opt); c.compress(1)
train_step(model, opt, 1); train_step(model, opt, 2)
rec.clear(); c.compress(3)
by = collections.defaultdict(lambda: [0, 0.0])
for t, lv, n, ch in rec:
    k = (t, lv <= 16); by[k][0] += n; by[k][1] += n * ch
tot = sum(v[0] for v in by.values())
for k, (n, w) in sorted(by.items()): print(k, f"{n/1e6:.1f}M values ({n/tot:.0%}), changed {w/n:.1%}")
hist = np.histogram([ch for *_, ch in rec], bins=[0, .05, .1, .2, .33, .5, 1.01], weights=[n for _, _, n, _ in rec])
print("changed-share histogram (values):", [f"{a:.2f}-{b:.2f}: {h/1e6:.1f}M" for a, b, h in zip(hist[1], hist[1][1:], hist[0])])
