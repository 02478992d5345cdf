# session 48: a pure-bf16 124M keyframe (bench_scale model after one step), RUNS times: its peak extra memory (bench_scale measure), the resident set every 50 ms (x the checkpoint / malloc free x), the trims, and when the large optimizer tensors were made; ALLOW=<share> replaces SAVE_ALLOWANCE where the code reads it from the compressor (before session 48)
import os, sys, time, gc, threading, ctypes, tempfile
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import CONFIG, SIZES, fresh, train_step, flat, measure, _rss
from hf_dynaquant import Compressor
import hf_dynaquant.training.compressor as C
import hf_dynaquant.core.memory as M
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.bfloat16); train_step(model, opt, 0)
ckpt = sum(t.numel() * t.element_size() for t in flat(model, opt).values())
marks = []; T0 = [0]
def mark(name, f):
    def g(*a, **k):
        marks.append((time.perf_counter() - T0[0], name + " start")); r = f(*a, **k); marks.append((time.perf_counter() - T0[0], name + " end")); return r
    return g
C.encode_optimizer_state = mark("decisions", C.encode_optimizer_state)
C.write_planned = mark("write", C.write_planned)
trims = []
import hf_dynaquant.training.optimizer_state as O
made = []
ot, os_ = O._Moment.target, O._Moment.scale_source
def tg(self):
    r = ot(self); made.append((time.perf_counter() - T0[0], "u", r.numel())); return r
def ss(self):
    r = os_(self); made.append((time.perf_counter() - T0[0], "s", r.numel())); return r
O._Moment.target, O._Moment.scale_source = tg, ss
orig_trim = M.release_freed
def rf(*a, **k):
    trims.append(time.perf_counter() - T0[0]); return orig_trim(*a, **k)
M.release_freed = rf
C.SAVE_ALLOWANCE = float(os.environ.get("ALLOW", "0.5"))
for run in range(int(os.environ.get("RUNS", "3"))):
    d = tempfile.mkdtemp(dir="/dev/shm")
    comp = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
    samples = []; stop = [False]
    class MI(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
    def sampler():
        while not stop[0]:
            mi = libc.mallinfo2(); samples.append((time.perf_counter() - T0[0], _rss()[0], mi.fordblks, mi.uordblks + mi.hblkhd)); time.sleep(0.004)
    marks.clear(); trims.clear(); made.clear()
    def go():
        T0[0] = time.perf_counter(); th = threading.Thread(target=sampler); th.start()
        comp.compress(1); stop[0] = True; th.join()
    s, peak, _, cpu = measure(go)
    base = samples[0][1]
    top = max(samples, key=lambda x: x[1])
    print(f'    at the peak: malloc free (retained) {top[2]/ckpt:.2f}x, malloc in use {top[3]/ckpt:.2f}x (of the checkpoint)')
    print(f"run {run}: keyframe {s:.2f} s, peak {peak/ckpt:.2f}x (sampled max {(top[1]-base)/ckpt:.2f}x at {top[0]:.3f} s), trims {len(trims)}")
    print("   ", " | ".join(f"{t:.3f} {m}" for t, m in marks))
    big = [(t, k, n) for t, k, n in made if n > 2_000_000 and t > 0.3]
    print("    made (>2M, in the write):", " ".join(f"{t:.2f}{k}{n/1e6:.0f}M" for t, k, n in big[:40]))
    # RSS every 50 ms
    print("   ", " ".join(f"{x[0]:.2f}:{(x[1]-base)/ckpt:.2f}/f{x[2]/ckpt:.2f}" for x in samples[::12]))
    import shutil; shutil.rmtree(d)
