"""What a Compressor holds between checkpoints for the next delta (its kept states), after a
keyframe of GPT-2 124M with AdamW, in float32 or bfloat16 (argv[1]): packed bytes against a byte
a code, and against the checkpoint (weights + Adam moments). Session 35; the log beside it."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from bench_scale import CONFIG, SIZES, fresh, train_step
from transformers import GPT2Config

from hf_dynaquant import Compressor
from hf_dynaquant.codecs import KeptState

torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), getattr(torch, sys.argv[1]))
train_step(model, opt, 0)
comp = Compressor(model, os.path.join(tempfile.mkdtemp(), "s"), CONFIG, optimizer=opt)
comp.compress(1)
held = codes = 0
for st in comp._states.values():
    inner = st.state if isinstance(st, KeptState) else st
    held += (st.packed.data.nbytes if isinstance(st, KeptState) else st.codes.nbytes) + inner.protected.nbytes
    codes += st.packed.size if isinstance(st, KeptState) else st.codes.size
moments = [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
checkpoint = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(v.numel() * v.element_size() for v in moments)
packed = sum(isinstance(st, KeptState) for st in comp._states.values())
print(
    f"{sys.argv[1]}: kept {held / 1e6:.1f} MB ({held / checkpoint:.3f}x the {checkpoint / 1e6:.0f} MB checkpoint) for "
    f"{codes / 1e6:.1f}M codes (a byte each: {codes / 1e6:.1f} MB, {codes / checkpoint:.3f}x); "
    f"{packed} of {len(comp._states)} tensors packed"
)
