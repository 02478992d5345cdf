"""JointSQ (Xie et al., CVPR 2024, section 3.3): sparsification as 0-bit quantization, each value
given 0, 2, 4 or 8 bits by a greedy multiple-choice knapsack under a budget of bits.

Every value is a group of four items (0, 2, 4, 8 bits; eq. 13). At ``b`` bits a value ``x`` keeps
a share ``4^-b`` of its squared magnitude as error (eqs. 3, 6, 11), so the profit of an item over
the 0-bit baseline is ``(1 - 4^-b) x^2`` and its weight ``b`` bits. Greedy allocation
(section 3.3.1, eq. 14) takes upgrade steps (0 -> 2, 2 -> 4, 4 -> 8 bits) in order of profit per
bit while the budget ``bits_per_value * n`` allows (a step that does not fit is skipped); since
the three densities fall (0.469, 0.0293, 0.00097 per unit of ``x^2``), each value's steps come in
order and the bits grow with ``|x|``: this is the paper's heap walk, done with one sort. Values at
0 bits are pruned (decoded as 0).

Decisions where the paper is silent (it compresses gradients, without a checkpoint format):
allocation per tensor (the paper solves each layer's knapsack on its own), with the budget
``bits_per_value`` (1.6 by default: the paper's 20x on 32-bit values) counting the codes only, as
the paper's ratios do; the 2-, 4- and 8-bit groups are each quantized deterministically (the
paper's QSGD-style rounding is stochastic, which suits gradients, not stored weights) to
``2^b`` evenly spaced levels between the group's minimum and maximum; every value's bit width is
stored as a 2-bit index (0, 2, 4, 8) and that map compressed with zstd, since the paper does not
count it; the reallocation pass and the adaptive ratio ``R`` (sections 3.3.2-3.3.3), which tune
gradient communication during training, are not applied. No deltas.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, register_codec
from .base import PeerCodec, pack_bits, unpack_bits

__all__ = ["JointSQCodec", "allocate_bits", "WIDTHS"]

WIDTHS = np.array([0, 2, 4, 8], dtype=np.int64)  # the items of every group (eq. 13)
_STEP_WEIGHT = np.diff(WIDTHS)  # bits each upgrade costs: 2, 2, 4
_STEP_DENSITY = np.diff(1 - 4.0 ** -WIDTHS) / _STEP_WEIGHT  # profit per bit, per unit of x^2


def allocate_bits(values: np.ndarray, budget: float) -> np.ndarray:
    """Each value's item (an index into :data:`WIDTHS`) by the greedy allocation under ``budget``
    bits (see the module docstring)."""
    a = values.astype(np.float64) ** 2
    n = a.size
    density = (a[:, None] * _STEP_DENSITY[None, :]).reshape(-1)  # step s of value i at 3 i + s
    order = np.argsort(-density, kind="stable")
    weight = _STEP_WEIGHT[order % 3]
    taken = np.cumsum(weight) <= budget
    level = np.zeros(n, dtype=np.int64)
    first_out = int(np.argmin(taken)) if not taken.all() else order.size
    np.maximum.at(level, order[:first_out] // 3, order[:first_out] % 3 + 1)
    left = budget - int(weight[:first_out].sum())
    for position in range(first_out, order.size):  # a skipped step: smaller ones may still fit
        if left < 2:
            break
        value, step = divmod(int(order[position]), 3)
        if _STEP_WEIGHT[step] <= left and level[value] == step:
            level[value] = step + 1
            left -= int(_STEP_WEIGHT[step])
    return level


@register_codec
class JointSQCodec(PeerCodec):
    """JointSQ's 0/2/4/8-bit allocation (see the module docstring)."""

    name = "jointsq"
    version = 1

    def __init__(self, bits_per_value: float = 1.6, min_numel: int = 4096) -> None:
        super().__init__(min_numel)
        if not (isinstance(bits_per_value, (int, float)) and 0 <= bits_per_value <= 8):
            raise InvalidSettingError(f"JointSQ bits_per_value must be in [0, 8], got {bits_per_value!r}")
        self.bits_per_value = float(bits_per_value)

    def quantize(self, matrix: np.ndarray) -> tuple[dict[str, bytes], dict[str, Any], np.ndarray]:
        flat = matrix.reshape(-1)
        level = allocate_bits(flat, self.bits_per_value * flat.size)
        decoded = np.zeros_like(flat)
        blobs = {"widths": zstandard.ZstdCompressor(level=19).compress(pack_bits(level.astype(np.uint8), 2).tobytes())}
        ranges = []
        for item in (1, 2, 3):
            group = flat[level == item]
            bits = int(WIDTHS[item])
            low = np.float32(group.min()) if group.size else np.float32(0)
            high = np.float32(group.max()) if group.size else np.float32(0)
            scale = np.float32((high - low) / np.float32((1 << bits) - 1)) if high > low else np.float32(1)
            codes = np.clip(np.rint((group - low) / scale), 0, (1 << bits) - 1).astype(np.uint8)
            decoded[level == item] = low + scale * codes.astype(np.float32)
            blobs[f"codes{bits}"] = pack_bits(codes, bits).tobytes()
            ranges += [low, scale]
        blobs["ranges"] = np.array(ranges, dtype="<f4").tobytes()
        return blobs, {}, decoded.reshape(matrix.shape)

    def dequantize(self, shape: tuple[int, int], params: dict[str, Any], blobs: BlobSource) -> np.ndarray:
        where, n = blobs.where, shape[0] * shape[1]
        try:
            packed = np.frombuffer(zstandard.ZstdDecompressor().decompress(blobs("widths").tobytes()), dtype=np.uint8)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{where}: the JointSQ bit-width map does not decompress ({exc})") from None
        ranges = blobs("ranges")
        if packed.size != -(-n * 2 // 8) or ranges.size != 24:
            raise CorruptCheckpointError(f"{where}: JointSQ blobs do not fit {n} values")
        level = unpack_bits(packed, 2, n)
        bounds = ranges.view("<f4")
        if not np.isfinite(bounds).all():
            raise CorruptCheckpointError(f"{where}: a JointSQ group range is not finite")
        out = np.zeros(n, dtype=np.float32)
        for item in (1, 2, 3):
            bits, members = int(WIDTHS[item]), np.flatnonzero(level == item)
            codes = blobs(f"codes{bits}")
            if codes.size != -(-members.size * bits // 8):
                raise CorruptCheckpointError(f"{where}: JointSQ's {bits}-bit codes do not fit its bit-width map")
            low, scale = bounds[2 * item - 2], bounds[2 * item - 1]
            out[members] = low + scale * unpack_bits(codes, bits, members.size).astype(np.float32)
        return out.reshape(shape)
