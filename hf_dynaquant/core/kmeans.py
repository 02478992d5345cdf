"""Approximate K-means (DynaQuant Alg. 1 and 3): weighted 1-D k-means on sketch buckets.

Clustering millions of weights directly is slow; clustering the few thousand buckets of a
:class:`~hf_dynaquant.core.sketch.LogSketch` instead, each weighted by how many values it holds,
gives nearly the same centres (the paper's Prop. 4.1 bounds the loss difference by the sketch's
relative accuracy). DynaQuant's twist: a bucket's weight mixes its normalised frequency with its
normalised magnitude, ``sigma * freq + (1 - sigma) * |centre|``, so that rare large weights,
which matter most to the model, get resolution too (``sigma = 1`` is plain k-means).

The clustering sketch defaults to ``alpha = 0.001``: with 1% buckets (the quantile sketch's
default) bucket centres sit up to a twentieth of a cluster apart at K = 32, which cost 15-20% in
quantization MSE on real weights; 0.1% buckets match sklearn's KMeans and stay >100x faster.

Seeding is weighted k-means++ (Alg. 3). The paper's listing weights the distance D; we use D^2,
the k-means++ of Arthur & Vassilvitskii whose O(log k) guarantee Prop. A.2 relies on. Lloyd
iterations then run to convergence (no assignment changes). In 1-D the assignment step is a
``searchsorted`` on the midpoints between sorted centres.
"""

from __future__ import annotations

import numpy as np

from .kernels import native
from .sketch import LogSketch

__all__ = ["weighted_kmeans", "approximate_kmeans", "bucket_weights", "assign", "KMEANS_ALPHA"]


def assign(values: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Index of the nearest centre (``centres`` sorted ascending) for every value."""
    return np.searchsorted((centres[1:] + centres[:-1]) / 2, values, side="left")


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probabilities ``p`` (summing to 1): the draw ``rng.choice(p.size,
    p=p)`` makes (its cumulative sum, normalised, searched for one uniform number), without
    choice's checks of ``p``, which cost as much again (so a ``p`` that is not a distribution,
    which ``choice`` refuses, draws something; the weights here are finite and positive)."""
    cdf = p.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def _seed(points: np.ndarray, weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Weighted k-means++: each next centre drawn with probability proportional to w * D^2."""
    chosen = [_draw(weights / weights.sum(), rng)]
    d2 = (points - points[chosen[0]]) ** 2
    for _ in range(1, k):
        score = weights * d2
        total = score.sum()
        if total <= 0:  # every point already is a centre
            break
        nxt = _draw(score / total, rng)
        chosen.append(nxt)
        d2 = np.minimum(d2, (points - points[nxt]) ** 2)
    return np.sort(points[chosen])


def weighted_kmeans(
    points: np.ndarray, weights: np.ndarray, k: int, *, seed: int = 0, max_iter: int = 300
) -> np.ndarray:
    """Sorted centres of a weighted 1-D k-means; fewer than ``k`` when there are fewer
    distinct points with positive weight. Deterministic for a given ``seed``.

    Points are sorted once, so a cluster is a contiguous run of points and one Lloyd iteration
    is ``k - 1`` binary searches plus prefix-sum differences: O(k log m), not O(m). The
    iterations run in the C kernels where they are built (``lloyd_f64``, the same centres bit
    for bit, with the GIL released); this loop is their reference.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    points = np.asarray(points, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    keep = weights > 0
    points, weights = points[keep], weights[keep]
    if points.size == 0:
        raise ValueError("k-means needs at least one point with positive weight")
    order = np.argsort(points, kind="stable")
    points, weights = points[order], weights[order]
    if np.unique(points).size <= k:
        return np.unique(points)
    cum_w = np.concatenate(([0.0], np.cumsum(weights)))
    cum_wx = np.concatenate(([0.0], np.cumsum(weights * points)))
    centres = _seed(points, weights, k, np.random.default_rng(seed))
    if native is not None and np.isfinite(cum_w[-1]) and np.isfinite(cum_wx[-1]):  # (finite: no NaN centre)
        native.lloyd_f64(points, weights, cum_w, cum_wx, centres, max_iter)
        return centres
    bounds = None
    for _ in range(max_iter):
        # cluster j holds points[bounds[j]:bounds[j+1]]: those nearer to centre j than to its neighbours
        new_bounds = np.concatenate(
            ([0], np.searchsorted(points, (centres[1:] + centres[:-1]) / 2, side="right"), [points.size])
        )
        if bounds is not None and np.array_equal(new_bounds, bounds):
            break
        bounds = new_bounds
        mass = np.diff(cum_w[bounds])
        sums = np.diff(cum_wx[bounds])
        empty = mass <= 0
        centres = np.where(empty, centres, sums / np.where(empty, 1, mass))
        if empty.any():  # re-seed empty clusters at the points worst served
            err = weights * (points - centres[assign(points, centres)]) ** 2
            worst = np.argsort(-err, kind="stable")[: int(empty.sum())]
            centres[np.flatnonzero(empty)] = points[worst]
        centres = np.sort(centres)
    return centres


def bucket_weights(centres: np.ndarray, counts: np.ndarray, sigma: float) -> np.ndarray:
    """``sigma * normalised frequency + (1 - sigma) * normalised magnitude`` (Alg. 1, line 3)."""
    if not 0 <= sigma <= 1:
        raise ValueError(f"sigma must be in [0, 1], got {sigma}")
    freq = counts / max(counts.sum(), 1)
    mag = np.abs(centres)
    mag = mag / mag.sum() if mag.sum() > 0 else np.zeros_like(mag)
    return sigma * freq + (1 - sigma) * mag


KMEANS_ALPHA = 0.001  # the relative accuracy of the sketch the centres are clustered from


def approximate_kmeans(
    values: LogSketch | np.ndarray, k: int, *, sigma: float = 0.2, alpha: float = KMEANS_ALPHA, seed: int = 0
) -> np.ndarray:
    """DynaQuant's approximate K-means: ``k`` sorted centres for ``values`` (or a ready sketch)."""
    sketch = values if isinstance(values, LogSketch) else LogSketch(alpha).add(values)
    centres, counts = sketch.buckets()
    return weighted_kmeans(centres, bucket_weights(centres, counts, sigma), k, seed=seed)
