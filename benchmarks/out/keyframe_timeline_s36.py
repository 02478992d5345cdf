# session 36: each thread's CPU time and place sampled every 5 ms during the third of three 124M keyframes (DELTA=1: a delta after each keyframe, the third delta sampled instead); see keyframe_timeline_s36.log
import os, sys, time, tempfile, shutil, gc, threading, collections
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")]))
train_step(model, opt, 0)
rec = []
stop = threading.Event()
def where(frame):
    f = frame
    inner = None
    while f is not None:
        fn = f.f_code.co_filename
        if "hf_dynaquant" in fn:
            inner = f"{fn.split('hf_dynaquant/')[-1]}:{f.f_code.co_name}"
            break
        f = f.f_back
    return inner
def sampler():
    me = threading.get_ident()
    clocks = {}
    while not stop.is_set():
        t = time.perf_counter()
        frames = sys._current_frames()
        row = {}
        for th in threading.enumerate():
            if th.ident == me or th.ident not in frames:
                continue
            try:
                cid = clocks.setdefault(th.ident, time.pthread_getcpuclockid(th.ident))
                cpu = time.clock_gettime(cid)
            except Exception:
                continue
            row[th.name] = (cpu, where(frames[th.ident]))
        rec.append((t, row))
        time.sleep(0.005)
for i in range(3):
    d = tempfile.mkdtemp(dir="/tmp")
    c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
    gc.collect(); time.sleep(0.2)
    if i == 2:
        rec.clear(); th = threading.Thread(target=sampler, daemon=True); th.start(); time.sleep(0.05)
    t0 = time.perf_counter(); c0 = time.process_time()
    c.compress(1)
    t1 = time.perf_counter()
    print(f"keyframe {t1-t0:.2f} s cpu {time.process_time()-c0:.2f}", flush=True)
    if i == 2:
        stop.set(); th.join()
    if os.environ.get("DELTA"):
        train_step(model, opt, 1); train_step(model, opt, 2)
        gc.collect(); time.sleep(0.2)
        if i == 2:
            rec.clear(); stop.clear(); th = threading.Thread(target=sampler, daemon=True); th.start(); time.sleep(0.05)
        t0d = time.perf_counter(); c.compress(3); t1d = time.perf_counter()
        print(f"delta {t1d-t0d:.2f}", flush=True)
        if i == 2: t0, t1 = t0d, t1d
        if i == 2: stop.set(); th.join()
    shutil.rmtree(d)
# bins of 50 ms: busy cores (sum of cpu deltas / bin) and each thread's dominant place
prev = {}
bins = collections.defaultdict(lambda: [0.0, collections.Counter()])
for t, row in rec:
    if t < t0 - 0.01 or t > t1 + 0.05: 
        for k, (cpu, w) in row.items(): prev[k] = cpu
        continue
    b = int((t - t0) / 0.1)
    for k, (cpu, w) in row.items():
        if k in prev:
            dc = cpu - prev[k]
            bins[b][0] += dc
            if dc > 0.001: bins[b][1][(k[:14], w)] += dc
        prev[k] = cpu
for b in sorted(bins):
    busy, places = bins[b]
    top = ", ".join(f"{k[0]}@{(k[1] or '-')[-45:]} {v*1000:.0f}" for k, v in places.most_common(3))
    print(f"{b*0.1:4.1f}s cores {busy/0.1:4.2f} | {top}")
