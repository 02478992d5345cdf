# session 48: one thread, the Adam-scale codes of a 124M keyframe (bench_scale's model after one step, captured once to /tmp/scale_codes_<DTYPE>.npz): the factored grouping and its undoing, ns a code; run with PYTHONPATH set to the code to time
import os, sys, time, gc, pickle
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main/benchmarks/out")
import numpy as np
DTYPE = os.environ.get("DTYPE", "float32")  # bfloat16: the pure-bf16 model's scales (finer grid, more contexts)
cap = f"/tmp/scale_codes_{DTYPE}.npz"
if not os.path.exists(cap):
    from bench_scale import CONFIG, train_step
    import hf_dynaquant.codecs.dynaquant as D
    from hf_dynaquant import Compressor
    got = []
    orig = D._Factored.tried.__func__
    def tried(cls, state):
        r = orig(cls, state)
        if r is not None: got.append((state.codes.copy(), state.shape, state.levels))
        return r
    D._Factored.tried = classmethod(tried)
    import tempfile, torch
    from bench_scale import SIZES, fresh
    from transformers import GPT2Config
    torch.manual_seed(0)
    model, opt = fresh(GPT2Config(**SIZES["124M"]), getattr(torch, DTYPE))
    train_step(model, opt, 0)
    d = tempfile.mkdtemp(dir="/dev/shm")
    Compressor(model, os.path.join(d, "k"), CONFIG, optimizer=opt).compress(1)
    np.savez(cap, **{f"c{i}": g[0] for i, g in enumerate(got)}, shapes=np.array([g[1][:2] for g in got]), levels=np.array([g[2] for g in got]))
    print("captured", len(got))
z = np.load(cap)
from hf_dynaquant.core.factored import FactoredContexts, context_count, factored_terms
from hf_dynaquant.core.delta import grouped_delta, undo_regrouped_delta
shapes, levels = z["shapes"], z["levels"]
items = [(z[f"c{i}"], tuple(shapes[i]), int(levels[i])) for i in range(len(shapes))]
n = sum(c.size for c, _, _ in items)
prepared = []
for codes, (rows, cols), lv in items:
    B = context_count(lv); base = FactoredContexts(factored_terms(codes, rows), rows, codes.size // rows, B)
    prepared.append((codes, base, B))
import inspect
takes_factored = "FactoredContexts" in str(inspect.signature(undo_regrouped_delta))  # (else the old reader: contexts made whole)
for rep in range(5):
    t = time.perf_counter(); outs = [grouped_delta(b, c, B) for c, b, B in prepared]; g = time.perf_counter() - t
    t = time.perf_counter()
    for (c, b, B), (gr, pairs) in zip(prepared, outs):
        back = undo_regrouped_delta(gr, b if takes_factored else b.unpacked(), B, in_place=True)
    u = time.perf_counter() - t
    print(f"{len(items)} tensors {n/1e6:.1f}M codes: group {g:.3f} s ({g/n*1e9:.2f} ns/code), ungroup {u:.3f} s ({u/n*1e9:.2f} ns/code)")
