# session 46: per large tensor of a 124M fp32 delta: the delta's estimated bytes against the keyframe's payload and order-0 entropy, and what was kept
import sys, shutil
sys.path.insert(0, "/work/main/benchmarks")
from bench_scale import train_step
from s46_first_keyframe import first_keyframe
import hf_dynaquant.codecs.dynaquant as dq
from hf_dynaquant.core.delta import grouped_delta, current_counts
from hf_dynaquant.core.entropy import entropy_bits, ans_bytes
rows = []
orig = dq.DynaQuantCodec._encode_state
def enc(self, state, base, extra):
    r = orig(self, state, base, extra)
    n = state.codes.size
    if n >= 1_000_000 and base is not None:
        prev = base.packed if isinstance(base, dq.KeptState) else base.codes
        levels = max(base.levels, state.levels)
        _, pairs = grouped_delta(prev, state.codes, levels)
        est = ans_bytes(pairs); kb = entropy_bits(current_counts(pairs, levels)) / 8
        rows.append((self.plan.layer_type, n, state.levels, est, kb, r.params["mode"], sum(len(b) for b in r.blobs.values())))
    return r
dq.DynaQuantCodec._encode_state = enc
model, opt, d, c = first_keyframe()
for step in (3, 4):
    rows.clear()
    train_step(model, opt, step * 100)
    if step == 3: train_step(model, opt, 777)
    c.compress(step)
    import collections
    agg = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0, collections.Counter()])
    for lt, n, lev, est, kb, mode, stored in rows:
        a = agg[(lt, lev)]; a[0] += 1; a[1] += n; a[2] += est; a[3] += kb; a[4] += stored; a[5][mode] += 1
    print(f"delta at step {step}:")
    for k, (cnt, n, est, kb, stored, modes) in sorted(agg.items()):
        print(f"  {k}: {cnt} tensors, {n/1e6:.1f}M values, delta estimate {est/1e6:.2f} MB, keyframe entropy {kb/1e6:.2f} MB, ratio {est/kb:.2f}, stored {stored/1e6:.2f} MB, kept {dict(modes)}")
    ratios = sorted(est / kb for lt, n, lev, est, kb, mode, stored in rows if mode == "keyframe")
    if ratios: print(f"  keyframe-kept tensors: delta/entropy ratio {ratios[0]:.2f}..{ratios[-1]:.2f}")
    ratios = sorted(est / kb for lt, n, lev, est, kb, mode, stored in rows if mode == "delta")
    if ratios: print(f"  delta-kept tensors: delta/entropy ratio {ratios[0]:.2f}..{ratios[-1]:.2f}")
shutil.rmtree(d)
