import os, sys, tempfile, json, struct, glob
sys.path.insert(0, "/work/main/benchmarks")
import torch
from transformers import GPT2Config
from bench_scale import SIZES, CONFIG, fresh, train_step
from hf_dynaquant import Compressor
import hf_dynaquant.store.store as st
got = []
orig = st.StreamingWriter.__init__
def init(self, path, reserve):
    got.append(reserve); orig(self, path, reserve)
st.StreamingWriter.__init__ = init
import hf_dynaquant.store.safetensors_io as sio
est_keys = []
orig_est = st.header_size_estimate
def est(keys, *a):
    est_keys.append(keys); return orig_est(keys, *a)
st.header_size_estimate = est
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, os.path.join(d, "s"), CONFIG, optimizer=opt)
c.compress(1); train_step(model, opt, 1); train_step(model, opt, 2); c.compress(3)
for f in sorted(glob.glob(os.path.join(d, "s", "**", "*.safetensors"), recursive=True)):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]; h = json.loads(fh.read(n))
    body = json.dumps({k: v for k, v in h.items() if k != "__metadata__"}, separators=(",", ":"))
    meta = len(json.dumps(h.get("__metadata__", {}), separators=(",", ":")))
    print(os.path.basename(os.path.dirname(f))[:10], "blobs", len(h) - ("__metadata__" in h), "header", n, "json", len(body), "meta", meta, "per blob", round(len(body) / max(1, len(h) - 1), 1))
for keys, r in zip(est_keys, got):
    print("estimate keys", len(keys), "reserve", r, "per key", round(r / len(keys), 1), "mean key len", round(sum(map(len, keys)) / len(keys), 1))
