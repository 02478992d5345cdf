import sys, statistics as st, re
rows = {}
for line in open(sys.argv[1]):
    if "keyframe, deltas" not in line: continue
    v = line.split()[0]; vals = [tuple(map(float, x.split("/"))) for x in line.split(":")[1].split()]
    rows.setdefault(v, []).append(vals)
for v, rs in rows.items():
    k = [r[0][0] for r in rs]; d = [x[0] for r in rs for x in r[1:]]; kc = [r[0][1] for r in rs]; dc = [x[1] for r in rs for x in r[1:]]
    ratio = [st.mean(x[0] for x in r[1:]) / r[0][0] for r in rs]
    print(f"{v}: keyframe median {st.median(k):.2f} s ({min(k):.2f}-{max(k):.2f}), CPU {st.median(kc):.2f}; delta median {st.median(d):.2f} s ({min(d):.2f}-{max(d):.2f}), CPU {st.median(dc):.2f}; delta/keyframe per process {min(ratio):.2f}-{max(ratio):.2f} (median {st.median(ratio):.2f})")
