# session 46: a 124M fp32 keyframe's codes: stored payload against the codes' order-0 entropy, by kind and coding
import sys, shutil, collections
sys.path.insert(0, "/work/main/benchmarks")
from s46_first_keyframe import first_keyframe
import hf_dynaquant.codecs.dynaquant as dq
from hf_dynaquant.core.entropy import entropy_bits
from hf_dynaquant.core.histogram import byte_counts
rows = []
orig = dq.DynaQuantCodec._encode_state
def enc(self, state, base, extra):
    r = orig(self, state, base, extra)
    if state.codes.size >= 65536:
        ent = entropy_bits(byte_counts(state.codes)) / 8
        pay = sum(len(b) for k, b in r.blobs.items() if not k.startswith("p."))
        rows.append((self.plan.layer_type, state.levels, r.params.get("mode"), r.params.get("codes_stream", [None])[0] if isinstance(r.params.get("codes_stream"), list) else r.params.get("codes_stream"), state.codes.size, ent, pay))
    return r
dq.DynaQuantCodec._encode_state = enc
model, opt, d, c = first_keyframe()
agg = collections.defaultdict(lambda: [0, 0, 0.0, 0])
for lt, lev, mode, coding, n, ent, pay in rows:
    a = agg[(lt, lev, mode, str(coding))]; a[0] += 1; a[1] += n; a[2] += ent; a[3] += pay
tot_e = tot_p = 0
for k, (cnt, n, ent, pay) in sorted(agg.items()):
    tot_e += ent; tot_p += pay
    print(f"{k}: {cnt} tensors, {n/1e6:.1f}M values, entropy {ent/1e6:.2f} MB, stored {pay/1e6:.2f} MB ({pay/ent:.3f}x)")
print(f"all: entropy {tot_e/1e6:.2f} MB, stored {tot_p/1e6:.2f} MB ({tot_p/tot_e:.3f}x)")
shutil.rmtree(d)
