# session 46: the optimizer decisions of a 124M fp32 AdamW state, groups of VALUES_IN_FLIGHT values (default) or larger
import os, sys, time
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, fresh, train_step
import hf_dynaquant.training.optimizer_state as O
from hf_dynaquant.core.pool import weighed_batches
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0); train_step(model, opt, 100)
sd = opt.state_dict()
res = {}
for rep in range(4):
    for budget in (1 << 25, 1 << 27, 1 << 29):
        O.VALUES_IN_FLIGHT = budget
        t = time.perf_counter(); c = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
        enc = O.encode_optimizer_state(sd)
        res.setdefault(budget, []).append((time.perf_counter() - t, time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID) - c))
        if rep == 0:
            key = {k: (tp.centres.tolist()) for k, tp in enc.plans.items()}
            res.setdefault("plans", []).append(key)
same = all(p == res["plans"][0] for p in res["plans"])
for b in (1 << 25, 1 << 27, 1 << 29):
    print(f"budget 2^{b.bit_length()-1}: wall {' '.join(f'{w:.3f}' for w, _ in res[b])} s, CPU {' '.join(f'{c:.2f}' for _, c in res[b])} s")
print("same plans:", same)
