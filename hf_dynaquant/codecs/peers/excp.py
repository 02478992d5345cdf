"""ExCP (Li et al., ICML 2024): the residual between consecutive checkpoints and Adam's moments,
pruned together ("weight-momentum joint shrinking"), then K-means quantized; as the authors'
code (github.com/Gaffey/ExCP, ``compress_pythia.py``) does it.

Per parameter, with ``dW = W - W_prev`` (the previous checkpoint *as restored*), Adam's first
moment ``m`` (``exp_avg``) and second moment ``v`` (``exp_avg_sq``), :func:`excp_shrink`:

* weight shrinking: ``s = min(2.5, alpha / sqrt(mean(v)))``, and ``dW`` keeps the values with
  ``|dW| > s * median(|dW|)`` (``alpha`` 5e-5 by default, as the authors' scripts; the median of
  an even count is the lower middle value, as ``torch.median`` gives it);
* momentum shrinking: ``m`` and ``v`` keep the values where ``|m| > beta * mean(|m|)`` and
  ``dW`` was kept (``beta`` 2.0), both masked by that one rule as in the code.

:class:`ExCPCodec` then quantizes a tensor's non-zero values with K-means to ``2^bits - 1``
centres (4 bits by default); code 0 is an exact zero, the codebook is float16 (as the code stores
it), codes are packed ``bits`` at a time and then, by default, LZMA-compressed (``packing``): the
authors measure their checkpoints after 7-Zip, whose default method is LZMA, and the shrunk codes
are mostly zeros, which packing alone would store at ``bits`` bits each. With ``delta=`` (the shrunk ``dW`` of the tensor being
written) the record is a residual on its base entry (``reference_kind`` ``"previous"``): it
decodes to the base's restored values plus the quantized residual. A tensor with no more non-zero
values than centres is stored exactly, as the code does; every float tensor is a candidate (the
code shrinks every parameter, biases and norms too).

Decisions where the code leaves things open: the authors cluster with FAISS (25 Lloyd iterations
from random data points, trained on a subsample of at most 256 points per centre); here, 25 Lloyd
iterations on all non-zero values from ``2^bits - 1`` distinct values drawn with a fixed seed, in
1-D on sorted runs (deterministic, no FAISS). A parameter's moments are written as tensors of
their own (:func:`excp_state`). A first checkpoint (no previous) stores the weights exactly and
shrinks the moments with ``dW`` taken as all kept. No entropy coder is applied (the code has
none; its README compares with 7-Zip): ``packing="lzma"`` (Python's ``lzma``, preset 6, per
tensor) stands in for that 7-Zip pass, ``packing="none"`` stores the packed codes as they are.
"""

from __future__ import annotations

import lzma
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...core.dtypes import FLOAT_LAYOUTS, RawTensor, from_raw
from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, Encoded, register_codec
from .base import PeerCodec, as_raw, lloyd_step, pack_bits, unpack_bits

__all__ = ["ExCPCodec", "excp_shrink", "excp_state", "kmeans_nonzero"]

PACKINGS = ("lzma", "none")  # how the packed codes are stored (see the module docstring)
SEED = 1234  # the codebook's initial draw (FAISS's default seed, which the authors' code uses)


def excp_shrink(
    delta: np.ndarray | None, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, alpha: float = 5e-5, beta: float = 2.0
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(dW, m, v)`` after ExCP's weight-momentum joint shrinking (see the module docstring);
    ``delta`` ``None``: a first checkpoint, whose weights are kept whole."""
    kept = np.ones(exp_avg.shape, dtype=bool)
    if delta is not None:
        mean_v = float(exp_avg_sq.astype(np.float64).mean())
        s = min(2.5, alpha / math.sqrt(mean_v)) if mean_v > 0 else 2.5
        magnitude = np.abs(delta)
        middle = (magnitude.size - 1) // 2  # torch.median's lower middle, as the authors' code takes it
        kept = magnitude > s * float(np.partition(magnitude, middle)[middle])
        delta = np.where(kept, delta, 0).astype(delta.dtype)
    keep = (np.abs(exp_avg) > beta * float(np.abs(exp_avg).astype(np.float64).mean())) & kept
    return delta, np.where(keep, exp_avg, 0).astype(exp_avg.dtype), np.where(keep, exp_avg_sq, 0).astype(exp_avg_sq.dtype)


def kmeans_nonzero(values: np.ndarray, centres: int, iterations: int = 25) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, codebook)``: each value's code (0 for an exact zero, else 1 + its nearest centre)
    and the float16 codebook of the non-zero values' K-means centres."""
    flat = values.reshape(-1).astype(np.float64)
    nonzero = flat[flat != 0]
    distinct = np.unique(nonzero)
    rng = np.random.default_rng(SEED)
    centroids = np.sort(rng.choice(distinct, size=min(centres, distinct.size), replace=False))
    ordered = np.sort(nonzero)
    prefix = np.concatenate(([0.0], np.cumsum(ordered)))
    for _ in range(iterations):
        centroids = lloyd_step(ordered, prefix, centroids)
    codebook = np.sort(centroids.astype(np.float16))
    as_float = codebook.astype(np.float64)
    nearest = np.searchsorted((as_float[1:] + as_float[:-1]) / 2, flat, side="left") + 1
    codes = np.where(flat == 0, 0, nearest).astype(np.uint8)
    return codes, codebook


@register_codec
class ExCPCodec(PeerCodec):
    """ExCP's K-means of the shrunk values (see the module docstring). ``delta``: the shrunk
    residual of the tensor being written (its record is then a residual on the base entry)."""

    name = "excp"
    version = 2  # 2: params.packing ("lzma"); records without it (version 1) hold the packed codes as they are

    def __init__(self, bits: int = 4, delta: np.ndarray | None = None, packing: str = "lzma") -> None:
        super().__init__(min_numel=0)
        if not isinstance(bits, int) or not 1 <= bits <= 8:
            raise InvalidSettingError(f"ExCP bits must be an int in [1, 8], got {bits!r}")
        if packing not in PACKINGS:
            raise InvalidSettingError(f"ExCP packing must be one of {PACKINGS}, got {packing!r}")
        self.bits, self.delta, self.packing = bits, delta, packing

    def reference_kind(self, params: dict[str, Any]) -> str | None:
        return params.get("residual")

    def quantizes(self, tensor: RawTensor) -> bool:
        return tensor.dtype in FLOAT_LAYOUTS and tensor.bits.size > 0

    def encode(self, tensor: RawTensor, base: Any = None) -> Encoded:
        if self.delta is None:
            values = from_raw(tensor).reshape(-1).to(torch.float32).numpy()
            return self._encode(values, tensor, None) if self.quantizes(tensor) else self.exact(tensor)
        if not isinstance(base, RawTensor) or base.shape != tensor.shape:
            raise InvalidSettingError("an ExCP residual needs its base entry's tensor of the same shape (write with base=)")
        return self._encode(np.asarray(self.delta, dtype=np.float32).reshape(-1), tensor, base)

    def _encode(self, values: np.ndarray, tensor: RawTensor, base: RawTensor | None) -> Encoded:
        centres = (1 << self.bits) - 1
        if not np.isfinite(values).all() or np.count_nonzero(values) <= centres:
            return self.exact(tensor)  # for a residual: the weights themselves
        codes, codebook = kmeans_nonzero(values, centres)
        decoded = np.concatenate(([0.0], codebook.astype(np.float32)))[codes].astype(np.float32)
        params: dict[str, Any] = {"mode": self.name, "bits": self.bits, "centres": int(codebook.size)}
        if base is not None:
            params["residual"] = "previous"
            decoded = decoded + from_raw(base).reshape(-1).to(torch.float32).numpy()
        packed = pack_bits(codes, self.bits).tobytes()
        if self.packing == "lzma":
            params["packing"], packed = "lzma", lzma.compress(packed, preset=6)
        blobs = {"codes": packed, "codebook": codebook.astype("<f2").tobytes()}
        return Encoded(blobs, params, uses_base=base is not None, state=as_raw(decoded, tensor.dtype, tensor.shape))

    def decode(
        self,
        dtype: str,
        shape: tuple[int, ...],
        params: dict[str, Any],
        blobs: BlobSource,
        base: Any = None,
        *,
        reference: np.ndarray | None = None,
    ) -> Any:
        if params.get("mode") != self.name:
            return super().decode(dtype, shape, params, blobs, base, reference=reference)
        where, bits, count = blobs.where, params.get("bits"), params.get("centres")
        if not isinstance(bits, int) or not 1 <= bits <= 8 or not isinstance(count, int) or not 1 <= count < 1 << bits:
            raise CorruptCheckpointError(f"{where}: ExCP parameters are invalid (bits {bits!r}, centres {count!r})")
        n = int(np.prod(shape, dtype=np.int64))
        packed, codebook, packing = blobs("codes"), blobs("codebook"), params.get("packing", "none")
        if packing not in PACKINGS:
            raise CorruptCheckpointError(f"{where}: ExCP packing {packing!r} is unknown")
        if packing == "lzma":
            try:
                packed = np.frombuffer(lzma.decompress(packed.tobytes()), dtype=np.uint8)
            except lzma.LZMAError as exc:
                raise CorruptCheckpointError(f"{where}: ExCP codes do not decompress: {exc}") from None
        if packed.size != -(-n * bits // 8) or codebook.size != 2 * count or dtype not in FLOAT_LAYOUTS:
            raise CorruptCheckpointError(f"{where}: ExCP blobs do not fit {n} values and {count} centres")
        codes = unpack_bits(packed, bits, n)
        levels = codebook.view("<f2").astype(np.float32)
        if codes.max(initial=0) > count or not np.isfinite(levels).all():
            raise CorruptCheckpointError(f"{where}: an ExCP code or centre is out of range")
        values = np.concatenate(([np.float32(0)], levels))[codes]
        if params.get("residual") is not None:
            if reference is None or reference.size != n:
                raise CorruptCheckpointError(f"{where}: an ExCP residual whose base tensor is missing")
            values = values + reference
        return as_raw(values, dtype, tuple(shape))


def excp_state(
    weights: Mapping[str, torch.Tensor],
    previous: Mapping[str, torch.Tensor] | None,
    exp_avg: Mapping[str, torch.Tensor],
    exp_avg_sq: Mapping[str, torch.Tensor],
    *,
    alpha: float = 5e-5,
    beta: float = 2.0,
    bits: int = 4,
) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
    """One ExCP checkpoint as store sections and the ``codecs=`` chooser for
    :meth:`CheckpointStore.write` (with ``base=`` the previous entry when ``previous`` is given):
    ``model`` holds the weights (residuals on the previous entry's restored weights), ``exp_avg``
    and ``exp_avg_sq`` the shrunk moments of the parameters named in them."""
    sections: dict[str, dict[str, torch.Tensor]] = {"model": dict(weights), "exp_avg": {}, "exp_avg_sq": {}}
    codecs: dict[tuple[str, str], ExCPCodec] = {}
    for name, w in weights.items():
        if name not in exp_avg:
            continue
        delta = None
        if previous is not None:
            delta = (w.detach().float() - previous[name].detach().float()).reshape(-1).numpy()
        delta, m, v = excp_shrink(
            delta, exp_avg[name].detach().float().reshape(-1).numpy(), exp_avg_sq[name].detach().float().reshape(-1).numpy(),
            alpha, beta,
        )
        if delta is not None:
            codecs[("model", name)] = ExCPCodec(bits, delta=delta)
        sections["exp_avg"][name] = torch.from_numpy(m).reshape(w.shape).to(exp_avg[name].dtype)
        sections["exp_avg_sq"][name] = torch.from_numpy(v).reshape(w.shape).to(exp_avg_sq[name].dtype)

    def choose(section: str, name: str) -> Any:
        if section == "model":
            return codecs.get((section, name), "lossless")
        return ExCPCodec(bits)

    return sections, choose
