# session 39: a restore at the end of a 124M chain with the payload files' blobs read by pread (C) against read through
# safetensors' memory map (B; both with the passing change): wall, CPU and peak extra memory (VmHWM, as bench_scale
# and bench_chain measure it) in checkpoints. Chains: bench_scale's setup, saves two steps apart, N entries, written
# once by restore_passing_s39.py (fp32: /tmp/s39/chain_store<N>) or chain_memory_bf16_s39.py
# (bf16: /tmp/s39/chain_bf16_<N>).
# usage: alternate for v in B C: PYTHONPATH=/tmp/s39/$v DTYPE=bf16|fp32 N=10|2 python restore_pread_s39.py
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch
from bench_scale import SIZES, fresh, measure
from transformers import GPT2Config

from hf_dynaquant import Compressor

N = int(os.environ.get("N", "10"))
bf16 = os.environ.get("DTYPE") == "bf16"
store = f"/tmp/s39/chain_bf16_{N}/s" if bf16 else f"/tmp/s39/chain_store{N}/s"
model, optimizer = fresh(GPT2Config(**SIZES["124M"]), torch.bfloat16 if bf16 else torch.float32)
reader = Compressor(model, store, optimizer=optimizer)
seconds, extra, _, cpu = measure(lambda: reader.restore(1 + 2 * (N - 1)))
checkpoint = 747e6 if bf16 else 1493e6
print(f"{'bf16' if bf16 else 'fp32'} N={N} restore {seconds:.2f} s cpu {cpu:.2f} peak {extra / checkpoint:.2f}x")
