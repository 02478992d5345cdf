"""Check-N-Run's quantization (Eisenman et al., NSDI 2022, section 4.2): row-wise uniform
quantization whose clipping range is chosen by a greedy search (Guan et al., 2019, "Post-Training
4-Bit Quantization on Embedding Tables", Algorithm 1), as FBGEMM implements it for PyTorch's
``quantized::embedding_bag_4bit_prepack(weight, optimized_qparams=True, nbins, ratio)``.

Each row (the last dimension) gets its own range ``[lo, hi]`` and ``bins`` evenly spaced levels:
``scale = (hi - lo) / (bins - 1)``, ``q = clip(rint((x - lo) / scale), 0, bins - 1)``, decoded
as ``scale * q + lo``. Scale and ``lo`` are stored as float16 (as FBGEMM does; the search
measures its candidates with the rounded values). The range search starts from the row's
``[min, max]`` with a step of ``(max - min) / step_bins`` and, while the range is still wider than
``(1 - clip_ratio)`` of the original, moves whichever end (the low one only if it is strictly
better) gives the smaller L2 error of the dequantized row. It keeps the best range that was a
local minimum along the way and beats the full range; otherwise it keeps the full range.

The DynaQuant paper's CNR+ (section 8.3) keeps this quantizer and drops Check-N-Run's delta
scheme, which only fits recommendation models' embedding tables; so does this codec (no deltas).
Its search cube (Table 9) is ``bins`` in {8, ..., 256}, ``step_bins`` in {10, 25, 50, 100}
and ``clip_ratio`` in {0.1, ..., 0.5}. The defaults are FBGEMM's: 16 bins, 200 step bins, 0.16.
Not in the papers: bin counts that are not powers of two, which the cube has none of, are stored
in ``ceil(log2(bins))`` bits; codes are packed ``bits`` at a time, least significant bit first,
which for 4 and 2 bits is FBGEMM's layout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, register_codec
from .base import PeerCodec, pack_bits, unpack_bits

__all__ = ["CNRCodec", "greedy_range"]


def _scale_and_low(lo: np.ndarray, hi: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Float16-rounded ``(scale, lo)`` of each row's range, FBGEMM's way (scale 1 for an empty range)."""
    low = lo.astype(np.float16).astype(np.float32)
    span = hi - low
    scale = np.where(span == 0, np.float32(1), (span / np.float32(bins - 1)).astype(np.float16).astype(np.float32))
    # a span too small for float16 rounds to 0 (FBGEMM then takes 1; any non-zero float16 has a finite inverse)
    return np.where(scale == 0, np.float32(1), scale).astype(np.float32), low


def _codes(x: np.ndarray, scale: np.ndarray, low: np.ndarray, bins: int) -> np.ndarray:
    inverse = (np.float32(1) / scale)[:, None]
    return np.clip(np.rint((x - low[:, None]) * inverse), 0, bins - 1)


def _loss(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bins: int) -> np.ndarray:
    """Each row's L2 error after quantizing it to ``[lo, hi]``."""
    scale, low = _scale_and_low(lo, hi, bins)
    err = x - (_codes(x, scale, low, bins) * scale[:, None] + low[:, None])
    return np.sqrt(np.einsum("ij,ij->i", err, err, dtype=np.float64))


def greedy_range(x: np.ndarray, bins: int, step_bins: int, clip_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` of each row of the float32 matrix ``x``: Guan et al.'s greedy search (see the
    module docstring), every row at once."""
    xmin, xmax = x.min(axis=1), x.max(axis=1)
    step = (xmax - xmin) / np.float32(step_bins)
    thr = np.float32(int(step_bins * (1 - clip_ratio))) * step
    lo, hi = xmin.copy(), xmax.copy()
    loss = _loss(x, lo, hi, bins)
    best_lo, best_hi, best_loss = lo.copy(), hi.copy(), loss.copy()
    active = lo + thr < hi
    while active.any():
        rows = np.flatnonzero(active)
        xs, l0, h0, s = x[rows], lo[rows], hi[rows], step[rows]
        left, right = _loss(xs, l0 + s, h0, bins), _loss(xs, l0, h0 - s, bins)
        current = loss[rows]
        local = (current < left) & (current < right) & (current < best_loss[rows])
        best_lo[rows] = np.where(local, l0, best_lo[rows])
        best_hi[rows] = np.where(local, h0, best_hi[rows])
        best_loss[rows] = np.where(local, current, best_loss[rows])
        move_left = left < right
        lo[rows] = np.where(move_left, l0 + s, l0)
        hi[rows] = np.where(move_left, h0, h0 - s)
        loss[rows] = np.where(move_left, left, right)
        active[rows] = lo[rows] + thr[rows] < hi[rows]
    return best_lo, best_hi


@register_codec
class CNRCodec(PeerCodec):
    """Check-N-Run's row-wise greedy uniform quantizer (see the module docstring)."""

    name = "cnr"
    version = 1

    def __init__(self, bins: int = 16, step_bins: int = 200, clip_ratio: float = 0.16, min_numel: int = 4096) -> None:
        super().__init__(min_numel)
        if not isinstance(bins, int) or not 2 <= bins <= 256:
            raise InvalidSettingError(f"CNR bins must be an int in [2, 256], got {bins!r}")
        if not isinstance(step_bins, int) or step_bins < 1:
            raise InvalidSettingError(f"CNR step_bins must be an int >= 1, got {step_bins!r}")
        if not 0 <= clip_ratio < 1:
            raise InvalidSettingError(f"CNR clip_ratio must be in [0, 1), got {clip_ratio!r}")
        self.bins, self.step_bins, self.clip_ratio = bins, step_bins, float(clip_ratio)

    def quantize(self, matrix: np.ndarray) -> tuple[dict[str, bytes], dict[str, Any], np.ndarray]:
        lo, hi = greedy_range(matrix, self.bins, self.step_bins, self.clip_ratio)
        scale, low = _scale_and_low(lo, hi, self.bins)
        codes = _codes(matrix, scale, low, self.bins)
        bits = math.ceil(math.log2(self.bins))
        blobs = {
            "codes": pack_bits(codes.astype(np.uint8).reshape(-1), bits).tobytes(),
            "scale": scale.astype(np.float16).tobytes(),
            "low": low.astype(np.float16).tobytes(),
        }
        decoded = codes * scale[:, None] + low[:, None]
        return blobs, {"bins": self.bins}, decoded

    def dequantize(self, shape: tuple[int, int], params: dict[str, Any], blobs: BlobSource) -> np.ndarray:
        where, bins = blobs.where, params.get("bins")
        if not isinstance(bins, int) or not 2 <= bins <= 256:
            raise CorruptCheckpointError(f"{where}: CNR parameters are invalid (bins {bins!r})")
        rows, cols = shape
        bits = math.ceil(math.log2(bins))
        packed, scale, low = blobs("codes"), blobs("scale"), blobs("low")
        if packed.size != -(-rows * cols * bits // 8) or scale.size != 2 * rows or low.size != 2 * rows:
            raise CorruptCheckpointError(
                f"{where}: CNR blobs hold {packed.size} code bytes and {scale.size // 2} / {low.size // 2} "
                f"row scales for a {rows} x {cols} matrix at {bits} bits"
            )
        codes = unpack_bits(packed, bits, rows * cols).reshape(rows, cols)
        if codes.max(initial=0) >= bins:
            raise CorruptCheckpointError(f"{where}: a CNR code is not below its {bins} bins")
        s, lo = scale.view("<f2").astype(np.float32), low.view("<f2").astype(np.float32)
        if not (np.isfinite(s).all() and np.isfinite(lo).all()):
            raise CorruptCheckpointError(f"{where}: a CNR row scale is not finite")
        return codes * s[:, None] + lo[:, None]
