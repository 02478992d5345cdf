# session 45: a 124M fp32 keyframe and delta: the payload header reserved against the one written, and the time the file's rewrite takes when the reservation is too large to keep
import os, sys, time, tempfile, shutil
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.store.safetensors_io as sio
log = []
orig_close, orig_rw = sio.StreamingWriter.close, sio.StreamingWriter._rewrite_with_header
def close(self, metadata=None):
    t = time.perf_counter(); r = orig_close(self, metadata); log.append(("close", r - 8 - self._offset, self._offset, time.perf_counter() - t)); return r
def rw(self, raw):
    t = time.perf_counter(); orig_rw(self, raw); log.append(("rewrite", len(raw), self._offset, time.perf_counter() - t))
sio.StreamingWriter.close, sio.StreamingWriter._rewrite_with_header = close, rw
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir=os.environ.get("DIR", "/dev/shm"))
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
for step in (1, 3, 5, 7, 9):
    if step > 1: train_step(model, opt, step - 1); train_step(model, opt, step)
    log.clear(); t = time.perf_counter(); c.compress(step); w = time.perf_counter() - t
    print(f"step {step}: save {w:.2f} s;", "; ".join(f"{k} {a/1e3:.0f} KB header, {b/1e6:.1f} MB data, {s*1e3:.0f} ms" for k, a, b, s in log))
shutil.rmtree(d)
