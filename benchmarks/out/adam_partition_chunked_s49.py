import time, numpy as np, torch
from hf_dynaquant.core.kernels import native
from hf_dynaquant.core.moments import scale_floor
n = 38_597_376
m = torch.randn(n) * 1e-3; v = torch.rand(n) * 1e-6
floor = scale_floor(1e-8)
mids = np.array([-1.0, 0.0, 1.0], np.float32)  # 2 centres -> mids
def part(u, codes):
    return native.partition(u, False, mids, False, np.inf, np.inf, -1.0, False, mids, codes)
mb, vb = m.numpy(), v.numpy()
def full():
    u = np.empty(n, np.float32)
    native.adam_update(mb, False, vb, False, floor, u)
    codes = np.empty(n, np.uint8); part(u, codes); return codes
def chunked(C=1 << 18):
    codes = np.empty(n, np.uint8); u = np.empty(C, np.float32)
    for a in range(0, n, C):
        b = min(n, a + C); uu = u[: b - a]
        native.adam_update(mb[a:b], False, vb[a:b], False, floor, uu)
        part(uu, codes[a:b])
    return codes
assert np.array_equal(full(), chunked())
for f in (full, chunked, full, chunked):
    ts = []
    for i in range(5):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    print(f.__name__, f"{min(ts)*1e9/n:.2f} ns/value, median {sorted(ts)[2]*1e9/n:.2f}")
