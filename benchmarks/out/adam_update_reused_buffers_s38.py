# session 38, measured and not kept: four 124M fp32 keyframes a process, Adam's update made into reused buffers (HACK=1: four buffers a size, round robin; the codes are only good for timing) or fresh (as shipped). Alternating processes; per keyframe seconds/CPU seconds.
# usage: for r in 1 2 3; do HACK= python adam_update_reused_buffers_s38.py; HACK=1 python adam_update_reused_buffers_s38.py; done
import os, sys, time, tempfile, shutil, gc
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.core.moments as mo
if os.environ.get("HACK"):
    cache = {}
    orig_empty = torch.empty
    def adam_update(m, v, eps):
        m, v = (t.detach().to("cpu").contiguous() for t in (m, v))
        key = m.numel()
        if key not in cache: cache[key] = [orig_empty(m.shape, dtype=torch.float32) for _ in range(4)]
        lst = cache[key]; out = lst.pop(0); lst.append(out); out = out.view(m.shape)
        m_bits, v_bits, u = mo._moment_bits(m).reshape(-1), mo._moment_bits(v).reshape(-1), out.numpy().reshape(-1)
        mo._over_parts(u.size, lambda a, b: mo.native.adam_update(m_bits[a:b], m.dtype == torch.bfloat16, v_bits[a:b], v.dtype == torch.bfloat16, mo.scale_floor(eps), u[a:b]))
        return out
    import hf_dynaquant.training.optimizer_state as os_
    def target(self):
        return adam_update(self.entry["exp_avg"], self.entry["exp_avg_sq"], self.eps).reshape(-1)
    os_._Moment.target = target
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.float32)
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/tmp")
res = []
for step in range(1, 5):
    gc.collect()
    c = Compressor(model, os.path.join(d, f"s{step}"), CONFIG, optimizer=opt)
    t0 = time.perf_counter(); c0 = time.process_time()
    c.compress(step)
    res.append((time.perf_counter()-t0, time.process_time()-c0))
print(os.environ.get("HACK", "-"), " ".join(f"{a:.3f}/{b:.2f}" for a, b in res), flush=True)
shutil.rmtree(d)
