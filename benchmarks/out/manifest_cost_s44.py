# session 44: what the end of a 124M save costs: the manifest's JSON, hash and zstd at each level
import sys, time, tempfile, glob, os, json
sys.path.insert(0, "/work/main/benchmarks")
import torch, zstandard
from bench_scale import SIZES, CONFIG, fresh, train_step
from transformers import GPT2Config
from hf_dynaquant import Compressor
from hf_dynaquant.store.manifest import read_manifest_bytes, content_id, canonical_json
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]))
train_step(model, opt, 0)
d = tempfile.mkdtemp(dir="/dev/shm")
c = Compressor(model, d, CONFIG, optimizer=opt)
c.compress(1); train_step(model, opt, 1); train_step(model, opt, 2); c.compress(3)
for path in sorted(glob.glob(f"{d}/**/manifest.json.zst", recursive=True)):
    data = read_manifest_bytes(__import__("pathlib").Path(path))
    obj = json.loads(data)
    payload = sum(os.path.getsize(p) for p in glob.glob(os.path.dirname(path) + "/*") )
    t = time.perf_counter(); j = canonical_json(obj); tj = time.perf_counter() - t
    t = time.perf_counter(); content_id(j); th = time.perf_counter() - t
    print(f"{path.split('/')[-2][:12]}: entry {payload/1e6:.1f} MB, manifest {len(data)/1e3:.0f} KB; canonical_json {tj*1e3:.1f} ms, sha256 {th*1e3:.2f} ms")
    for level in (1, 3, 6, 9, 12, 15, 19):
        t = time.perf_counter(); z = zstandard.ZstdCompressor(level=level).compress(data); tz = time.perf_counter() - t
        print(f"   level {level:2d}: {len(z)/1e3:6.1f} KB in {tz*1e3:6.1f} ms")
