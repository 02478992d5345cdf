# session 31: the 12x trellis snapshot (threshold 0.02) paired by seed against the original, session 17's K-means snapshot and session 30's trellis default; run from the repository root
import sys, glob
sys.path.insert(0, "benchmarks")
import bench_transfer as b
logs = [l for l in sorted(glob.glob("benchmarks/out/transfer_s1*.log")) if "merged" not in l]
orig, km = {}, {}
for l in logs:
    orig.update(b.read_arm(l, "original")); km.update(b.read_arm(l, "dynaquant"))
tcq = {}
for l in glob.glob("benchmarks/out/transfer_s31_[ab].log"):
    tcq.update(b.read_arm(l, "dynaquant"))
s30 = {}
for l in ["benchmarks/out/transfer_s30.log", "benchmarks/out/transfer_s30_b.log"]:
    s30.update(b.read_arm(l, "dynaquant"))
seeds = sorted(tcq)
for name, other in (("original", orig), ("K-means s17", km), ("TCQ default s30", s30)):
    d = [tcq[s] - other[s] for s in seeds]
    m, h = b.paired_interval(d)
    print(f"TCQ 12.03x - {name}: {100*m:+.2f} ± {100*h:.2f} points over {len(d)} seeds")
