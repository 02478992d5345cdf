"""QD-Compressor (Jin et al., TPDS 2023): per-layer bit widths from the weights' entropy,
min-max uniform quantization, a cyclic delta of the codes between checkpoints, LZMA.

* **Bit width** (section 4.2, eqs. 1-2): each layer's values are counted in ``hist_bins`` (256)
  equal-width bins between its minimum and maximum, ``E = -sum p log p``, and
  ``b = b_min + round((b_max - b_min) (E - E_min) / (E_max - E_min))`` with ``E_min`` and
  ``E_max`` over the checkpoint's layers; the paper's default is 4-8 bits (section 6.2.1).
  :func:`qd_bits` makes that allocation for a whole state dict; the codec quantizes one tensor
  at the width it is given (``bits``, 8 by default: the paper's fixed 8-bit variant).
* **Quantizer** (section 4.3, eqs. 3-5): one scale per layer, ``S = (f_max - f_min) / (2^b - 1)``,
  ``q = round((f - f_min) / S)`` in ``[0, 2^b - 1]``, decoded ``f_min + S q``. (Eq. 9 of the
  paper writes the dequantization as ``S (Q_min - Z)``; it is ``S (q - Z)``, and the code range is
  ``[0, 2^b - 1]``, not ``[0, 2^b]``.)
* **Delta** (section 4.5, eq. 8): against the previous checkpoint's codes of the same tensor,
  ``D = (q_cur - q_prev) mod M``. The paper assumes one bit width for both; as the DynaQuant
  paper's QD+ does (its section 8.3), ``M = max(2^b_prev, 2^b_cur)`` keeps the delta exact when the
  width changes, since ``q_cur < M`` fixes the residue.
* **Backend** (section 4.6): LZMA (Python's ``lzma``, preset 6, the paper names no settings) over
  the tensor's codes or delta, one byte each.

Decisions where the paper is silent: 256 histogram bins; all layers equal in entropy get
``b_max``; a constant layer has ``S = 1`` (every code 0); the scale and minimum are kept as
float32. What is quantized follows :mod:`.base`.
"""

from __future__ import annotations

import lzma
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...core.dtypes import RawTensor
from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, Encoded, register_codec
from .base import PeerCodec, as_raw

__all__ = ["QDCodec", "QDState", "qd_bits", "layer_entropy"]


def layer_entropy(values: np.ndarray, hist_bins: int = 256) -> float:
    """Eq. 1: the entropy (nats) of ``values`` counted in ``hist_bins`` equal-width bins."""
    counts, _ = np.histogram(values, bins=hist_bins)
    p = counts[counts > 0] / values.size
    return float(-(p * np.log(p)).sum())


def qd_bits(
    tensors: Mapping[str, torch.Tensor], min_bits: int = 4, max_bits: int = 8, hist_bins: int = 256
) -> dict[str, int]:
    """Eq. 2: each tensor's bit width from its entropy relative to the others'."""
    if not 1 <= min_bits <= max_bits <= 8:
        raise InvalidSettingError(f"QD bit widths must satisfy 1 <= min_bits <= max_bits <= 8, got {min_bits}, {max_bits}")
    entropy = {n: layer_entropy(t.detach().reshape(-1).float().numpy(), hist_bins) for n, t in tensors.items()}
    if not entropy:
        return {}
    low, high = min(entropy.values()), max(entropy.values())
    if high == low:
        return {n: max_bits for n in entropy}
    return {n: min_bits + round((max_bits - min_bits) * (e - low) / (high - low)) for n, e in entropy.items()}


@dataclass
class QDState:
    """A quantized tensor as QD stores it: codes, code count, minimum and scale."""

    codes: np.ndarray  # uint8, flat
    levels: int  # 2^b
    low: np.float32
    scale: np.float32
    dtype: str
    shape: tuple[int, ...]


@register_codec
class QDCodec(PeerCodec):
    """QD-Compressor's quantizer and cyclic delta (see the module docstring)."""

    name = "qd"
    version = 1
    stable_state = True  # codes are new arrays

    def __init__(self, bits: int = 8, min_numel: int = 4096) -> None:
        super().__init__(min_numel)
        if not isinstance(bits, int) or not 1 <= bits <= 8:
            raise InvalidSettingError(f"QD bits must be an int in [1, 8], got {bits!r}")
        self.bits = bits

    def encode_matrix(self, matrix: np.ndarray, tensor: RawTensor, base: Any) -> Encoded:
        flat = matrix.reshape(-1)
        low, high = np.float32(flat.min()), np.float32(flat.max())
        levels = 1 << self.bits
        scale = np.float32((high - low) / np.float32(levels - 1)) if high > low else np.float32(1)
        codes = np.clip(np.rint((flat - low) / scale), 0, levels - 1).astype(np.uint8)
        state = QDState(codes, levels, low, scale, tensor.dtype, tuple(tensor.shape))
        return self._encode_state(state, base)

    def keyframe(self, state: Any) -> Encoded:
        return self._encode_state(state, None) if isinstance(state, QDState) else super().keyframe(state)

    def _encode_state(self, state: QDState, base: Any) -> Encoded:
        delta = isinstance(base, QDState) and base.codes.size == state.codes.size
        params: dict[str, Any] = {"mode": self.name, "levels": state.levels}
        payload = state.codes
        if delta:
            modulus = max(base.levels, state.levels)
            payload = ((state.codes.astype(np.int16) - base.codes) % modulus).astype(np.uint8)
            params["modulus"] = modulus
        blobs = {
            "codes": lzma.compress(payload.tobytes(), preset=6),
            "range": np.array([state.low, state.scale], dtype="<f4").tobytes(),
        }
        return Encoded(blobs, params, uses_base=delta, state=state)

    def decode_matrix(
        self, dtype: str, shape: tuple[int, ...], matrix: tuple[int, int], params: dict[str, Any], blobs: BlobSource, base: Any
    ) -> QDState:
        where, levels, modulus = blobs.where, params.get("levels"), params.get("modulus")
        n = matrix[0] * matrix[1]
        widths = {1 << b for b in range(1, 9)}
        if levels not in widths or (modulus is not None and modulus not in widths):
            raise CorruptCheckpointError(f"{where}: QD parameters are invalid (levels {levels!r}, modulus {modulus!r})")
        try:
            payload = np.frombuffer(lzma.decompress(blobs("codes").tobytes()), dtype=np.uint8)
        except lzma.LZMAError as exc:
            raise CorruptCheckpointError(f"{where}: the QD code stream does not decompress ({exc})") from None
        bounds = blobs("range")
        if payload.size != n or bounds.size != 8:
            raise CorruptCheckpointError(f"{where}: QD blobs hold {payload.size} codes for {n} values")
        low, scale = bounds.view("<f4")
        if not (np.isfinite(low) and np.isfinite(scale)):
            raise CorruptCheckpointError(f"{where}: the QD minimum or scale is not finite")
        if modulus is not None:
            if not isinstance(base, QDState) or base.codes.size != n or modulus < max(base.levels, levels):
                raise CorruptCheckpointError(f"{where}: a QD delta whose base tensor is missing or does not match")
            payload = ((payload.astype(np.int16) + base.codes) % modulus).astype(np.uint8)
        if payload.max(initial=0) >= levels:
            raise CorruptCheckpointError(f"{where}: a QD code is not below its {levels} levels")
        return QDState(payload, levels, np.float32(low), np.float32(scale), dtype, tuple(shape))

    def to_raw(self, state: Any) -> RawTensor:
        if not isinstance(state, QDState):
            return state
        return as_raw(state.low + state.scale * state.codes.astype(np.float32), state.dtype, state.shape)
