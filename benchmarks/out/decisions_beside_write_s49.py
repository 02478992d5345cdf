import os, sys, gc, time, threading
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main/benchmarks/out")
from bench_scale import CONFIG, train_step
from s46_first_keyframe import first_keyframe
from hf_dynaquant import Compressor
from hf_dynaquant.pipeline import write_planned
from hf_dynaquant.store import CheckpointStore
from hf_dynaquant.training.optimizer_state import encode_optimizer_state
from hf_dynaquant.core.memory import release_freed, ReleaseFreed
model, opt, d, c = first_keyframe()
train_step(model, opt, 100); train_step(model, opt, 200)
c = Compressor(model, os.path.join(d, "k"), CONFIG, optimizer=opt)
snap = c.snapshot(3, copy=False); sd = snap.optimizer
store = CheckpointStore(os.path.join(d, "m"))
def dec(): return encode_optimizer_state(sd, "compress", c.moment_quant)
for i in range(4):
    for mode in ("seq", "par"):
        gc.collect(); release_freed(); time.sleep(0.1)
        t = time.perf_counter()
        plan = c.plan_snapshot(snap)
        if mode == "seq":
            dec(); t1 = time.perf_counter(); write_planned(store, {"model": snap.state}, plan, freed=ReleaseFreed(allowance=700_000_000))
        else:
            th = threading.Thread(target=dec); th.start(); t1 = time.perf_counter(); write_planned(store, {"model": snap.state}, plan, freed=ReleaseFreed(allowance=700_000_000)); th.join()
        print(mode, f"{time.perf_counter()-t:.3f}", f"(plan{'+dec' if mode=='seq' else ''} {t1-t:.3f})")
