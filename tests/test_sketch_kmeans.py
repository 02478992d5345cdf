"""Quantile sketch and approximate K-means against exact and library references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddsketch import DDSketch

from hf_dynaquant.core import kmeans as kmeans_mod
from hf_dynaquant.core import sketch as sketch_mod
from hf_dynaquant.core.kmeans import approximate_kmeans, assign, bucket_weights, weighted_kmeans
from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization, remaining_sketch
from hf_dynaquant.core.sketch import SAMPLE_FROM, SAMPLE_WEIGHT, LogSketch, sample

QS = [0.0, 0.0005, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 0.9995, 1.0]


def data(kind: str, n: int = 200_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return {
        "normal": rng.normal(0, 0.02, n),
        "lognormal": rng.lognormal(-3, 2, n),
        "zeros": np.where(rng.random(n) < 0.3, 0.0, rng.normal(0, 1, n)),
        "negative": -np.abs(rng.standard_cauchy(n)),
    }[kind].astype(np.float32)


@pytest.mark.parametrize("kind", ["normal", "lognormal", "zeros", "negative"])
@pytest.mark.parametrize("alpha", [0.01, 0.002])
def test_quantiles_within_relative_error(kind: str, alpha: float) -> None:
    x = data(kind)
    est = LogSketch(alpha).add(x).quantiles(QS)
    exact = np.quantile(x.astype(np.float64), QS, method="lower")
    tol = alpha * np.abs(exact) + 1e-30
    assert np.all(np.abs(est - exact) <= tol * (1 + 1e-9)), (est, exact)


def test_matches_ddsketch() -> None:
    x = data("normal", 20_000).astype(np.float64)
    ours = LogSketch(0.01).add(x)
    ref = DDSketch(relative_accuracy=0.01)
    for v in x.tolist():
        ref.add(v)
    for q in (0.01, 0.1, 0.5, 0.9, 0.99):
        assert ours.quantile(q) == pytest.approx(ref.get_quantile_value(q), rel=1e-6)


def test_merge_equals_sketch_of_union_and_serialises() -> None:
    x = data("zeros")
    a, b = LogSketch(0.01).add(x[:70_000]), LogSketch(0.01).add(x[70_000:])
    whole = LogSketch(0.01).add(x)
    assert a.merge(b).to_dict() == whole.to_dict()
    assert LogSketch.from_dict(whole.to_dict()).to_dict() == whole.to_dict()
    with pytest.raises(ValueError, match="cannot merge"):
        LogSketch(0.01).merge(LogSketch(0.02))


def test_sample_reads_an_even_eighth_of_large_tensors_and_shards_sample_what_the_whole_does() -> None:
    """Below SAMPLE_FROM values a sketch reads all of them; from it, whole blocks of 64 (one in
    8, each value weighing 8), in order, spread evenly: gaps of 5, 8 or 13 blocks, and every
    column of a matrix read about as often. Shards cut anywhere (mid-block too) sample exactly
    the positions the whole tensor samples, and any tensor (codes) the same positions."""
    small = torch.arange(SAMPLE_FROM - 1, dtype=torch.float32)
    x, weight = sample(small, small.numel())
    assert weight == 1 and x.data_ptr() == small.data_ptr()
    rows, cols = 1100, 1000
    n = rows * cols
    whole = torch.arange(n, dtype=torch.float64)  # each value is its own position
    x, weight = sample(whole, n)
    at = x.long().numpy()
    assert weight == SAMPLE_WEIGHT == 8 and np.all(np.diff(at) > 0)
    assert abs(at.size * weight - n) < 0.001 * n
    blocks, per_block = np.unique(at // 64, return_counts=True)
    assert np.all(per_block[:-1] == 64) and set(np.diff(blocks).tolist()) == {5, 8, 13}
    per_column = np.bincount(at % cols, minlength=cols)
    assert per_column.min() > 0.8 * per_column.mean() and per_column.max() < 1.2 * per_column.mean()
    cuts = [0, 1, 63, 64, 1000, 12_345, 557_000, 557_001, n]
    shards = [sample(whole[a:b], n, a) for a, b in zip(cuts, cuts[1:])]
    assert all(w == SAMPLE_WEIGHT for _, w in shards)
    assert torch.equal(torch.cat([s for s, _ in shards]), x)
    # a sample is a copy (one piece or several): the tensor sampled may change after
    for (s, _), a, b in zip(shards, cuts, cuts[1:]):
        if s.numel():
            values = whole[a:b]
            start, end = values.data_ptr(), values.data_ptr() + values.numel() * values.element_size()
            assert not start <= s.data_ptr() < end
    codes = (whole.long() % 251).to(torch.uint8)
    assert torch.equal(sample(codes, n)[0].long(), x.long() % 251)


def test_weighted_sketches_count_each_value_weight_times() -> None:
    x = torch.from_numpy(data("zeros"))
    one, eight = LogSketch(0.01).add(x), LogSketch(0.01).add(x, weight=8)
    assert eight.count == 8 * one.count and eight.zeros == 8 * one.zeros
    assert np.array_equal(eight.quantiles(QS), one.quantiles(QS))
    codes = (torch.arange(x.numel()) % 3).to(torch.uint8).numpy()
    picked = LogSketch(0.001).add(x, where=(codes, 1), weight=8)
    assert picked.to_dict() == LogSketch(0.001).add(x[torch.from_numpy(codes == 1)], weight=8).to_dict()
    magnitudes = LogSketch(0.01).add(x, magnitude=True, weight=8)
    assert magnitudes.count == 8 * x.numel() and magnitudes.negative.total == 0
    with pytest.raises(ValueError, match="positive integer"):
        LogSketch(0.01).add(x, weight=0)


def test_plans_of_large_tensors_from_samples_stay_near_the_exact_ones() -> None:
    """A tensor of 2^20 values or more is planned from sketches of a sample: the share it
    protects and prunes stays within 10% of the configured one, its codebook near
    the one K-means makes of every value, and merged shard sketches (rows cut mid-block) equal
    the whole tensor's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1100, 1000, generator=g) * torch.logspace(-2, 0, 1000)
    config = QuantConfig(bins=8, prune=0.1, protect=0.005, min_numel=1024)
    tp = plan_quantization({"w": w}, config).tensors["w"]
    codes, _ = tp.codes(w.reshape(-1).numpy())
    # (from every value, this tensor's shares land 4% off too: a threshold is a bucket of 2% width)
    assert abs((codes == 1).mean() / 0.005 - 1) < 0.1 and abs((codes == 0).mean() / 0.1 - 1) < 0.1
    exact = approximate_kmeans(
        LogSketch(0.001).add(w.reshape(-1), where=(tp.codes(w.reshape(-1).numpy(), np.zeros(0, np.float32))[0], 2)), 8
    )
    assert np.allclose(np.sort(tp.centres), np.sort(exact), rtol=0.03, atol=1e-4)
    flat = w.reshape(-1).numpy()
    whole = remaining_sketch(tp, flat, None, flat.size)
    merged = LogSketch(0.001)
    for a, b in ((0, 557_000), (557_000, flat.size)):
        merged.merge(remaining_sketch(tp, flat[a:b], None, flat.size, a))
    assert merged.to_dict() == whole.to_dict()


@pytest.mark.parametrize("alpha", [0.01, 0.001, 2e-4])
def test_kernel_and_torch_paths_agree(alpha: float) -> None:
    """The compiled sketch (a slot per fine bucket of the float32 bits and where in it the next
    key begins, the exact rule only around the zero threshold, infinities and NaN) counts what
    the torch path computes from logarithms, value by value: across the whole float32 range, on
    either side of key boundaries, at and around the threshold below which magnitudes count as
    zero, subnormals, signed zeros and infinities, and with only the values of one code counted.
    At 0.01 and 0.001 (the K-means sketch's accuracy) the table places the boundaries; at 2e-4
    it has too many slots to hold and every value takes the exact rule."""
    g = torch.Generator().manual_seed(3)
    x = torch.from_numpy(data("lognormal")) * torch.sign(torch.randn(200_000, generator=g))
    x[:10] = float("inf")
    x[10:20] = -float("inf")
    tiny = np.float32(sketch_mod._MIN_INDEXABLE)
    near = np.nextafter(tiny, np.float32(np.inf)), np.nextafter(tiny, np.float32(0)), tiny
    edge = [*near, 1e-31, 1e-45, 1e-39, 0.0, -0.0, 3.4e38, 1.0, 2.0, 0.5, 1e-20, 1e20]
    x[20 : 20 + 2 * len(edge)] = torch.tensor(edge + [-v for v in edge], dtype=torch.float32)
    bits = torch.randint(0, 0x7F800000, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
    gamma = (1 + alpha) / (1 - alpha)  # 40 key boundaries (powers of gamma) from 1e-3, as float32s, and neighbours
    first = int(np.ceil(np.log(1e-3) / np.log(gamma)))
    bounds = torch.tensor([gamma**k for k in range(first, first + 40)], dtype=torch.float64).float()
    around = torch.cat([torch.nextafter(bounds, torch.tensor(0.0)), bounds, torch.nextafter(bounds, torch.tensor(1.0))])
    x = torch.cat([x, bits.view(torch.float32), -bits.view(torch.float32), around, -around])  # every exponent
    fast = LogSketch(alpha).add(x)
    slow = LogSketch(alpha)
    slow._add_torch(x)
    assert fast.to_dict() == slow.to_dict()
    codes = torch.randint(0, 4, (x.numel(),), generator=g).to(torch.uint8).numpy()
    only = LogSketch(alpha).add(x, where=(codes, 2))
    gathered = LogSketch(alpha)
    gathered._add_torch(x[torch.from_numpy(codes == 2)])
    assert only.to_dict() == gathered.to_dict()
    x[5] = float("nan")
    codes[5] = 0  # a NaN among the values not counted is not looked at
    assert LogSketch(alpha).add(x, where=(codes, 2)).to_dict() == only.to_dict()
    with pytest.raises(ValueError, match="NaN"):
        LogSketch(alpha).add(x, where=(codes, 0))
    empty = LogSketch(alpha).add(torch.zeros(0))  # (a rank's empty shard)
    assert empty.count == 0 and empty.to_dict() == LogSketch(alpha).to_dict()


@pytest.mark.parametrize("alpha", [0.01, 0.001, 0.0037])
def test_sketch_table_counts_every_buckets_ends_as_the_exact_rule(monkeypatch, alpha: float) -> None:
    """Every fine bucket's first and last value (and the values beside each split), counted
    through the table, land where the exact rule puts them: a bucket the table gives one slot
    without reading its first value (its last's slot is the bucket before's) holds it
    throughout. Threads asking for a table at once wait for one to be made."""
    import threading

    from hf_dynaquant.core.kernels import native

    monkeypatch.setattr(sketch_mod, "_TABLES", {})
    made = []
    real = sketch_mod._new_slot_table
    monkeypatch.setattr(sketch_mod, "_new_slot_table", lambda a: made.append(a) or real(a))
    tables = []
    threads = [threading.Thread(target=lambda: tables.append(sketch_mod._slot_table(alpha))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [alpha] and all(t is tables[0] for t in tables)
    table, kmin, nkeys, tiny = tables[0]
    buckets = np.arange(1 << 20, dtype=np.uint32)
    buckets = buckets[(buckets << 11 | 0x7FF) < 0x7F800000]  # (finite magnitudes)
    low = table.astype(np.int64) & 0xFFF
    split = np.flatnonzero((table >= 0) & (low > 2048)).astype(np.uint32)
    at = (4096 - low[split]).astype(np.uint32)
    values = np.concatenate([buckets << 11, buckets << 11 | 0x7FF, split << 11 | (at - 1), split << 11 | at])
    values = values.view(np.float32)
    inv = 1.0 / np.log((1 + alpha) / (1 - alpha))
    exact = np.full(1 << 20, np.iinfo(np.int32).min, dtype=np.int32)
    counts = {}
    for name, lut in (("table", table), ("exact", exact)):
        counts[name] = np.zeros(2 * nkeys + 2, np.int64)
        native.sketch_f32(values, lut, inv, tiny, kmin, counts[name], b"", 0)
    assert np.array_equal(counts["table"], counts["exact"])


@pytest.mark.parametrize("alpha", [0.01, 0.001])
def test_sketch_table_places_each_boundary_where_the_exact_rule_does(alpha: float) -> None:
    """Every fine bucket the table splits: the values on either side of its boundary counted
    through the table land where the exact rule (a table that sends every value to it) puts
    them, and the kernel reports the least and largest key slots it counted; a table of the
    wrong size or no keys is refused."""
    from hf_dynaquant.core.kernels import native

    table, kmin, nkeys, tiny = sketch_mod._slot_table(alpha)
    low = table.astype(np.int64) & 0xFFF
    split = np.flatnonzero((table >= 0) & (low > 2048))  # (2048: the bucket is one slot)
    assert split.size > 1000
    at = 4096 - low[split]
    values = np.concatenate([(split << 11) | (at - 1), (split << 11) | at]).astype(np.uint32).view(np.float32)
    inv = 1.0 / np.log((1 + alpha) / (1 - alpha))
    exact = np.full(1 << 20, np.iinfo(np.int32).min, dtype=np.int32)
    counts = {}
    for name, lut in (("table", table), ("exact", exact)):
        counts[name] = np.zeros(2 * nkeys + 2, np.int64)
        nans, lo, hi = native.sketch_f32(values, lut, inv, tiny, kmin, counts[name], b"", 0)
        keys = np.flatnonzero(counts[name][:nkeys] + counts[name][nkeys : 2 * nkeys])  # (either sign)
        assert nans == 0 and (lo, hi) == (keys[0], keys[-1])  # the key slots it reports having seen
    small = np.array([0.0, -0.0, 1e-31, -1e-40, np.nan], np.float32)  # no magnitude a key counts
    assert native.sketch_f32(small, table, inv, tiny, kmin, np.zeros(2 * nkeys + 2, np.int64), b"", 0) == (1, nkeys, -1)
    assert np.array_equal(counts["table"], counts["exact"])
    with pytest.raises(ValueError, match="2\\^20"):
        native.sketch_table(np.zeros(10, np.int32), inv, tiny, kmin, nkeys)
    with pytest.raises(ValueError, match="positive"):
        native.sketch_table(np.zeros(1 << 20, np.int32), inv, tiny, kmin, 0)


def test_magnitude_mode_and_bad_input() -> None:
    x = data("normal")
    assert LogSketch(0.01).add(x, magnitude=True).to_dict() == LogSketch(0.01).add(np.abs(x)).to_dict()
    with pytest.raises(ValueError, match="NaN"):
        LogSketch(0.01).add(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="empty"):
        LogSketch(0.01).quantile(0.5)
    with pytest.raises(ValueError, match="alpha"):
        LogSketch(1.5)
    assert sketch_mod.native is not None  # the compiled path is what runs in production


def brute_force_kmeans_cost(points: np.ndarray, weights: np.ndarray, k: int) -> float:
    """Optimal weighted 1-D k-means cost by dynamic programming over contiguous groups."""
    order = np.argsort(points)
    p, w = points[order], weights[order]
    n = p.size

    def cost(i: int, j: int) -> float:  # points i..j-1 in one cluster
        ww, pp = w[i:j], p[i:j]
        mu = (ww * pp).sum() / ww.sum()
        return float((ww * (pp - mu) ** 2).sum())

    best = np.full((k + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    for c in range(1, k + 1):
        for j in range(1, n + 1):
            best[c, j] = min(best[c - 1, i] + cost(i, j) for i in range(j))
    return float(best[k, n])


@pytest.mark.parametrize("k", [2, 3, 5, 6])
def test_weighted_kmeans_near_brute_force_optimum(k: int) -> None:
    rng = np.random.default_rng(k)
    points = np.concatenate([rng.normal(c, 0.05, 4) for c in range(k)])
    weights = rng.uniform(0.5, 2.0, points.size)
    centres = weighted_kmeans(points, weights, k, seed=0)
    assert centres.size == k and np.all(np.diff(centres) > 0)
    ours = float((weights * (points - centres[assign(points, centres)]) ** 2).sum())
    assert ours <= brute_force_kmeans_cost(points, weights, k) * 1.0001 + 1e-12


def test_weights_act_like_repeated_points_and_seed_determinism() -> None:
    points = np.array([0.0, 0.1, 5.0, 5.2, 10.0])
    weights = np.array([3, 1, 2, 2, 1], dtype=float)
    expanded = np.repeat(points, weights.astype(int))
    a = weighted_kmeans(points, weights, 3, seed=1)
    b = weighted_kmeans(expanded, np.ones(expanded.size), 3, seed=1)
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, [0.025, 5.1, 10.0])
    x = data("normal", 50_000)
    assert np.array_equal(approximate_kmeans(x, 12, seed=7), approximate_kmeans(x, 12, seed=7))
    assert weighted_kmeans(np.array([1.0, 1.0, 2.0]), np.ones(3), 5).tolist() == [1.0, 2.0]  # fewer distinct points


def reference_kmeans(points: np.ndarray, weights: np.ndarray, k: int, monkeypatch, **options) -> np.ndarray:
    """``weighted_kmeans`` by its numpy loop."""
    with monkeypatch.context() as patch:
        patch.setattr(kmeans_mod, "native", None)
        return weighted_kmeans(points, weights, k, **options)


@pytest.mark.parametrize("seeding", ["k-means++", "clumped"])
def test_lloyd_kernel_gives_the_numpy_loops_centres(seeding: str, monkeypatch) -> None:
    """The compiled Lloyd iterations (``lloyd_f64``) are the numpy loop's, bit for bit: over
    many shapes of data, from k-means++ seeds and from seeds clumped on one point, which leave
    clusters empty (re-seeded at the points worst served), and when max_iter stops them early."""
    native = kmeans_mod.native
    assert native is not None, "the compiled kernels were not built"
    if seeding == "clumped":  # every centre on the lowest point: all clusters but the first and last empty
        monkeypatch.setattr(kmeans_mod, "_seed", lambda points, weights, k, rng: np.full(k, points[0]))
    for case in range(60):
        rng = np.random.default_rng(case)
        m = int(rng.integers(5, 4000))
        points = rng.standard_normal(m) * 10.0 ** rng.uniform(-4, 2)
        weights = rng.random(m) * (rng.random(m) > 0.1)
        if case % 3 == 0:  # heavy tails, and repeated points
            points = np.round(rng.standard_t(2, m), 1)
        if case % 5 == 1:  # whole numbers of unit weight: ties in the worst served points' errors
            points, weights = rng.integers(-50, 50, m).astype(float), np.ones(m)
        k, max_iter = int(rng.integers(1, 40)), (300 if case % 4 else int(rng.integers(1, 5)))
        ours = weighted_kmeans(points, weights, k, seed=case, max_iter=max_iter)
        reference = reference_kmeans(points, weights, k, monkeypatch, seed=case, max_iter=max_iter)
        assert ours.dtype == reference.dtype and np.array_equal(ours.view(np.int64), reference.view(np.int64)), case
    with pytest.raises(ValueError, match="wrong size"):
        native.lloyd_f64(np.zeros(3), np.zeros(2), np.zeros(4), np.zeros(4), np.zeros(2), 10)
    with pytest.raises(ValueError, match="wrong size"):  # no fewer points than centres
        native.lloyd_f64(np.zeros(2), np.ones(2), np.zeros(3), np.zeros(3), np.zeros(2), 10)
    # more centres than a byte's codes, and prefix sums past float64's range (the numpy loop then)
    many = weighted_kmeans(np.arange(1000.0), np.ones(1000), 300)
    assert many.size == 300
    assert np.array_equal(many, reference_kmeans(np.arange(1000.0), np.ones(1000), 300, monkeypatch))
    huge = np.array([1e308, 1.5e308, 1.7e308, -1e308, 0.0])
    with np.errstate(over="ignore", invalid="ignore"):
        ours, reference = weighted_kmeans(huge, np.ones(5), 2), reference_kmeans(huge, np.ones(5), 2, monkeypatch)
    assert np.array_equal(ours, reference, equal_nan=True)


def test_seeding_draws_what_generator_choice_draws() -> None:
    """k-means++ draws its indices as ``Generator.choice(n, p=p)`` does, without its checks."""
    for case in range(300):
        rng = np.random.default_rng(case)
        p = rng.random(int(rng.integers(1, 3000))) ** rng.uniform(0.5, 8)
        p = p / p.sum()
        assert kmeans_mod._draw(p, np.random.default_rng(case)) == np.random.default_rng(case).choice(p.size, p=p)


@pytest.mark.parametrize("k", [4, 6, 12, 32])
def test_approximate_kmeans_close_to_sklearn(k: int) -> None:
    from sklearn.cluster import KMeans

    x = data("normal", 100_000)
    ours = approximate_kmeans(x, k, sigma=1.0)
    ref = np.sort(KMeans(k, n_init=1, random_state=0).fit(x.reshape(-1, 1)).cluster_centers_.ravel())

    def mse(c: np.ndarray) -> float:
        return float(np.mean((x - c[assign(x, c)]) ** 2))

    assert ours.size == k
    assert mse(ours) <= 1.05 * mse(ref)


def test_bucket_weights_mix_frequency_and_magnitude() -> None:
    centres, counts = np.array([-2.0, 0.0, 1.0, 4.0]), np.array([1, 6, 2, 1])
    np.testing.assert_allclose(bucket_weights(centres, counts, 1.0), counts / 10)
    np.testing.assert_allclose(bucket_weights(centres, counts, 0.0), np.abs(centres) / 7)
    magnitude_centres = approximate_kmeans(data("normal", 50_000), 8, sigma=0.0)
    frequency_centres = approximate_kmeans(data("normal", 50_000), 8, sigma=1.0)
    assert np.abs(magnitude_centres).max() > np.abs(frequency_centres).max()  # resolution moves to the tails


def test_magnitude_mode_leaves_earlier_signed_values_alone() -> None:
    x = data("normal")
    mixed = LogSketch(0.01).add(x).add(x[:10], magnitude=True)
    assert mixed.negative.total == int((x < 0).sum())
    assert mixed.positive.total == int((x > 0).sum()) + 10


def test_where_counts_only_the_selected_values(monkeypatch) -> None:
    """``add(values, where=(codes, code))`` is the sketch of ``values[codes == code]``, from the
    kernel (over several parts) and from the torch path alike."""
    rng = np.random.default_rng(4)
    values = rng.normal(size=(1 << 22) + 1001).astype(np.float32)  # more than one kernel part
    values[:7] = [0.0, np.inf, -np.inf, 1e-40, -1e-40, 3.0, -3.0]
    codes = rng.integers(0, 5, values.size).astype(np.uint8)
    expected = LogSketch(0.001).add(values[codes == 2]).to_dict()
    assert sketch_mod.native is not None, "the compiled kernels were not built"
    assert LogSketch(0.001).add(values, where=(codes, 2)).to_dict() == expected
    assert LogSketch(0.001).add(values, where=(codes, 9)).count == 0
    with pytest.raises(ValueError, match="codes for"):
        LogSketch(0.001).add(values, where=(codes[1:], 2))
    monkeypatch.setattr(sketch_mod, "native", None)
    assert LogSketch(0.001).add(values, where=(codes, 2)).to_dict() == expected


def test_plans_sharing_a_sketch_cache_equal_plans_made_alone() -> None:
    """The configuration search plans many candidates of one checkpoint with one sketch cache:
    the sketches of the values neither pruned nor protected are shared between candidates that
    differ in bins only, and every plan equals the one made without the cache."""
    from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization

    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 128), "b.weight": torch.randn(128, 64) * 3, "emb.weight": torch.randn(100, 32)}
    sens = {n: t.abs() * torch.rand_like(t) for n, t in tensors.items()}
    types = {"emb.weight": "embedding"}
    cache: dict = {}
    configs = [
        QuantConfig(bins=b, prune=p, protect=0.01, prune_by=by, min_numel=256)
        for by in ("magnitude", "sensitivity")
        for p in (0.0, 0.3)
        for b in (4, 16)
    ]
    for config in configs:
        shared = plan_quantization(tensors, config, types=types, sensitivity=sens, sketch_cache=cache)
        alone = plan_quantization(tensors, config, types=types, sensitivity=sens)
        for name, tp in alone.tensors.items():
            np.testing.assert_array_equal(shared.tensors[name].centres, tp.centres)
            assert shared.tensors[name].prune_threshold == tp.prune_threshold
    assert sum(1 for key in cache if key[1] == "rest") == 3 * 4  # one per tensor and threshold pair
