# session 45: per-thread CPU in 50 ms bins over a 124M fp32 delta (keyframe at step 1, two steps, delta at step 3), with each thread's place
import os, sys, time, tempfile, shutil, gc, threading, collections
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
from hf_dynaquant.core.memory import release_freed
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
rec = []; stop = threading.Event()
def where(frame):
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if "hf_dynaquant" in fn:
            return f"{fn.split('hf_dynaquant/')[-1]}:{f.f_code.co_name}"
        f = f.f_back
    return "-"
def sampler():
    me = threading.get_ident(); clocks = {}
    while not stop.is_set():
        t = time.perf_counter(); frames = sys._current_frames(); row = {}
        for th in threading.enumerate():
            if th.ident == me or th.ident not in frames: continue
            try:
                cid = clocks.setdefault(th.ident, time.pthread_getcpuclockid(th.ident)); cpu = time.clock_gettime(cid)
            except Exception: continue
            row[th.name] = (cpu, where(frames[th.ident]))
        rec.append((t, row)); time.sleep(0.002)
import hf_dynaquant.store.store as st
if int(os.environ.get("WORKERS", "0")): st._TENSOR_POOL.max_workers = int(os.environ["WORKERS"])
for i in range(2):
    d = tempfile.mkdtemp(dir="/dev/shm")
    c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
    c.compress(1)
    train_step(model, opt, 100 + i); train_step(model, opt, 200 + i)
    gc.collect(); release_freed(); time.sleep(0.2)
    if i == 1:
        rec.clear(); th = threading.Thread(target=sampler, daemon=True); th.start(); time.sleep(0.05)
    t0 = time.perf_counter(); c.compress(3); t1 = time.perf_counter()
    print(f"delta {t1-t0:.2f} s", flush=True)
    if i == 1: stop.set(); th.join()
    shutil.rmtree(d)
prev = {}; BIN = 0.05
bins = collections.defaultdict(lambda: collections.defaultdict(float)); place = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
for t, row in rec:
    b = int((t - t0) / BIN)
    for k, (cpu, w) in row.items():
        if k in prev and t0 - 0.01 <= t <= t1 + 0.02:
            bins[b][k] += cpu - prev[k]; place[b][k][w] += 1
        prev[k] = cpu
names = sorted({k for b in bins for k, v in bins[b].items() if v > 0.001})
print("bin  total | " + " ".join(f"{n[:12]:>12}" for n in names))
for b in sorted(bins):
    tot = sum(bins[b].values()) / BIN
    print(f"{b*BIN:4.2f} {tot:5.2f} | " + " ".join(f"{bins[b][n]/BIN:12.2f}" for n in names) + " | " + "; ".join(f"{n[:10]}:{place[b][n].most_common(1)[0][0][-28:]}" for n in names if bins[b][n] > 0.005 and place[b][n]))
