# session 40: decode and encode time of one delta, today's coding ('now': one delta a symbol, pairs where tried)
# against a coding forced on it: "gaps" (this commit's, GAP_ESCAPE 31; log delta_gaps_decode_s40.log) or "flags"
# (the prototype in delta_change_flags_s40.diff, applied to c5ac5dd; log delta_change_flags_decode_s40.log).
# Synthetic deltas of 2,359,296 values (768 x 3072), iid changes of one level; best of 7, alternating; ns a value.
# Usage: python delta_coding_decode_s40.py [gaps|flags]
import sys
import time

import numpy as np

import hf_dynaquant.codecs.dynaquant as dq
from hf_dynaquant.core.delta import grouped_delta
from hf_dynaquant.core.entropy import ans_bytes

coding = sys.argv[1] if len(sys.argv) > 1 else "gaps"
share_name, slack_name = {"gaps": ("_GAP_SHARE", "_GAP_SLACK"), "flags": ("_FLAG_SHARE", "_FLAG_SLACK")}[coding]


def use(name: str) -> None:
    """Today's coding (the other never tried), or the other always kept."""
    setattr(dq, share_name, -1.0 if name == "now" else 1.0)
    setattr(dq, slack_name, 0.01 if name == "now" else 1e9)


rng = np.random.default_rng(0)
n = 2_359_296
print(f"levels share | now coding, ns/value decode, encode | {coding} ns/value decode, encode | bytes {coding}/now")
for levels in (4, 10, 13, 34):
    for share in (0.017, 0.05, 0.1, 0.2, 0.3):
        prev = np.clip(rng.normal(levels / 2, levels / 6, n), 0, levels - 1).astype(np.uint8)
        cur = np.where(rng.random(n) < share, (prev + rng.choice([1, levels - 1], n)) % levels, prev).astype(np.uint8)
        g, pairs = grouped_delta(prev, cur, levels)
        est = ans_bytes(pairs)
        enc = {}
        for name in ("now", coding):
            use(name)
            enc[name] = dq._delta_payload(prev, g, "ans", pairs, est)
        best = {k: [1e9, 1e9] for k in enc}
        for _ in range(7):
            for name in ("now", coding):
                use(name)
                t = time.perf_counter()
                dq._delta_payload(prev, g, "ans", pairs, est)
                best[name][1] = min(best[name][1], time.perf_counter() - t)
                stream, payload, size = enc[name]
                params = {"delta_coding": "ans", "delta_stream": [stream, size], "delta_levels": levels}
                p = prev.copy()
                t = time.perf_counter()
                out = dq._undo_delta(p, np.frombuffer(payload, np.uint8), params, n, "x")
                best[name][0] = min(best[name][0], time.perf_counter() - t)
        assert np.array_equal(out, cur)
        a, b = enc["now"], enc[coding]
        print(f"{levels:3d} {share:.3f} | {a[0]:10} {best['now'][0] * 1e9 / n:.2f} {best['now'][1] * 1e9 / n:.2f} | "
              f"{b[0]:10} {best[coding][0] * 1e9 / n:.2f} {best[coding][1] * 1e9 / n:.2f} | {len(b[1]) / len(a[1]):.4f}")  # fmt: skip
