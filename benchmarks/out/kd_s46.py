# session 46: one 124M fp32 keyframe (step 1) and two deltas (steps 3, 4) as bench_scale makes them;
# per save: wall s / user CPU s / system CPU s / minor page faults. Options (environment):
#   TRIM=1     hand the heap back before each save (as bench_scale's measure and the compressor's last save do)
#   BUDGET=N   the pools' VALUES_IN_FLIGHT (default 2^25)
#   NOTHP=1    numpy's huge-page advice off for the process (measured only)
#   FREE=1     Adam's update made before each save, outside its time (what a save takes if the update costs nothing)
#   SIZE, BF16=1
import ctypes, gc, os, resource, shutil, sys, tempfile, time
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
import hf_dynaquant
import hf_dynaquant.core.quantizer as Q
import hf_dynaquant.store.store as S
import hf_dynaquant.training.optimizer_state as O
from hf_dynaquant import Compressor
from hf_dynaquant.core.moments import adam_update

budget, free = int(os.environ.get("BUDGET", "0")), bool(os.environ.get("FREE"))
if budget:
    S.VALUES_IN_FLIGHT = O.VALUES_IN_FLIGHT = Q.VALUES_IN_FLIGHT = budget
if os.environ.get("NOTHP"):
    np._core.multiarray._set_madvise_hugepage(False)
made = {}  # FREE: the updates, by the data pointer of their exp_avg
if free:
    target = O._Moment.target
    O._Moment.target = lambda self: made[self.entry["exp_avg"].data_ptr()] if self.kind == O.ADAM else target(self)
libc = ctypes.CDLL("libc.so.6")
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")]), torch.bfloat16 if os.environ.get("BF16") else torch.float32)
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
out = []


def timed(step):
    made.clear()
    if free:
        for st in opt.state.values():
            made[st["exp_avg"].data_ptr()] = adam_update(st["exp_avg"], st["exp_avg_sq"], 1e-8).reshape(-1)
    gc.collect()
    if os.environ.get("TRIM"):
        libc.malloc_trim(0)
    time.sleep(0.1)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    c.compress(step)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.append(f"{time.perf_counter()-t:.3f}/{r1.ru_utime-r0.ru_utime:.2f}/{r1.ru_stime-r0.ru_stime:.2f}/{r1.ru_minflt-r0.ru_minflt}")


timed(1)
train_step(model, opt, 100); train_step(model, opt, 200)
timed(3)
train_step(model, opt, 300)
timed(4)
label = " ".join(f"{k}={os.environ[k]}" for k in ("TRIM", "BUDGET", "NOTHP", "FREE") if os.environ.get(k)) or "default"
print(os.path.dirname(hf_dynaquant.__file__).split("/")[2], label, "keyframe, deltas (wall/user/sys/faults):", " ".join(out))
shutil.rmtree(d)
