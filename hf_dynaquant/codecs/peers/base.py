"""What every peer codec shares: which tensors it quantizes, and exact storage of the others.

The peers' papers quantize weight matrices (and embedding tables); biases, norms, integer buffers
and anything holding NaN or inf are outside their methods. A :class:`PeerCodec` quantizes float
tensors of at least two dimensions and ``min_numel`` values whose values are all finite, seen as
a matrix of rows along the last dimension (``(numel / shape[-1], shape[-1])``, row-major), and
stores every other tensor bit-exactly through the lossless codec, so nothing a method cannot
represent is lost. A record's ``params.mode`` says which (FORMAT.md section 13).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...core.dtypes import FLOAT_LAYOUTS, RawTensor, from_raw, to_raw, torch_dtype
from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, Codec, Encoded
from ..lossless import LosslessCodec

__all__ = ["PeerCodec", "as_raw", "lloyd_step", "nearest_runs", "pack_bits", "unpack_bits"]


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """``codes`` (uint8, each below ``2**bits``) as a bit stream, ``bits`` per code, least
    significant bit first (so 4-bit codes sit two to a byte, the first in the low nibble)."""
    planes = (codes[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The ``n`` codes :func:`pack_bits` packed."""
    planes = np.unpackbits(packed, count=n * bits, bitorder="little").reshape(n, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)


def nearest_runs(ordered: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of each ascending centroid's run in the sorted values: a value belongs
    to the nearest centroid, a value at a midpoint to the lower one."""
    ends = np.searchsorted(ordered, (centroids[1:] + centroids[:-1]) / 2, side="right")
    return np.concatenate(([0], ends)), np.concatenate((ends, [ordered.size]))


def lloyd_step(ordered: np.ndarray, prefix: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """One Lloyd iteration of 1-D K-means on sorted values (``prefix``: their cumulative sums
    with a leading 0): each centroid moves to its run's mean (an empty run keeps its centroid);
    returned ascending."""
    starts, ends = nearest_runs(ordered, centroids)
    sizes = ends - starts
    return np.sort(np.where(sizes > 0, (prefix[ends] - prefix[starts]) / np.maximum(sizes, 1), centroids))


class PeerCodec(Codec):
    """A peer method's codec (see the module docstring). A method without deltas implements
    :meth:`quantize` and :meth:`dequantize` on a float32 matrix; one with deltas overrides
    :meth:`encode_matrix` and :meth:`decode_matrix`, which see the base entry's state."""

    def __init__(self, min_numel: int = 4096) -> None:
        if not isinstance(min_numel, int) or min_numel < 0:
            raise InvalidSettingError(f"{self.name} min_numel must be an int >= 0, got {min_numel!r}")
        self.min_numel = min_numel
        self._lossless = LosslessCodec(delta=False)

    def max_blobs(self, numel: int) -> int:
        return max(4, self._lossless.max_blobs(numel))

    def quantizes(self, tensor: RawTensor) -> bool:
        """Whether ``tensor`` is quantized (when its values are finite) or stored losslessly."""
        return tensor.dtype in FLOAT_LAYOUTS and len(tensor.shape) >= 2 and tensor.bits.size >= max(self.min_numel, 1)

    def quantize(self, matrix: np.ndarray) -> tuple[dict[str, bytes], dict[str, Any], np.ndarray]:
        """``(blobs, params, decoded)`` of a finite float32 matrix; ``decoded`` is what
        :meth:`dequantize` will give back (float32, the matrix's shape)."""
        raise NotImplementedError(f"{type(self).__name__} implements encode_matrix instead")

    def dequantize(self, shape: tuple[int, int], params: dict[str, Any], blobs: BlobSource) -> np.ndarray:
        """The float32 matrix of ``shape`` a record stored; damaged input raises
        :class:`CorruptCheckpointError` naming ``blobs.where``."""
        raise NotImplementedError(f"{type(self).__name__} implements decode_matrix instead")

    def encode_matrix(self, matrix: np.ndarray, tensor: RawTensor, base: Any) -> Encoded:
        """A quantized record of ``tensor`` (``matrix``: its finite values as float32 rows)."""
        blobs, params, decoded = self.quantize(matrix)
        return Encoded(blobs, {"mode": self.name, **params}, state=as_raw(decoded, tensor.dtype, tensor.shape))

    def decode_matrix(
        self, dtype: str, shape: tuple[int, ...], matrix: tuple[int, int], params: dict[str, Any], blobs: BlobSource, base: Any
    ) -> Any:
        """The state of a quantized record (``matrix``: its rows and columns)."""
        return as_raw(self.dequantize(matrix, params, blobs), dtype, shape)

    def encode(self, tensor: RawTensor, base: Any = None) -> Encoded:
        if self.quantizes(tensor):
            matrix = from_raw(tensor).detach().reshape(-1, tensor.shape[-1]).to(torch.float32).numpy()
            if np.isfinite(matrix).all():
                return self.encode_matrix(matrix, tensor, base)
        return self.exact(tensor)

    def exact(self, tensor: RawTensor) -> Encoded:
        """A record of ``tensor`` stored bit-exactly (mode ``"lossless"``)."""
        encoded = self._lossless.encode(tensor)
        return Encoded(encoded.blobs, {"mode": "lossless", **encoded.params}, state=encoded.state)

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
        mode = params.get("mode")
        if mode == "lossless":
            return self._lossless.decode(dtype, shape, params, blobs)
        if mode != self.name:
            raise CorruptCheckpointError(f"{blobs.where}: unknown {self.name} mode {mode!r}")
        if dtype not in FLOAT_LAYOUTS or len(shape) < 2:
            raise CorruptCheckpointError(f"{blobs.where}: a {self.name} record must be a float matrix, not {dtype} {shape}")
        cols = int(shape[-1])
        rows = int(np.prod(shape, dtype=np.int64)) // max(cols, 1)
        return self.decode_matrix(dtype, tuple(shape), (rows, cols), params, blobs, base)


def as_raw(values: np.ndarray, dtype: str, shape: tuple[int, ...]) -> RawTensor:
    """float32 ``values`` as a tensor of ``dtype`` (rounded to nearest) and ``shape``."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    return to_raw(t.to(torch_dtype(dtype)))
