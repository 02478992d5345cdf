# session 43: per coding chosen, the keyframe's bytes against the delta's, and single-thread seconds of each, the captured 124M delta
import time, numpy as np, collections
from hf_dynaquant.codecs import dynaquant as dq
from hf_dynaquant.core.delta import grouped_delta
from hf_dynaquant.core.entropy import ans_bytes, encode_codes_packed
from hf_dynaquant.core.histogram import byte_counts
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
S = collections.defaultdict(lambda: np.zeros(5))
for i in range(len(L)):
    b, c, lv = z[f"b{i}"], z[f"c{i}"], int(L[i])
    t0 = time.perf_counter(); coding, kp, _ = encode_codes_packed(c, byte_counts(c, 256)); t1 = time.perf_counter()
    diff, pairs = grouped_delta(b, c, lv); sc, dp, _ = dq._delta_payload(b, diff, "ans", pairs, ans_bytes(pairs)); t2 = time.perf_counter()
    kind = (sc.partition(":")[2] or "plain") + f"/L{lv}"
    S[kind] += (1, c.size, len(kp), len(dp), 0); S[kind][4] += 0
    S[kind + " t"] = S.get(kind + " t", np.zeros(5)) + (0, 0, t1 - t0, t2 - t1, 0)
for k in sorted(k for k in S if not k.endswith(" t")):
    v, t = S[k], S[k + " t"]
    print(f"{k:12s} tensors {int(v[0]):3d} Mvalues {v[1]/1e6:6.1f} key MB {v[2]/1e6:6.2f} delta MB {v[3]/1e6:6.2f} (x{v[3]/v[2]:.2f})  key s {t[2]:.3f} delta s {t[3]:.3f}")
