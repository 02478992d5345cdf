# session 37: 124M fp32 keyframe, delta (two steps on) and restore, one process per line, alternating the session-start code (vO, fd40992) and the committed change (vN, 7337b3d); the same entry id (c1a4d4) from both, so the same bytes
# usage: copy each version's hf_dynaquant (C kernels built) to /tmp/s37/<v>/, then: for r in 1..N; for v in vO vN: TAG=$v PYTHONPATH=/tmp/s37/$v python benchmarks/out/keyframe_delta_restore_s37.py
# wall and CPU of a 124M keyframe and delta (bench_scale's setup), for A/B in alternating processes
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
dtype = torch.bfloat16 if os.environ.get("DTYPE") == "bf16" else torch.float32
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), dtype)
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/tmp")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
out = []
for kind, step in (("keyframe", 1), ("delta", 3)):
    if step == 3:
        train_step(model, opt, 1); train_step(model, opt, 2)
    gc.collect(); time.sleep(0.3)
    t0 = time.perf_counter(); c0 = time.process_time()
    c.compress(step)
    out.append(f"{kind} {time.perf_counter()-t0:.3f} cpu {time.process_time()-c0:.2f}")
m3, o3 = fresh(GPT2Config(**SIZES["124M"]), dtype)
reader = Compressor(m3, os.path.join(d, "s"), optimizer=o3)
gc.collect(); time.sleep(0.3)
t0 = time.perf_counter(); c0 = time.process_time()
reader.restore(3)
out.append(f"restore {time.perf_counter()-t0:.3f} cpu {time.process_time()-c0:.2f}")
print(os.environ.get("TAG", "?"), " | ".join(out), "size", c.last_report.entry[:6], flush=True)
shutil.rmtree(d)
