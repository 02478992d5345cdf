# session 46: one 124M fp32 keyframe (step 1) and delta (step 3) as bench_scale makes them, wall and CPU, minor faults
import os, sys, time, tempfile, shutil, gc, resource
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
import hf_dynaquant, ctypes
import numpy as _np
if os.environ.get('NOTHP'):
    _np._core.multiarray._set_madvise_hugepage(False)
import hf_dynaquant.store.store as S, hf_dynaquant.training.optimizer_state as O, hf_dynaquant.core.quantizer as Q
B=int(os.environ.get('BUDGET','0'))
if B:
    S.VALUES_IN_FLIGHT=O.VALUES_IN_FLIGHT=Q.VALUES_IN_FLIGHT=B
_libc = ctypes.CDLL('libc.so.6')
from hf_dynaquant import Compressor
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")], **({} if not os.environ.get("BF16") else {})))
if os.environ.get("BF16"):
    model, opt = fresh(GPT2Config(**SIZES[os.environ.get("SIZE", "124M")]), torch.bfloat16)
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
out = []
def timed(step):
    gc.collect(); _libc.malloc_trim(0); time.sleep(0.1)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    c.compress(step)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.append(f"{time.perf_counter()-t:.3f}/{r1.ru_utime-r0.ru_utime:.2f}/{r1.ru_stime-r0.ru_stime:.2f}/{r1.ru_minflt-r0.ru_minflt}")
timed(1)
train_step(model, opt, 100); train_step(model, opt, 200)
timed(3)
train_step(model, opt, 300)
timed(4)
print("nothp" if os.environ.get("NOTHP") else "thp", os.path.dirname(hf_dynaquant.__file__).split("/")[2], "keyframe, deltas (wall/user/sys/faults):", " ".join(out))
shutil.rmtree(d)
