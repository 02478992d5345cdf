import sys, glob, re, statistics
sys.path.insert(0, 'benchmarks')
import bench_transfer as b
def arm(files, name):
    out = {}
    for f in files:
        for s, a in re.findall(rf"seed (\d+) {name}\s*: accuracy ([0-9.]+)", open(f).read()):
            out[int(s)] = round(float(a) * 600) / 600
    return out
km = arm(sorted(glob.glob('benchmarks/out/transfer_s1*.log')), 'dynaquant')
tcq = arm(['benchmarks/out/transfer_s30.log', 'benchmarks/out/transfer_s30_b.log'], 'dynaquant')
common = sorted(set(km) & set(tcq))
d = [tcq[s] - km[s] for s in common]
m, h = b.paired_interval(d)
print(f"TCQ default (11.49x) - K-means default (11.14x), paired over {len(common)} seeds: {100*m:+.2f} ± {100*h:.2f} points")
