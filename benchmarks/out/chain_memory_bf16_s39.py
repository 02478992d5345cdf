# session 39: peak RssAnon / RssFile through a restore at the end of a 124M pure-bf16 chain of N entries (bench_scale setup,
# saves two steps apart, written once to /tmp/s39/chain_bf16_<N>); usage: N=2 or N=10 python chain_memory_bf16_s39.py
import os, sys, time, threading, gc
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
N = int(os.environ.get("N", "10"))
store = f"/tmp/s39/chain_bf16_{N}/s"
config = GPT2Config(**SIZES["124M"])
if not os.path.exists(store):
    torch.manual_seed(0)
    model, optimizer = fresh(config, torch.bfloat16)
    train_step(model, optimizer, 0)
    w = Compressor(model, store, CONFIG, optimizer=optimizer, keyframe_every=N)
    for k in range(N):
        if k:
            train_step(model, optimizer, 2 * k); train_step(model, optimizer, 2 * k + 1)
        w.compress(1 + 2 * k)
    del model, optimizer, w
def rss():
    d = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon", "RssFile", "VmRSS")):
            k, v = line.split(":"); d[k] = int(v.split()[0]) * 1024
    return d
m, o = fresh(config, torch.bfloat16)
reader = Compressor(m, store, optimizer=o)
gc.collect(); time.sleep(0.2)
base = rss(); peak = dict(base); stop = [False]
def sample():
    while not stop[0]:
        r = rss()
        for k in r: peak[k] = max(peak[k], r[k])
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
reader.restore(1 + 2 * (N - 1))
stop[0] = True; t.join()
ck = 747e6
print(N, "entries:", " ".join(f"{k} +{(peak[k] - base[k]) / ck:.2f}x" for k in ("VmRSS", "RssAnon", "RssFile")))
