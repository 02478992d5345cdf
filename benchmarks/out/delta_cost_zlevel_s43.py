# session 43: the captured 124M keyframe codes (the delta's current codes) packed as encode_codes_packed packs them, zstd at levels 1, -1, -3, -5 and with matches off: bytes and seconds (single thread, best of 3)
import time, numpy as np, zstandard
from hf_dynaquant.core.entropy import _packing
from hf_dynaquant.core.histogram import byte_counts
from hf_dynaquant.core.bitplanes import pack_bits
z = np.load("/dev/shm/s43_delta.npz"); L = z["levels"]
bufs = []
for i in range(len(L)):
    c = z[f"c{i}"]; p = _packing(byte_counts(c, 256))
    bufs.append(pack_bits(c, *p).tobytes() if p else c.tobytes())
print("streams", len(bufs), "MB", sum(map(len, bufs)) / 1e6)
def comp(**kw):
    cctx = zstandard.ZstdCompressor(**kw) if "compression_params" in kw else zstandard.ZstdCompressor(write_checksum=False, write_content_size=True, **kw)
    best = 9
    for _ in range(3):
        t = time.perf_counter(); out = [cctx.compress(b) for b in bufs]; best = min(best, time.perf_counter() - t)
    return sum(min(len(o), len(b)) for o, b in zip(out, bufs)), best
for lv in (1, -1, -3, -5, -10):
    n, t = comp(level=lv); print(f"level {lv:3d}: {n/1e6:8.3f} MB {t:.3f} s")
for mm, hl in ((7, 14), (7, 12), (7, 10), (4, 10), (7, 8)):
    n, t = comp(compression_params=zstandard.ZstdCompressionParameters(strategy=zstandard.STRATEGY_FAST, min_match=mm, hash_log=hl, chain_log=6, search_log=1, window_log=17, write_content_size=True, write_checksum=False)); print(f"fast minmatch {mm} hashlog {hl}: {n/1e6:8.3f} MB {t:.3f} s")
