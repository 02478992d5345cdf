"""Peer codecs (hf_dynaquant.codecs.peers), held to their reference implementations.

NF4: codes, block scales and decoded values equal bitsandbytes' ``quantize_4bit`` /
``dequantize_4bit`` (``quant_type="nf4"``, blocks of 64) bit for bit. CNR: the greedy range
search, row scales, offsets and codes equal FBGEMM's ``embedding_bag_{4,2}bit_prepack`` with
``optimized_qparams=True`` (in PyTorch) byte for byte. GOBO: outliers by scipy's Gaussian
log-density, centroids equal to a plain Lloyd loop with the paper's L1 stopping rule, outliers
restored exactly. QD: the entropy-driven bit widths of eq. 2, the min-max quantizer, and cyclic
code deltas that stay exact when the bit width changes between checkpoints. JointSQ: the
allocation equals the paper's heap walk over upgrade steps. ExCP: the joint shrinking as the
authors' code writes it, K-means codes with 0 for exact zeros, residuals on the previous entry.
What a peer does not quantize (1-D,
small, integer, non-finite tensors) is stored exactly; damaged parameters or blobs are named; a
model folder compressed with ``--codec nf4`` loads back through transformers."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_dynaquant import CheckpointStore, codec_names, get_codec
from hf_dynaquant.codecs import MemoryBlobs
from hf_dynaquant.codecs.peers.nf4 import LEVELS
from hf_dynaquant.core.dtypes import from_raw, to_raw
from hf_dynaquant.errors import CorruptCheckpointError, InvalidSettingError

Blobs = functools.partial(MemoryBlobs, where="test")  # a codec's blobs, named "test" in errors


@pytest.fixture(scope="module")
def bnb():
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "no CPU gemm kernel": not used here
    import bitsandbytes.functional as functional

    return functional


def roundtrip(codec, t: torch.Tensor) -> tuple[torch.Tensor, dict]:
    raw = to_raw(t)
    enc = codec.encode(raw)
    out = from_raw(codec.to_raw(codec.decode(raw.dtype, raw.shape, enc.params, Blobs(enc.blobs))))
    assert np.array_equal(to_raw(out).bits, codec.to_raw(enc.state).bits)  # a later entry's base is what decodes
    return out, enc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(300, 129), (64, 64), (7, 1001)])
def test_nf4_equals_bitsandbytes(bnb, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    t = (torch.randn(shape) * torch.logspace(-2, 1, shape[1])).to(dtype)
    t[0, :5] = 0  # exact zeros, and (below) an all-zero block
    t.view(-1)[64:128] = 0
    out, enc = roundtrip(get_codec("nf4", min_numel=0), t)
    assert enc.params["mode"] == "nf4"
    packed, state = bnb.quantize_4bit(t, blocksize=64, quant_type="nf4")
    assert np.allclose(state.code.numpy(), LEVELS)
    assert enc.blobs["codes"] == packed.numpy().tobytes()
    assert enc.blobs["absmax"] == state.absmax.to(torch.float32).numpy().tobytes()
    assert torch.equal(out, bnb.dequantize_4bit(packed, state).view(shape))


def test_nf4_stores_what_it_does_not_quantize_exactly() -> None:
    codec = get_codec("nf4")  # min_numel 4096
    nan = torch.randn(100, 100)
    nan[3, 4] = float("nan")
    kept = {
        "bias": torch.randn(5000),
        "small": torch.randn(60, 60),
        "ints": torch.arange(10_000).view(100, 100),
        "non_finite": nan,
    }
    for name, t in kept.items():
        out, enc = roundtrip(codec, t)
        assert enc.params["mode"] == "lossless" and np.array_equal(to_raw(out).bits, to_raw(t).bits), name
    _, enc = roundtrip(codec, torch.randn(64, 64))
    assert enc.params["mode"] == "nf4"


def test_nf4_ratio_and_error_on_a_large_tensor() -> None:
    t = torch.randn(1024, 1024)
    out, enc = roundtrip(get_codec("nf4"), t)
    assert t.numel() * 4 / sum(len(b) for b in enc.blobs.values()) == pytest.approx(32 / 4.5)
    assert 0.05 < float((out - t).norm() / t.norm()) < 0.12  # 16 levels over a block's range


def test_nf4_settings_and_damage_are_named() -> None:
    with pytest.raises(InvalidSettingError, match="block_size"):
        get_codec("nf4", block_size=63)
    codec = get_codec("nf4", min_numel=0)
    raw = to_raw(torch.randn(50, 70))
    enc = codec.encode(raw)
    with pytest.raises(CorruptCheckpointError, match="test: NF4 blobs hold"):
        codec.decode(raw.dtype, (50, 71), enc.params, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="test: NF4 parameters"):
        codec.decode(raw.dtype, raw.shape, {**enc.params, "block_size": "64"}, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="unknown nf4 mode"):
        codec.decode(raw.dtype, raw.shape, {**enc.params, "mode": "nf3"}, Blobs(enc.blobs))
    inf = np.frombuffer(enc.blobs["absmax"], dtype="<f4").copy()
    inf[1] = np.inf
    with pytest.raises(CorruptCheckpointError, match="scale is not finite"):
        codec.decode(raw.dtype, raw.shape, enc.params, Blobs({**enc.blobs, "absmax": inf.tobytes()}))


def test_nf4_in_a_store_and_from_the_cli(minilm_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModel

    from hf_dynaquant.cli import main

    assert "nf4" in codec_names()
    store = CheckpointStore(tmp_path / "store")
    state = {"w": torch.randn(128, 256), "b": torch.randn(256)}
    store.write({"model": state}, codecs=lambda section, name: "nf4", ref="x")
    loaded = store.open("x").load_section("model")
    assert torch.equal(loaded["b"], state["b"]) and not torch.equal(loaded["w"], state["w"])

    packed, restored = tmp_path / "packed", tmp_path / "restored"
    assert main(["compress", str(minilm_dir), str(packed), "--codec", "nf4", "--quiet"]) == 0
    assert main(["decompress", str(packed), str(restored), "--quiet"]) == 0
    stored = sum(p.stat().st_size for p in (packed / "dynaquant").rglob("*") if p.is_file())
    assert (minilm_dir / "model.safetensors").stat().st_size / stored > 6
    original, decoded = AutoModel.from_pretrained(str(minilm_dir)), AutoModel.from_pretrained(str(restored))
    ids = torch.randint(1000, 20000, (2, 16))
    with torch.no_grad():
        a, b = original(input_ids=ids).last_hidden_state, decoded(input_ids=ids).last_hidden_state
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_cnr_equals_fbgemm_greedy_prepack(bits: int, seed: int) -> None:
    prepack = {4: torch.ops.quantized.embedding_bag_4bit_prepack, 2: torch.ops.quantized.embedding_bag_2bit_prepack}
    torch.manual_seed(seed)
    t = torch.randn(200, 128) * torch.rand(200, 1)  # rows of different ranges
    t[3] = 0.5  # a constant row
    out, enc = roundtrip(get_codec("cnr", bins=2**bits, min_numel=0), t)
    reference = prepack[bits](t, True, 200, 0.16).numpy()  # per row: codes, float16 scale, float16 offset
    width = 128 * bits // 8
    assert enc.blobs["codes"] == reference[:, :width].tobytes()
    assert enc.blobs["scale"] == reference[:, width : width + 2].tobytes()
    assert enc.blobs["low"] == reference[:, width + 2 : width + 4].tobytes()
    unpack = {4: torch.ops.quantized.embedding_bag_4bit_unpack, 2: torch.ops.quantized.embedding_bag_2bit_unpack}
    assert torch.allclose(out, unpack[bits](torch.from_numpy(reference)), rtol=0, atol=1e-6)


def test_cnr_other_bin_counts_settings_and_damage() -> None:
    t = torch.randn(33, 70)
    errors = {}
    for bins in (8, 12, 256):
        out, enc = roundtrip(get_codec("cnr", bins=bins, min_numel=0), t)
        assert len(enc.blobs["codes"]) == -(-t.numel() * (bins - 1).bit_length() // 8)
        errors[bins] = float((out - t).norm() / t.norm())
    assert errors[256] < errors[12] < errors[8] < 0.2
    for bad in ({"bins": 1}, {"bins": 300}, {"step_bins": 0}, {"clip_ratio": 1.0}):
        with pytest.raises(InvalidSettingError):
            get_codec("cnr", **bad)
    codec = get_codec("cnr", bins=8, min_numel=0)
    raw = to_raw(t)
    enc = codec.encode(raw)
    with pytest.raises(CorruptCheckpointError, match="test: CNR blobs hold"):
        codec.decode(raw.dtype, (33, 71), enc.params, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="test: CNR parameters"):
        codec.decode(raw.dtype, raw.shape, {**enc.params, "bins": 0}, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="not below its 7 bins"):
        codec.decode(raw.dtype, raw.shape, {**enc.params, "bins": 7}, Blobs(enc.blobs))


def _lloyd_l1_reference(values: np.ndarray, bins: int, max_iterations: int) -> np.ndarray:
    """GOBO's clustering written plainly: equal-count initial groups, nearest-centroid assignment,
    mean update, stop when the L1 error stops decreasing (keeping the best)."""
    ordered = np.sort(values.astype(np.float64))
    groups = np.array_split(ordered, bins)
    centroids = np.array([g.mean() for g in groups])

    def assign(c: np.ndarray) -> np.ndarray:
        return np.abs(ordered[:, None] - c[None, :]).argmin(axis=1)  # ties: the lower centroid

    def l1(c: np.ndarray) -> float:
        return float(np.abs(ordered - c[assign(c)]).sum())

    best, best_l1 = centroids, l1(centroids)
    for _ in range(max_iterations):
        labels = assign(best)
        moved = np.sort([ordered[labels == k].mean() if (labels == k).any() else best[k] for k in range(bins)])
        if not l1(moved) < best_l1:
            break
        best, best_l1 = moved, l1(moved)
    return best


def test_gobo_outliers_and_clustering_follow_the_paper() -> None:
    from scipy.stats import norm

    from hf_dynaquant.codecs.peers.gobo import gobo_centroids, gobo_outliers

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(3000) * 0.04).astype(np.float32)
    x[::500] = 0.3
    expected = norm.logpdf(x.astype(np.float64), x.mean(dtype=np.float64), x.std(dtype=np.float64)) < -4
    assert np.array_equal(gobo_outliers(x, -4.0), expected) and 0 < expected.sum() < 60
    group = x[~expected]
    for bins in (4, 8, 16):
        np.testing.assert_allclose(gobo_centroids(group, bins, 1000), _lloyd_l1_reference(group, bins, 1000), rtol=1e-12)


def test_gobo_roundtrip_settings_and_damage() -> None:
    torch.manual_seed(0)
    t = torch.randn(96, 128) * 0.04
    t.view(-1)[::997] = 0.5  # outliers
    codec = get_codec("gobo", min_numel=0)
    out, enc = roundtrip(codec, t)
    centroids = np.frombuffer(enc.blobs["centroids"], dtype="<f4")
    at = np.frombuffer(enc.blobs["outlier_positions"], dtype="<u8")
    flat_in, flat_out = t.reshape(-1).numpy(), out.reshape(-1).numpy()
    assert set(np.flatnonzero(flat_in == 0.5)) <= set(at) and np.array_equal(flat_out[at], flat_in[at])
    rest = np.setdiff1d(np.arange(flat_in.size), at)
    nearest = centroids[np.abs(flat_in[rest, None] - centroids[None, :]).argmin(axis=1)]
    assert np.array_equal(flat_out[rest], nearest)
    assert len(enc.blobs["codes"]) == t.numel() * 3 // 8  # 8 bins: 3 bits
    for bad in ({"bins": 1}, {"max_iterations": -1}, {"outlier_log_prob": float("nan")}):
        with pytest.raises(InvalidSettingError):
            get_codec("gobo", **bad)
    raw = to_raw(t)
    with pytest.raises(CorruptCheckpointError, match="test: GOBO blobs do not fit"):
        codec.decode(raw.dtype, (96, 129), enc.params, Blobs(enc.blobs))
    far = at.copy()
    far[0] = t.numel()
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        codec.decode(raw.dtype, raw.shape, enc.params, Blobs({**enc.blobs, "outlier_positions": far.tobytes()}))


def test_qd_bit_widths_follow_the_layers_entropy() -> None:
    from hf_dynaquant.codecs.peers import qd_bits
    from hf_dynaquant.codecs.peers.qd import layer_entropy

    torch.manual_seed(0)
    layers = {"flat": torch.rand(200, 50), "normal": torch.randn(200, 50), "peaked": torch.randn(200, 50) ** 5}
    entropy = {n: layer_entropy(t.reshape(-1).numpy()) for n, t in layers.items()}
    assert entropy["flat"] > entropy["normal"] > entropy["peaked"]
    low, high = entropy["peaked"], entropy["flat"]
    expected = round(4 + 4 * (entropy["normal"] - low) / (high - low))
    assert qd_bits(layers) == {"flat": 8, "normal": expected, "peaked": 4}
    assert qd_bits({"a": torch.ones(3, 3), "b": torch.ones(3, 3)}, 3, 6) == {"a": 6, "b": 6}
    with pytest.raises(InvalidSettingError):
        qd_bits(layers, 6, 4)


def test_qd_quantizer_and_cyclic_deltas_across_bit_widths(tmp_path: Path) -> None:
    from hf_dynaquant.codecs.peers import QDCodec

    torch.manual_seed(0)
    weights = [torch.randn(64, 128)]
    for _ in range(4):
        weights.append(weights[-1] + 0.01 * torch.randn(64, 128))
    widths = [4, 4, 8, 3, 8]  # the width changes both ways between checkpoints
    chained, alone = CheckpointStore(tmp_path / "chained"), CheckpointStore(tmp_path / "alone")
    for i, (w, bits) in enumerate(zip(weights, widths)):
        codec = QDCodec(bits=bits, min_numel=0)
        chained.write({"model": {"w": w}}, codecs=codec, ref=f"s{i}", base=f"s{i - 1}" if i else None)
        alone.write({"model": {"w": w}}, codecs=codec, ref=f"s{i}")
        assert (chained.info(f"s{i}").base is None) == (i == 0)
        decoded = chained.open(f"s{i}").load_section("model")["w"]
        assert torch.equal(decoded, alone.open(f"s{i}").load_section("model")["w"])
        scale = (w.max() - w.min()) / (2**bits - 1)
        assert float((decoded - w).abs().max()) <= float(scale) / 2 * (1 + 1e-5)
    constant = torch.full((64, 64), 0.25)
    out, _ = roundtrip(QDCodec(bits=4, min_numel=0), constant)
    assert torch.equal(out, constant)


def test_qd_damage_is_named() -> None:
    from hf_dynaquant.codecs.peers import QDCodec

    codec = QDCodec(bits=4, min_numel=0)
    raw = to_raw(torch.randn(32, 64))
    first = codec.encode(raw)
    second = codec.encode(to_raw(torch.randn(32, 64)), base=first.state)
    assert second.uses_base and second.params["modulus"] == 16
    with pytest.raises(CorruptCheckpointError, match="base tensor is missing"):
        codec.decode(raw.dtype, raw.shape, second.params, Blobs(second.blobs))
    with pytest.raises(CorruptCheckpointError, match="does not decompress"):
        codec.decode(raw.dtype, raw.shape, first.params, Blobs({**first.blobs, "codes": b"not lzma"}))
    with pytest.raises(CorruptCheckpointError, match="QD parameters are invalid"):
        codec.decode(raw.dtype, raw.shape, {**first.params, "levels": 12}, Blobs(first.blobs))
    with pytest.raises(CorruptCheckpointError, match="not below its 8 levels"):
        codec.decode(raw.dtype, raw.shape, {**first.params, "levels": 8}, Blobs(first.blobs))
    with pytest.raises(InvalidSettingError):
        QDCodec(bits=9)
    again = codec.keyframe(second.state)  # compaction re-encodes a delta's state on its own
    assert not again.uses_base
    assert np.array_equal(codec.decode(raw.dtype, raw.shape, again.params, Blobs(again.blobs)).codes, second.state.codes)


def _heap_allocation(values: np.ndarray, budget: float) -> np.ndarray:
    """JointSQ's greedy written as the paper's heap walk: pop the step of largest profit per bit,
    take it if it fits, push that value's next step."""
    import heapq

    widths, level = [0, 2, 4, 8], np.zeros(values.size, dtype=np.int64)

    def step(i: int, k: int) -> tuple[float, int, int]:
        gain = (4.0 ** -widths[k] - 4.0 ** -widths[k + 1]) * float(values[i]) ** 2
        return (-gain / (widths[k + 1] - widths[k]), 3 * i + k, i)

    heap = [step(i, 0) for i in range(values.size)]
    heapq.heapify(heap)
    left = budget
    while heap:
        _, key, i = heapq.heappop(heap)
        k = key % 3
        cost = widths[k + 1] - widths[k]
        if cost <= left:
            level[i], left = k + 1, left - cost
            if k < 2:
                heapq.heappush(heap, step(i, k + 1))
    return level


def test_jointsq_allocation_is_the_papers_greedy() -> None:
    from hf_dynaquant.codecs.peers.jointsq import WIDTHS, allocate_bits

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(2000) * rng.uniform(0.1, 2, 2000)).astype(np.float32)
    for bits_per_value in (0.5, 1.6, 3.0, 7.9):
        budget = bits_per_value * x.size
        level = allocate_bits(x, budget)
        assert np.array_equal(level, _heap_allocation(x, budget)), bits_per_value
        assert WIDTHS[level].sum() <= budget
        order = np.argsort(np.abs(x))
        assert (np.diff(level[order]) >= 0).all()  # more bits for larger magnitudes


def test_jointsq_roundtrip_and_damage() -> None:
    from hf_dynaquant.codecs.peers import JointSQCodec

    torch.manual_seed(0)
    t = torch.randn(96, 128)
    codec = JointSQCodec(bits_per_value=1.6, min_numel=0)
    out, enc = roundtrip(codec, t)
    zero = out == 0
    assert 0.1 < float(zero.float().mean()) < 0.6  # the smallest values are pruned
    assert float(t.abs()[zero].max()) <= float(t.abs()[~zero].min())
    assert float((out - t).norm() / t.norm()) < 0.35
    assert float((roundtrip(JointSQCodec(bits_per_value=6, min_numel=0), t)[0] - t).norm() / t.norm()) < 0.02
    raw = to_raw(t)
    with pytest.raises(CorruptCheckpointError, match="does not decompress"):
        codec.decode(raw.dtype, raw.shape, enc.params, Blobs({**enc.blobs, "widths": b"junk"}))
    with pytest.raises(CorruptCheckpointError, match="do not fit"):
        codec.decode(raw.dtype, (96, 129), enc.params, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="2-bit codes"):
        codec.decode(raw.dtype, raw.shape, enc.params, Blobs({**enc.blobs, "codes2": b"\x00"}))
    with pytest.raises(InvalidSettingError):
        JointSQCodec(bits_per_value=9)


def test_excp_shrink_follows_the_authors_code() -> None:
    from hf_dynaquant.codecs.peers import excp_shrink

    torch.manual_seed(0)
    delta, m, v = torch.randn(4000) * 1e-3, torch.randn(4000) * 1e-2, torch.rand(4000) * 1e-9  # s about 2.2
    # compress_pythia.py's rule, in torch as written there (its opt_v is exp_avg, opt_m exp_avg_sq)
    scale = min(2.5, 5e-5 / float(torch.sqrt(v.mean())))
    expected_delta = delta * (delta.abs() > scale * delta.abs().median())
    keep = (m.abs() > 2.0 * m.abs().mean()) & (expected_delta != 0)
    got_delta, got_m, got_v = excp_shrink(delta.numpy(), m.numpy(), v.numpy())
    assert 0.05 < float((expected_delta != 0).float().mean()) < 0.95
    assert np.array_equal(got_delta, expected_delta.numpy())
    assert np.array_equal(got_m, (m * keep).numpy()) and np.array_equal(got_v, (v * keep).numpy())
    none_delta, first_m, _ = excp_shrink(None, m.numpy(), v.numpy())
    assert none_delta is None and np.array_equal(first_m != 0, (m.abs() > 2.0 * m.abs().mean()).numpy())


def test_excp_checkpoints_through_a_store(tmp_path: Path) -> None:
    from hf_dynaquant.codecs.peers import ExCPCodec, excp_state
    from hf_dynaquant.codecs.peers.excp import kmeans_nonzero

    torch.manual_seed(0)
    x = np.where(np.random.default_rng(0).random(5000) < 0.3, np.random.default_rng(1).standard_normal(5000), 0)
    codes, codebook = kmeans_nonzero(x, 15)
    assert codebook.dtype == np.float16 and codebook.size == 15 and np.array_equal(codes == 0, x == 0)
    levels = codebook.astype(np.float64)
    nz = x != 0
    assert np.array_equal(codes[nz] - 1, np.abs(x[nz, None] - levels[None, :]).argmin(axis=1))

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    store = CheckpointStore(tmp_path / "store")

    def train_and_take() -> tuple[dict, dict, dict]:
        for _ in range(5):
            model(torch.randn(32, 64)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        m = {names[id(p)]: s["exp_avg"] for p, s in optimizer.state.items()}
        v = {names[id(p)]: s["exp_avg_sq"] for p, s in optimizer.state.items()}
        return {n: t.detach().clone() for n, t in model.state_dict().items()}, m, v

    weights, m, v = train_and_take()
    sections, codecs = excp_state(weights, None, m, v)
    store.write(sections, codecs=codecs, ref="c1")
    first = store.open("c1").load_section("model")
    assert all(torch.equal(first[n], t) for n, t in weights.items())  # no previous: the weights exactly
    weights2, m2, v2 = train_and_take()
    sections, codecs = excp_state(weights2, first, m2, v2)
    store.write(sections, codecs=codecs, ref="c2", base="c1")
    second = store.open("c2")
    decoded, moments = second.load_section("model"), second.load_section("exp_avg")
    for name, w in weights2.items():
        change = w - first[name]
        assert float((decoded[name] - w).norm()) < 0.35 * float(change.norm()), name
        assert torch.equal(moments[name] != 0, sections["exp_avg"][name] != 0)
    assert second.record("model", "0.weight")["params"]["residual"] == "previous"
    codec = ExCPCodec()
    raw = to_raw(torch.randn(4000))
    enc = codec.encode(raw)
    with pytest.raises(CorruptCheckpointError, match="ExCP blobs do not fit"):
        codec.decode(raw.dtype, (4001,), enc.params, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="ExCP parameters are invalid"):
        codec.decode(raw.dtype, raw.shape, {**enc.params, "centres": 16}, Blobs(enc.blobs))
    with pytest.raises(CorruptCheckpointError, match="residual whose base tensor is missing"):
        codec.decode(raw.dtype, raw.shape, {**enc.params, "residual": "previous"}, Blobs(enc.blobs))
    with pytest.raises(InvalidSettingError, match="needs its base entry"):
        ExCPCodec(delta=np.zeros(4000)).encode(raw)
    # packing: LZMA over the packed codes (the authors measure after 7-Zip), or none (version 1's)
    sparse = to_raw(torch.from_numpy(x.astype(np.float32)))
    lz, plain = ExCPCodec().encode(sparse), ExCPCodec(packing="none").encode(sparse)
    assert lz.params["packing"] == "lzma" and "packing" not in plain.params
    assert len(lz.blobs["codes"]) < 0.8 * len(plain.blobs["codes"])  # 70% zeros: far below 4 bits a value
    same = [codec.decode(sparse.dtype, sparse.shape, e.params, Blobs(e.blobs)) for e in (lz, plain)]
    assert np.array_equal(same[0].bits, same[1].bits)
    broken = dict(lz.blobs, codes=lz.blobs["codes"][:-9])
    with pytest.raises(CorruptCheckpointError, match="ExCP codes do not decompress"):
        codec.decode(sparse.dtype, sparse.shape, lz.params, Blobs(broken))
    with pytest.raises(CorruptCheckpointError, match="ExCP packing 'zip' is unknown"):
        codec.decode(sparse.dtype, sparse.shape, {**lz.params, "packing": "zip"}, Blobs(lz.blobs))
    with pytest.raises(InvalidSettingError, match="ExCP packing must be one of"):
        ExCPCodec(packing="zip")


def test_excp_in_training_needs_the_optimizer(tmp_path: Path) -> None:
    """codec='excp' codes Adam's moments with the weights: a Compressor without an optimizer
    says so at the step it cannot write."""
    from hf_dynaquant import Compressor
    from hf_dynaquant.errors import CheckpointError

    model = torch.nn.Linear(64, 64)
    with pytest.raises(CheckpointError, match="step 3: codec='excp' codes the optimizer's moments"):
        Compressor(model, tmp_path / "s", codec="excp").compress(3)


def _overfit_mlp() -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    x = torch.randn(512, 32)
    y = x[:, :8].argmax(1)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(200):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, [(x[i : i + 128], y[i : i + 128]) for i in range(0, 512, 128)]


@pytest.mark.parametrize("codec", ["qd", "cnr", "gobo", "jointsq"])
def test_peer_search_takes_the_most_compressive_passing_value(codec: str) -> None:
    """The DynaQuant paper's search for its baselines, along the peer's knob: from the most
    compressive value up until one passes (each failing one judged on the decoded model); the
    weights, the train mode and the RNG are as before; a later search starts at the last answer
    and never goes bolder; one with nothing passing stores losslessly, with a warning."""
    from hf_dynaquant.search import mean_loss
    from hf_dynaquant.search.peers import PEER_CUBES, PeerSearch

    model, batches = _overfit_mlp()
    snapshot = {n: t.detach().clone() for n, t in model.state_dict().items()}
    knob, values = PEER_CUBES[codec]
    search = PeerSearch(codec, mean_loss(batches), 0.01, z=0.0)
    before = torch.get_rng_state()
    choice = search.search(model, snapshot, where="step 1")
    assert torch.equal(torch.get_rng_state(), before) and model.training
    assert all(torch.equal(snapshot[n], t) for n, t in model.state_dict().items())
    tried = [c["options"][knob] for c in choice.candidates]
    assert choice.mode == "exhaustive" and tried == list(values[: len(tried)])
    assert [c["passed"] for c in choice.candidates] == [False] * (len(tried) - 1) + [True]
    assert choice.options == {knob: tried[-1]} and 1 < len(tried)  # 8 bins do not pass 1% on this model
    assert all(c["degradation"] > 0.01 for c in choice.candidates[:-1])
    sizes = [c["bytes"] for c in choice.candidates]
    assert sizes == sorted(sizes)  # most compressive first
    assert choice.to_dict()["config"] == choice.options and choice.to_dict()["evaluations"] == len(tried)

    again = search.search(model, snapshot)
    assert again.mode == "neighbourhood" and again.candidates[0]["options"] == choice.options  # never bolder
    resumed = PeerSearch(codec, mean_loss(batches), 0.01, z=0.0)
    resumed.continue_from(choice.to_dict())
    assert resumed.last == search.last
    resumed.continue_from({"codec": "other", "config": choice.options})
    assert resumed.last is None

    strict = PeerSearch(codec, mean_loss(batches), -1.0, z=0.0)  # nothing can pass
    with pytest.warns(UserWarning, match=f"{codec} configuration search at step 2 found no"):
        none = strict.search(model, snapshot, where="step 2")
    assert none.options is None and len(none.candidates) == len(values)
    with pytest.warns(UserWarning, match="neighbourhood"):
        top = strict.search(model, snapshot)
    assert [c["options"][knob] for c in top.candidates] == [values[-1]]  # from the top: never bolder
    resumed.continue_from(none.to_dict())  # a resumed run, after such a walk, starts at the top too
    assert resumed.last == len(values) - 1


def test_peer_search_refuses_peers_without_a_knob() -> None:
    from hf_dynaquant.search import mean_loss
    from hf_dynaquant.search.peers import PeerSearch

    with pytest.raises(InvalidSettingError, match="codec='nf4' has no configuration to search"):
        PeerSearch("nf4", mean_loss([]), 0.01)


def _peer_search_rank(rank: int, port: int, out: dict) -> None:
    import os

    from hf_dynaquant import Compressor
    from hf_dynaquant.errors import UnsupportedSetupError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, batches = torch.nn.Linear(8, 8), [(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))]
        try:
            Compressor(model, None, codec="qd", threshold=0.01, eval_data=batches)
        except UnsupportedSetupError as exc:
            out[rank] = str(exc)
    finally:
        torch.distributed.destroy_process_group()


def test_peer_search_is_refused_with_several_processes() -> None:
    """The peer's search evaluates in the writing process, where under DDP the model is the live
    one: with several processes it is refused, naming the way out."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_peer_search_rank, args=(port, out), nprocs=2, join=True)
    assert all("run the peer with threshold=None" in out.get(r, "") for r in (0, 1))
