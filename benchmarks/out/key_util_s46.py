# session 46: CPU utilisation over a 124M fp32 keyframe (DELTA=1: the delta after the step-1 keyframe), with phase marks;
# PERF="<perf record options>" (e.g. "-F 2000", or "-e page-faults -c 16 --call-graph dwarf,4096") also records the save with perf into OUT
import os, sys, time, shutil, gc, threading, subprocess, signal
sys.path.insert(0, "/work/main/benchmarks")
from bench_scale import CONFIG, train_step
from s46_first_keyframe import first_keyframe
from hf_dynaquant import Compressor
import hf_dynaquant.training.compressor as C
from hf_dynaquant.core.memory import release_freed
model, opt, d, c = first_keyframe()
train_step(model, opt, 100); train_step(model, opt, 200)
if not os.environ.get("DELTA"):
    c = Compressor(model, os.path.join(d, "k"), CONFIG, optimizer=opt)
marks = []
def mark(name, f):
    def g(*a, **k):
        marks.append((time.perf_counter(), name + " start")); r = f(*a, **k); marks.append((time.perf_counter(), name + " end")); return r
    return g
C.encode_optimizer_state = mark("optimizer decisions", C.encode_optimizer_state)
C.Compressor.plan_snapshot = mark("plan_snapshot", C.Compressor.plan_snapshot)
C.write_planned = mark("write_planned", C.write_planned)
gc.collect(); release_freed(); time.sleep(0.2)
samples = []; stop = [False]
def sampler():
    while not stop[0]:
        samples.append((time.perf_counter(), time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID))); time.sleep(0.02)
th = threading.Thread(target=sampler); th.start()
perf = None
if os.environ.get("PERF") is not None:
    perf = subprocess.Popen(["perf", "record", *os.environ["PERF"].split(), "-p", str(os.getpid()), "-o", os.environ.get("OUT", "/tmp/perf.data")], stderr=subprocess.DEVNULL)
    time.sleep(1.0)
t0 = time.perf_counter(); cpu0 = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
c.compress(3)
t1 = time.perf_counter(); cpu1 = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
stop[0] = True; th.join()
if perf is not None:
    perf.send_signal(signal.SIGINT); perf.wait()
print(f"save {t1-t0:.3f} s, CPU {cpu1-cpu0:.3f} s")
for t, m in marks: print(f"  {t-t0:6.3f} {m}")
# utilisation per 100 ms
w = 0.1; b = 0
pts = [(t - t0, c - cpu0) for t, c in samples]
import bisect
ts = [p[0] for p in pts]
x = 0.0
while x < t1 - t0:
    i = bisect.bisect_left(ts, x); j = bisect.bisect_left(ts, x + w)
    if j >= len(pts): j = len(pts) - 1
    if j > i: print(f"  {x:5.2f}-{x+w:5.2f}: {(pts[j][1]-pts[i][1])/(pts[j][0]-pts[i][0]):4.2f} cores")
    x += w
shutil.rmtree(d)
