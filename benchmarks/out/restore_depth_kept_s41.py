# session 41: bytes of the keyframe's kept states that restore_depth holds between saves (124M fp32, bench_scale setup)
import sys, shutil
from pathlib import Path
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from bench_scale import CONFIG, SIZES, fresh, train_step, flat
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.codecs.dynaquant import KeptState, QuantState
store = Path("/dev/shm/s41kept"); shutil.rmtree(store, ignore_errors=True)
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.float32)
train_step(model, opt, 0)
checkpoint = sum(t.numel() * t.element_size() for t in flat(model, opt).values())
c = Compressor(model, store, CONFIG, optimizer=opt, restore_depth=3)
c.compress(1)
def nbytes(st):
    if isinstance(st, KeptState):
        return st.packed.data.nbytes + st.state.centres.nbytes + st.state.protected.nbytes
    if isinstance(st, QuantState):
        return st.codes.nbytes + st.centres.nbytes + st.protected.nbytes
    return 0
total = sum(nbytes(s) for s in c._keyframe_states.values())
print(f"keyframe's kept states: {total / 1e6:.1f} MB, {total / checkpoint:.3f}x the {checkpoint / 1e6:.0f} MB checkpoint")
shutil.rmtree(store, ignore_errors=True)
