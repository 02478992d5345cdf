"""GOBO (Zadeh et al., MICRO 2020, section III): a Gaussian's outliers kept exact, the rest
clustered to a few centroids with a K-means variant that stops on the L1 error.

Per tensor: fit a Gaussian (mean ``mu``, standard deviation ``sigma`` of all its values); a value
is an *outlier* when its log-density under that Gaussian, ``-((x - mu) / sigma)**2 / 2 -
ln(sigma * sqrt(2 pi))``, is below ``outlier_log_prob`` (-4, the paper's threshold and the
DynaQuant paper's Table 10). Outliers are stored as float32 with their flat positions; the other
values (the "Gaussian group") get one of ``bins`` centroids (the paper uses 8, 3 bits), chosen by
Lloyd iterations (assign each value to its nearest centroid, move each centroid to its members'
mean) that stop as soon as the L1 error ``sum |x - centroid(x)|`` no longer decreases, keeping the
assignment with the smallest L1 error, or after ``max_iterations`` (1,000, Table 10).

Decisions where the sources are silent (the paper's text on initialisation was not available to
us; the DynaQuant paper's "soft termination condition" for its GOBO+ is not described):
the centroids start as the means of ``bins`` equal-count groups of the sorted Gaussian group; an
empty cluster keeps its centroid; the log-density uses the natural logarithm and the population
standard deviation; a tensor whose values are all equal has no outliers. Because the group is
one-dimensional, each iteration works on the sorted values (clusters are contiguous runs, means
and L1 errors come from prefix sums), so an iteration costs ``O(bins log n)`` after one sort.
Codes take ``ceil(log2(bins))`` bits (an outlier's position holds code 0). The DynaQuant paper's
separate bin count for embedding tables (Table 10) is a per-tensor choice of the caller: this
codec applies one ``bins`` to every tensor it is given. No deltas.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError, InvalidSettingError
from ..base import BlobSource, register_codec
from .base import PeerCodec, lloyd_step, nearest_runs, pack_bits, unpack_bits

__all__ = ["GOBOCodec", "gobo_outliers", "gobo_centroids"]


def gobo_outliers(values: np.ndarray, log_prob: float) -> np.ndarray:
    """Mask of the values whose log-density under the values' own Gaussian is below ``log_prob``."""
    x = values.astype(np.float64)
    mu, sigma = x.mean(), x.std()
    if not sigma > 0:
        return np.zeros(values.shape, dtype=bool)
    density = -0.5 * ((x - mu) / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))
    return density < log_prob


def gobo_centroids(values: np.ndarray, bins: int, max_iterations: int) -> np.ndarray:
    """The ascending float64 centroids GOBO's clustering gives ``values`` (see the module docstring)."""
    ordered = np.sort(values.astype(np.float64))
    n = ordered.size
    prefix = np.concatenate(([0.0], np.cumsum(ordered)))

    def l1(centroids: np.ndarray) -> float:
        starts, ends = nearest_runs(ordered, centroids)
        split = np.clip(np.searchsorted(ordered, centroids, side="left"), starts, ends)
        below = centroids * (split - starts) - (prefix[split] - prefix[starts])
        above = (prefix[ends] - prefix[split]) - centroids * (ends - split)
        return float((below + above).sum())

    edges = np.linspace(0, n, bins + 1).round().astype(np.int64)
    counts = np.diff(edges)
    means = (prefix[edges[1:]] - prefix[edges[:-1]]) / np.maximum(counts, 1)
    centroids = np.maximum.accumulate(np.where(counts > 0, means, -np.inf))  # empty leading groups
    centroids = np.where(np.isfinite(centroids), centroids, ordered[0] if n else 0.0)
    best, best_l1 = centroids, l1(centroids)
    for _ in range(max_iterations):
        moved = lloyd_step(ordered, prefix, best)
        error = l1(moved)
        if not error < best_l1:
            break
        best, best_l1 = moved, error
    return best


@register_codec
class GOBOCodec(PeerCodec):
    """GOBO's outlier-aware clustering (see the module docstring)."""

    name = "gobo"
    version = 1

    def __init__(
        self, bins: int = 8, outlier_log_prob: float = -4.0, max_iterations: int = 1000, min_numel: int = 4096
    ) -> None:
        super().__init__(min_numel)
        if not isinstance(bins, int) or not 2 <= bins <= 256:
            raise InvalidSettingError(f"GOBO bins must be an int in [2, 256], got {bins!r}")
        if not isinstance(max_iterations, int) or max_iterations < 0:
            raise InvalidSettingError(f"GOBO max_iterations must be an int >= 0, got {max_iterations!r}")
        if not math.isfinite(outlier_log_prob):
            raise InvalidSettingError(f"GOBO outlier_log_prob must be finite, got {outlier_log_prob!r}")
        self.bins, self.outlier_log_prob, self.max_iterations = bins, float(outlier_log_prob), max_iterations

    def quantize(self, matrix: np.ndarray) -> tuple[dict[str, bytes], dict[str, Any], np.ndarray]:
        flat = matrix.reshape(-1)
        outlier = gobo_outliers(flat, self.outlier_log_prob)
        group = flat[~outlier]
        centroids = gobo_centroids(group, self.bins, self.max_iterations).astype(np.float32)
        codes = np.searchsorted((centroids[1:] + centroids[:-1]) / 2, flat, side="left").astype(np.uint8)
        positions = np.flatnonzero(outlier)
        codes[positions] = 0
        decoded = centroids[codes]
        decoded[positions] = flat[positions]
        blobs = {
            "codes": pack_bits(codes, math.ceil(math.log2(self.bins))).tobytes(),
            "centroids": centroids.tobytes(),
            "outlier_positions": positions.astype("<u8").tobytes(),
            "outlier_values": flat[positions].astype("<f4").tobytes(),
        }
        return blobs, {"bins": self.bins}, decoded.reshape(matrix.shape)

    def dequantize(self, shape: tuple[int, int], params: dict[str, Any], blobs: BlobSource) -> np.ndarray:
        where, bins = blobs.where, params.get("bins")
        if not isinstance(bins, int) or not 2 <= bins <= 256:
            raise CorruptCheckpointError(f"{where}: GOBO parameters are invalid (bins {bins!r})")
        n, bits = shape[0] * shape[1], math.ceil(math.log2(bins))
        packed, centroids = blobs("codes"), blobs("centroids")
        positions, values = blobs("outlier_positions"), blobs("outlier_values")
        if (
            packed.size != -(-n * bits // 8)
            or centroids.size != 4 * bins
            or positions.size % 8
            or values.size * 2 != positions.size
        ):
            raise CorruptCheckpointError(f"{where}: GOBO blobs do not fit {n} values in {bins} bins")
        codes = unpack_bits(packed, bits, n)
        levels, at = centroids.view("<f4"), positions.view("<u8")
        if codes.max(initial=0) >= bins or at.max(initial=0) >= n or not np.isfinite(levels).all():
            raise CorruptCheckpointError(f"{where}: a GOBO code, centroid or outlier position is out of range")
        out = levels[codes].astype(np.float32)
        out[at] = values.view("<f4")
        return out.reshape(shape)
