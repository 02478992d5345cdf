# session 39: a restore at the end of a delta chain with completed_map letting light tensors pass a heavy one that
# waits for room (B) against the code before (A): wall, CPU, cores busy and peak extra memory (in 124M fp32
# checkpoints, 1,493 MB). The chain: bench_scale's 124M setup checkpointed every two steps, N entries (N=10: a
# keyframe and nine deltas; N=2: one delta), written once to /tmp/s39/chain_store<N>.
# usage: copy each version's hf_dynaquant (kernels built) to /tmp/s39/<v>/, then alternate:
#   for r in 1 2 3; for v in A B: PYTHONPATH=/tmp/s39/$v N=10 python restore_passing_s39.py
# (log: restore_passing_s39.log)
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch
from bench_scale import CONFIG, SIZES, fresh, measure, train_step
from transformers import GPT2Config

from hf_dynaquant import Compressor

N = int(os.environ.get("N", "10"))
store = f"/tmp/s39/chain_store{N}/s"
config = GPT2Config(**SIZES["124M"])
if not os.path.exists(store):
    torch.manual_seed(0)
    model, optimizer = fresh(config, torch.float32)
    train_step(model, optimizer, 0)
    writer = Compressor(model, store, CONFIG, optimizer=optimizer)
    for k in range(N):
        if k:
            train_step(model, optimizer, 2 * k)
            train_step(model, optimizer, 2 * k + 1)
        writer.compress(1 + 2 * k)
model, optimizer = fresh(config, torch.float32)
reader = Compressor(model, store, optimizer=optimizer)
seconds, extra, _, cpu = measure(lambda: reader.restore(1 + 2 * (N - 1)))
print(f"restore {seconds:.2f} s cpu {cpu:.2f} cores {cpu / seconds:.2f} peak {extra / 1493e6:.2f}x")
