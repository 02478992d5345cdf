# session 43: DynaQuantCodec._encode_state with base (delta save) against without (keyframe save), single thread, best of 2, summed by what the delta save did: the kept mode, whether it coded the delta and the keyframe, the delta's coding, levels
import time, numpy as np, collections
from hf_dynaquant.codecs import dynaquant as dq
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
codec = dq.DynaQuantCodec()
calls = collections.Counter()
orig_payload, orig_ecp = dq._delta_payload, dq.encode_codes_packed
def payload(*a, **k): calls["delta coded"] += 1; return orig_payload(*a, **k)
def ecp(*a, **k): calls["keyframe coded"] += 1; return orig_ecp(*a, **k)
dq._delta_payload, dq.encode_codes_packed = payload, ecp
def st(c, lv): return dq.QuantState(c, lv, np.zeros(max(lv - 3, 1), np.float32), np.zeros(0, np.uint16), "F32", c.shape)
S = collections.defaultdict(lambda: np.zeros(4))
for i in range(len(L)):
    lv = int(L[i]); b, c = st(z[f"b{i}"], lv), st(z[f"c{i}"], lv)
    tk = td = 9
    for _ in range(2):
        t = time.perf_counter(); codec._encode_state(c, None, {}); t1 = time.perf_counter()
        calls.clear(); e = codec._encode_state(c, b, {}); t2 = time.perf_counter()
        tk, td = min(tk, t1 - t), min(td, t2 - t1)
    what = "+".join(k.split()[0] for k in sorted(calls)) or "neither"
    kind = e.params.get("delta_stream", ["?"])[0].partition(":")[2] or ("plain" if e.params["mode"] == "delta" else "-")
    key = f"{e.params['mode']:8s} coded {what:14s} {kind:6s} L{lv}"
    S[key] += (1, c.codes.size, tk, td)
tot = np.zeros(4)
for k in sorted(S, key=lambda k: -(S[k][3] - S[k][2])):
    v = S[k]; tot += v
    print(f"{k:44s} tensors {int(v[0]):3d} {v[1]/1e6:6.1f} M  keyframe save {v[2]:.3f} s  delta save {v[3]:.3f} s  extra {v[3]-v[2]:+.3f}")
print(f"all: keyframe save {tot[2]:.3f} s, delta save {tot[3]:.3f} s")
