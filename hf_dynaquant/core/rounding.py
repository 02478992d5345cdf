"""Stochastic rounding of quantization codes, for checkpoints that training resumes from.

Rounding every weight to its *nearest* centre is the right choice for a snapshot that is only
evaluated, but not for a checkpoint that training goes on from. After a restore every weight
sits exactly on a centre; the next checkpoint rounds it to the nearest centre again, so every
update smaller than half a bin since the restore is erased. Restore often enough and training
stalls: in our Trainer benchmark (10 restores in 480 steps) the next checkpoint kept as little
as 7% of the update made since the restore (the projection of the stored change on the true
one), and the run ended 2-3% worse than without compression. This is the stagnation of
round-to-nearest in low-precision training that Gupta et al. (2015, "Deep learning with limited
numerical precision") cure with stochastic rounding, which we adopt:

* a value ``x`` between the centres ``c_lo < x < c_hi`` rounds up with probability
  ``(x - c_lo) / (c_hi - c_lo)``, so the decoded value is ``x`` *in expectation*: a small update
  moves the weight one bin with a probability proportional to its size instead of never;
* a value the plan prunes rounds between 0 and the centre ``c`` nearest to it on its side of
  zero, to ``c`` with probability ``min(|x| / |c|, 1)`` (unbiased when ``|x| <= |c|``, which
  magnitude pruning guarantees up to K-means' centre placement); a pruned weight that grows is
  no longer held at zero for ever;
* protected values are kept (bf16) as before; values beyond the outer centres clip to them.

The random numbers are a counter-based hash (SplitMix64) of ``seed`` and each element's index,
so the codes are a deterministic function of the weights, the seed and the element's position:
a shard of a tensor draws the very numbers of the unsharded tensor's rows (``offset``), and the
same weights give the same codes at every call (the configuration search and the encoder agree).

:func:`device_uniform` and :func:`device_stochastic_codes` are the same steps in torch ops, for
values on an accelerator (the configuration search's, see
:meth:`~.quantizer.TensorPlan.device_codes`), equal bit for bit: SplitMix64 in int64
arithmetic, which wraps as uint64 does, its right shifts masked so that they are logical.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from .dtypes import bf16_bits_to_f32
from .kernels import native
from .kmeans import assign

__all__ = [
    "tensor_seed",
    "uniform",
    "stochastic_codes",
    "seeded_stochastic_codes",
    "device_uniform",
    "device_stochastic_codes",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def tensor_seed(seed: int, name: str) -> int:
    """A 64-bit seed for one tensor: the rounding seed mixed with the tensor's name."""
    return (int(seed) * 0x100000001B3 ^ zlib.crc32(name.encode())) & 0xFFFFFFFFFFFFFFFF


def uniform(seed: int, offset: int, n: int) -> np.ndarray:
    """``n`` uniform float32 numbers in [0, 1) for elements ``offset .. offset + n - 1``
    (SplitMix64 of ``seed + index * golden``: any slice is computable on its own)."""
    z = (np.arange(offset, offset + n, dtype=np.uint64) + np.uint64(1)) * _GOLDEN + np.uint64(seed)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    z ^= z >> np.uint64(31)
    return ((z >> np.uint64(40)).astype(np.float32)) * np.float32(1.0 / (1 << 24))


def stochastic_codes(
    codes: np.ndarray, w: np.ndarray, centres: np.ndarray, u: np.ndarray, first_centre: int, pruned: int
) -> np.ndarray:
    """Re-round nearest-centre ``codes`` of flat values ``w`` stochastically (in place; returned).

    ``codes``: ``pruned`` for pruned values, ``first_centre + i`` for centre ``i``, anything else
    (protected) untouched; ``centres`` sorted ascending; ``u`` one uniform number per value.
    """
    if centres.size == 0:
        return codes
    c = centres.astype(np.float32)
    top = c.size - 1
    sel = np.flatnonzero(codes >= first_centre)
    if sel.size and c.size > 1:
        i = codes[sel].astype(np.int64) - first_centre
        x = w[sel]
        j = np.clip(np.where(x > c[i], i + 1, i - 1), 0, top)  # the other centre bracketing x
        gap = c[j] - c[i]
        step = np.where(gap != 0, (x - c[i]) / np.where(gap != 0, gap, 1), 0)  # in [0, 1/2]
        codes[sel] = np.where(u[sel] < step, j, i) + first_centre
    sel = np.flatnonzero(codes == pruned)
    if sel.size:
        x = w[sel]
        # the centre nearest to x among those on its side of zero: the nearest centre overall, or,
        # when that one lies across zero, the innermost centre on x's side (none: stays pruned)
        nearest = assign(x, c)
        zero = np.searchsorted(c, 0, side="right")  # centres[zero:] are > 0, centres[:zero] <= 0
        inner = np.clip(np.where(x > 0, zero, zero - 1), 0, top)
        k = np.where(np.sign(c[nearest]) == np.sign(x), nearest, inner)
        same_side = (np.sign(c[k]) == np.sign(x)) & (x != 0)
        p = np.where(same_side, np.minimum(np.abs(x) / np.maximum(np.abs(c[k]), np.float32(1e-30)), 1), 0)
        keep = u[sel] < p
        codes[sel[keep]] = (k[keep] + first_centre).astype(codes.dtype)
    return codes


def seeded_stochastic_codes(
    codes: np.ndarray, w: np.ndarray, centres: np.ndarray, seed: int, offset: int, first_centre: int, pruned: int
) -> np.ndarray:
    """:func:`stochastic_codes` with ``uniform(seed, offset, w.size)``, in place (returned):
    in one pass in the compiled kernel, each value's number made as it is read (no array of
    them; numpy's passes took some 150 ns a value), else in numpy. ``w``: flat float32 values,
    or bfloat16 ones as their bits (uint16), read as they are."""
    if centres.size == 0:
        return codes
    compiled = codes.dtype == np.uint8 and w.dtype in (np.float32, np.uint16) and w.size == codes.size
    if native is not None and compiled and codes.flags.c_contiguous and w.flags.c_contiguous:
        c = np.ascontiguousarray(centres, dtype=np.float32)
        native.stochastic_codes(codes, w, w.dtype == np.uint16, c, int(seed), int(offset), first_centre, pruned)
        return codes
    x = bf16_bits_to_f32(w) if w.dtype == np.uint16 else w
    return stochastic_codes(codes, x, centres, uniform(seed, offset, w.size), first_centre, pruned)


_MASK64 = (1 << 64) - 1


def _int64(u: int) -> int:
    """A uint64 as the int64 with the same bits."""
    u &= _MASK64
    return u - (1 << 64) if u >> 63 else u


_GOLDEN_64, _M1_64, _M2_64 = (_int64(int(x)) for x in (_GOLDEN, _M1, _M2))


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` of int64 ``z`` read as uint64 (a logical shift)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def device_uniform(seed: int, offset: int, n: int, device: torch.device) -> torch.Tensor:
    """:func:`uniform` (``n`` float32 numbers in [0, 1) of elements ``offset ..``)
    computed on ``device``, bit for bit."""
    z = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=device) * _GOLDEN_64 + _int64(seed)
    z = (z ^ _shifted(z, 30)) * _M1_64
    z = (z ^ _shifted(z, 27)) * _M2_64
    z = z ^ _shifted(z, 31)
    return _shifted(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def device_stochastic_codes(
    codes: torch.Tensor, w: torch.Tensor, c: torch.Tensor, u: torch.Tensor, first_centre: int, pruned: int
) -> None:
    """:func:`stochastic_codes` in place, step for step, where the tensors live (``c``: the
    sorted float32 centres there)."""
    if c.numel() == 0:
        return
    top = c.numel() - 1
    if top > 0:
        sel = torch.nonzero(codes >= first_centre).squeeze(1)
        i = codes[sel].long() - first_centre
        x, ci = w[sel], c[i]
        j = torch.where(x > ci, i + 1, i - 1).clamp(0, top)  # the other centre bracketing x
        gap = c[j] - ci
        step = torch.where(gap != 0, (x - ci) / torch.where(gap != 0, gap, torch.ones_like(gap)), 0.0)
        codes[sel] = (torch.where(u[sel] < step, j, i) + first_centre).to(torch.uint8)
    sel = torch.nonzero(codes == pruned).squeeze(1)
    if sel.numel():
        x = w[sel]
        nearest = torch.searchsorted((c[1:] + c[:-1]) / 2, x)  # assign()
        zero = int((c <= 0).sum())  # c[zero:] are > 0, c[:zero] <= 0
        inner = torch.where(x > 0, zero, zero - 1).clamp(0, top)
        k = torch.where(torch.sign(c[nearest]) == torch.sign(x), nearest, inner)
        same_side = (torch.sign(c[k]) == torch.sign(x)) & (x != 0)
        p = torch.where(same_side, (x.abs() / c[k].abs().clamp(min=1e-30)).clamp(max=1), 0.0)
        keep = u[sel] < p
        codes[sel[keep]] = (k[keep] + first_centre).to(torch.uint8)
