"""NF4: QLoRA's 4-bit NormalFloat quantization (Dettmers et al., 2023, section 3), as bitsandbytes
stores it.

A tensor's values are cut in blocks of ``block_size`` (64) consecutive values; each block is
divided by its absolute maximum (the *absmax*, kept in float32) and every value is rounded to the
nearest of the 16 NormalFloat levels :data:`LEVELS`, the quantiles of a standard normal scaled to
[-1, 1] with an exact zero (bitsandbytes' ``get_4bit_type("nf4")``; rounding at the midpoints
between levels, as its kernels do). Two 4-bit codes share a byte, the first in the high nibble.
Codes, scales and decoded values equal bitsandbytes' ``quantize_4bit`` / ``dequantize_4bit``
(``quant_type="nf4"``) bit for bit (tested). At 4 bits a value plus 32 bits per block of 64, a
float32 tensor shrinks 7.1x.

What is quantized (the paper and bitsandbytes quantize the weights of linear layers only): see
:mod:`.base` (float tensors of 2+ dimensions and ``min_numel`` (4,096) finite values; every other
tensor is stored bit-exactly). Not taken
from the paper: the double quantization of the absmax values (section 3, "Double Quantization",
a further 0.37 bits per value) is not applied; the paper names it a memory saving for fine-tuning,
and without it the scales are exact. There is no delta coding between checkpoints (the method has
none): every entry stores each tensor whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, register_codec
from .base import PeerCodec

__all__ = ["NF4Codec", "LEVELS"]

#: bitsandbytes' NF4 levels (``bitsandbytes.functional.get_4bit_type("nf4")``), ascending.
LEVELS = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],  # fmt: skip
    dtype=np.float32,
)
_MIDPOINTS = (LEVELS[1:] + LEVELS[:-1]) / 2
_ZERO = int(np.flatnonzero(LEVELS == 0)[0])  # the code of 0.0


def quantize_nf4(values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, absmax)`` of flat float32 ``values``: one 4-bit code (uint8) per value and the
    float32 absolute maximum of each block (0 for an all-zero block)."""
    n = values.size
    blocks = -(-n // block_size)
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[:n] = values
    padded = padded.reshape(blocks, block_size)
    absmax = np.abs(padded).max(axis=1)
    scaled = padded / np.where(absmax > 0, absmax, 1)[:, None]
    codes = np.searchsorted(_MIDPOINTS, scaled.ravel()[:n]).astype(np.uint8)
    return codes, absmax.astype(np.float32)


def dequantize_nf4(codes: np.ndarray, absmax: np.ndarray, block_size: int) -> np.ndarray:
    """Flat float32 values of ``codes`` and the blocks' ``absmax`` (the inverse of
    :func:`quantize_nf4` up to rounding)."""
    n = codes.size
    scale = np.repeat(absmax, block_size)[:n]
    return LEVELS[codes] * scale


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte, the first in the high nibble, as bitsandbytes packs them (so the
    blob is its ``quantize_4bit`` output byte for byte); an odd count ends with the code of 0.0,
    the value bitsandbytes pads a block with."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(_ZERO))
    return ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` 4-bit codes :func:`pack_nibbles` packed."""
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed >> 4
    out[1::2] = packed & 0x0F
    return out[:n]


@register_codec
class NF4Codec(PeerCodec):
    """QLoRA's NF4 (see the module docstring). ``block_size``: values per absmax block (64, as
    bitsandbytes); ``min_numel``: smaller tensors are stored losslessly."""

    name = "nf4"
    version = 1

    def __init__(self, block_size: int = 64, min_numel: int = 4096) -> None:
        super().__init__(min_numel)
        if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise InvalidSettingError(f"NF4 block_size must be an even number >= 2, got {block_size!r}")
        self.block_size = block_size

    def quantize(self, matrix: np.ndarray) -> tuple[dict[str, bytes], dict[str, Any], np.ndarray]:
        codes, absmax = quantize_nf4(matrix.reshape(-1), self.block_size)
        blobs = {"codes": pack_nibbles(codes).tobytes(), "absmax": absmax.tobytes()}
        decoded = dequantize_nf4(codes, absmax, self.block_size).reshape(matrix.shape)
        return blobs, {"block_size": self.block_size}, decoded

    def dequantize(self, shape: tuple[int, int], params: dict[str, Any], blobs: BlobSource) -> np.ndarray:
        where, block = blobs.where, params.get("block_size")
        if not isinstance(block, int) or block < 2:
            raise CorruptCheckpointError(f"{where}: NF4 parameters are invalid (block_size {block!r})")
        n = shape[0] * shape[1]
        packed, absmax = blobs("codes"), blobs("absmax")
        if packed.size != -(-n // 2) or absmax.size != 4 * -(-n // block):
            raise CorruptCheckpointError(
                f"{where}: NF4 blobs hold {packed.size} code bytes and {absmax.size // 4} scales for "
                f"{n} values in blocks of {block}"
            )
        scales = absmax.view("<f4")
        if not np.isfinite(scales).all():
            raise CorruptCheckpointError(f"{where}: an NF4 block scale is not finite")
        return dequantize_nf4(unpack_nibbles(packed, n), scales.astype(np.float32), block).reshape(shape)
