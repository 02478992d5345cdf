"""The DynaQuant quantizer, delta encoder, codec, Compressor and CLI."""

from __future__ import annotations

import ctypes
import gc
import math
import mmap
import sys
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynaquant import CheckpointStore
from hf_dynaquant.codecs.dynaquant import DynaQuantCodec, KeptState, QuantState
from hf_dynaquant.core import quantizer as quantizer_mod
from hf_dynaquant.core.delta import (
    apply_delta,
    cyclic_delta,
    regroup,
    rle_decode,
    rle_encode,
    undo_regrouped_delta,
    ungroup,
    varint_decode,
    varint_encode,
)
from hf_dynaquant.core.dtypes import RawTensor
from hf_dynaquant.core.quantizer import (
    FIRST_CENTRE,
    PROTECTED,
    PRUNED,
    QuantConfig,
    decoded_values,
    dequantize,
    layer_types,
    plan_quantization,
    quantize,
)
from hf_dynaquant.core.ranking import GradientEMA
from hf_dynaquant.errors import CodecError, CorruptCheckpointError, InvalidSettingError, NonFiniteTensorWarning
from hf_dynaquant.pipeline import compress_state_dict
from hf_dynaquant.search import SearchSpace
from hf_dynaquant.training.compressor import Compressor


def toy_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(500, 32, generator=g) * 0.1,
        "fc1.weight": torch.randn(64, 128, generator=g) * 0.05,
        "fc1.bias": torch.randn(64, generator=g),
        "conv.weight": torch.randn(16, 8, 3, 3, generator=g) * 0.2,
        "counter": torch.tensor([3, 4]),
    }


def test_partition_fractions_and_layer_rules() -> None:
    state = toy_state()
    plan = plan_quantization(state, QuantConfig(bins=8, prune=0.3, protect=0.01, min_numel=1000))
    assert set(plan.tensors) == {"embed.weight", "fc1.weight", "conv.weight"}  # 1-D and int stay lossless
    assert plan.tensors["embed.weight"].layer_type == "Embedding"
    counts = {n: np.bincount(quantize(state[n], p)[0], minlength=FIRST_CENTRE + 1) for n, p in plan.tensors.items()}
    total = sum(c.sum() for c in counts.values())
    protected = sum(c[PROTECTED] for c in counts.values()) / total
    assert 0.008 <= protected <= 0.012  # top 1% by magnitude, to the sketch's accuracy
    assert counts["embed.weight"][PRUNED] == 0  # embeddings are never pruned
    for name in ("fc1.weight", "conv.weight"):  # 30% of each layer type
        assert abs(counts[name][PRUNED] / counts[name].sum() - 0.3) < 0.02
    assert plan.tensors["embed.weight"].centres.size == 32 and plan.tensors["fc1.weight"].centres.size == 8


def test_codes_are_nearest_centre_and_protected_exact() -> None:
    state = toy_state(1)
    plan = plan_quantization(state, QuantConfig(bins=6, prune=0.2, protect=0.02, min_numel=1000))
    for name, tp in plan.tensors.items():
        w = state[name].reshape(-1).numpy()
        codes, prot = quantize(state[name], tp)
        values = dequantize(codes, tp.centres, prot)
        q = codes >= FIRST_CENTRE
        gap = np.abs(w[q, None] - tp.centres[None, :]).min(axis=1)
        np.testing.assert_allclose(np.abs(w[q] - values[q]), gap, rtol=1e-6, atol=1e-9)  # error = distance to codebook
        assert np.all(values[codes == PRUNED] == 0)
        bf16 = torch.from_numpy(w[codes == PROTECTED]).bfloat16().float().numpy()
        np.testing.assert_array_equal(values[codes == PROTECTED], bf16)
        # kernel and numpy reference agree
        saved, quantizer_mod.native = quantizer_mod.native, None
        try:
            assert np.array_equal(quantize(state[name], tp)[0], codes)
        finally:
            quantizer_mod.native = saved


def test_sensitivity_protection_and_pruning() -> None:
    state = {"w": torch.randn(100, 100)}
    sens = {"w": torch.zeros(100, 100)}
    sens["w"][0, :50] = 1.0  # 50 very sensitive weights, whatever their magnitude
    sens["w"] += torch.rand(100, 100) * 1e-3
    plan = plan_quantization(
        state, QuantConfig(prune=0.2, protect=0.01, prune_by="sensitivity", min_numel=100), sensitivity=sens
    )
    codes, _ = quantize(state["w"], plan.tensors["w"])
    assert np.all(codes.reshape(100, 100)[0, :50] == PROTECTED)
    assert abs((codes == PRUNED).mean() - 0.2) < 0.02


def test_plans_read_sensitivities_when_they_make_codes_and_hold_none() -> None:
    """``plan_quantization`` reads a sensitivity mapping when it needs the values (checks,
    sketches, codes), a few tensors at a time, and its plans hold none of them: a mapping that
    computes each on access (as a snapshot's does) costs no memory between reads, and gives the
    plan and the codes that materialised sensitivities give."""
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(6)}  # sampled sketches
    weights["small"] = torch.randn(64, 300, generator=g)  # sketched whole
    grads = {n: torch.randn(w.shape, generator=g) for n, w in weights.items()}
    made: list[weakref.ref] = []
    most_alive = 0

    class Computed(Mapping):
        def __getitem__(self, name: str) -> torch.Tensor:
            nonlocal most_alive
            t = (grads[name] * weights[name]).abs()
            made.append(weakref.ref(t.untyped_storage()))  # (the memory: a plan may hold a view of it)
            most_alive = max(most_alive, sum(r() is not None for r in made))
            return t

        def __iter__(self):
            return iter(weights)

        def __len__(self) -> int:
            return len(weights)

    for config in (
        QuantConfig(bins=8, prune=0.2, prune_by="sensitivity", protect=0.01, min_numel=100),
        QuantConfig(bins=6, prune=0.1, protect=0.002, rounding="stochastic", min_numel=100),
    ):
        lazy = plan_quantization(weights, config, sensitivity=Computed())
        held = plan_quantization(weights, config, sensitivity={n: (grads[n] * weights[n]).abs() for n in weights})
        gc.collect()
        assert not [r for r in made if r() is not None]  # not held by the plans
        assert len(made) > 2 * len(weights)  # read when needed (checks, sketches, codebooks)
        for name, w in weights.items():
            a, b = lazy.tensors[name], held.tensors[name]
            assert np.array_equal(a.centres, b.centres) and a.protect_sensitivity == b.protect_sensitivity
            assert a.prune_threshold == b.prune_threshold
            (codes_a, prot_a), (codes_b, prot_b) = quantize(w, a), quantize(w, b)
            assert np.array_equal(codes_a, codes_b) and np.array_equal(prot_a, prot_b), name
    assert most_alive < len(weights)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="bins"):
        QuantConfig(bins=300)
    with pytest.raises(ValueError, match="prune"):
        QuantConfig(prune=1.0)
    with pytest.raises(ValueError, match="prune_by"):
        QuantConfig(prune_by="hessian")


def test_layer_types_from_model() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16))
    types = layer_types(model)
    assert types["transformer.wte.weight"] == "Embedding"
    assert types["transformer.h.0.attn.c_attn.weight"] == "Conv1D"
    assert types["transformer.h.0.ln_1.weight"] == "LayerNorm"


codes_strategy = st.integers(2, 256).flatmap(
    lambda levels: st.tuples(st.just(levels), st.lists(st.integers(0, levels - 1), min_size=0, max_size=300))
)


@settings(max_examples=200, deadline=None)
@given(prev=codes_strategy, cur=codes_strategy, seed=st.integers(0, 2**16))
def test_delta_roundtrip_across_changing_levels(prev, cur, seed) -> None:
    (lp, p), (lc, c) = prev, cur
    n = min(len(p), len(c))
    p, c = np.array(p[:n], dtype=np.uint8), np.array(c[:n], dtype=np.uint8)
    rng = np.random.default_rng(seed)
    keep = rng.random(n) < 0.7  # mostly unchanged, like training
    c[keep] = p[keep]
    c = np.minimum(c, lc - 1).astype(np.uint8)
    levels = max(lp, lc)
    d = cyclic_delta(p, c, levels)
    assert np.array_equal(apply_delta(p, d, levels), c)
    g = regroup(d, p)
    assert np.array_equal(ungroup(g, p), d)
    assert np.array_equal(g, d[np.argsort(p, kind="stable")])  # the compiled counting sort is the stable sort
    tokens = rle_encode(g)
    assert np.all((tokens <= 0) | (tokens > 1))  # values negated, lengths only when > 1
    assert np.array_equal(rle_decode(tokens), g)
    assert np.array_equal(varint_decode(varint_encode(tokens)), tokens)


def test_delta_kernels_match_numpy_reference(monkeypatch) -> None:
    from hf_dynaquant.core import delta as delta_mod

    native = delta_mod.native
    assert native is not None, "the compiled kernels were not built"
    rng = np.random.default_rng(3)
    prev = rng.integers(0, 256, 100_003).astype(np.uint8)  # (not a multiple of four: the kernels' tails)
    values = rng.integers(0, 256, prev.size).astype(np.uint8)
    grouped, back = regroup(values, prev), ungroup(regroup(values, prev), prev)
    deltas = {levels: cyclic_delta(prev % levels, values % levels, levels) for levels in (2, 7, 255)}
    full = cyclic_delta(prev, values, 256)
    unbounded = cyclic_delta(prev, values, 7)  # codes past the levels (a corrupt stream) as well
    monkeypatch.setattr(delta_mod, "native", None)  # the numpy reference
    assert np.array_equal(regroup(values, prev), grouped)
    assert np.array_equal(back, values)
    for levels, delta in deltas.items():
        assert np.array_equal(cyclic_delta(prev % levels, values % levels, levels), delta)
    assert np.array_equal(cyclic_delta(prev, values, 256), full)
    assert np.array_equal(cyclic_delta(prev, values, 7), unbounded)
    for levels, delta in deltas.items():  # undone in one pass, as ungroup and apply_delta do
        keys = prev % levels
        monkeypatch.setattr(delta_mod, "native", native)
        fused = delta_mod.undo_regrouped_delta(regroup(delta, keys), keys, levels)
        monkeypatch.setattr(delta_mod, "native", None)
        assert np.array_equal(fused, delta_mod.undo_regrouped_delta(regroup(delta, keys), keys, levels))
        assert np.array_equal(fused, values % levels)
        monkeypatch.setattr(delta_mod, "native", native)  # over the base's codes, given up
        given_up = keys.copy()
        assert delta_mod.undo_regrouped_delta(regroup(delta, keys), given_up, levels, in_place=True) is given_up
        assert np.array_equal(given_up, values % levels)
        kept = keys.copy()
        kept.flags.writeable = False  # (a read-only base keeps its codes)
        assert np.array_equal(delta_mod.undo_regrouped_delta(regroup(delta, keys), kept, levels, in_place=True), fused)
        assert np.array_equal(kept, keys)
        for n in range(6):  # shorter than the kernels' four at a time
            short_keys, short_delta = keys[:n].copy(), delta[:n]
            grouped_short = regroup(short_delta, short_keys)
            assert np.array_equal(ungroup(grouped_short, short_keys), short_delta)
            undone = delta_mod.undo_regrouped_delta(grouped_short, short_keys, levels, in_place=True)
            assert np.array_equal(undone, values[:n] % levels)


@pytest.fixture(params=["vector", "scalar"])
def simd_path(request):
    """Each kernel with a hand-written vector path (the grouping, the partition, the rANS
    encoder: AVX-512; the partition, a delta's sparse grouping, four-bit unpacking: AVX2; the
    byte counts: AVX-512 BW or AVX2) both ways: that path (where the CPU has it) and its plain
    loops or baseline build (the only path on other CPUs)."""
    from hf_dynaquant.core.kernels import native

    assert native is not None, "the compiled kernels were not built"
    before = native.allow_simd(request.param == "vector")
    yield request.param
    native.allow_simd(before)


@pytest.mark.parametrize("keys", [1, 2, 10, 12, 13, 33, 48, 49])
def test_grouping_of_few_keys_matches_numpy_reference(monkeypatch, simd_path, keys) -> None:
    """Codes of a checkpoint have few levels: the kernels group them 64 at a time where the CPU
    allows (AVX-512 VBMI2, at most 48 groups; past 12, in two passes, by key / 8 and then by key,
    over chunks of 2048), or, with AVX2 alone and at most 16 groups, a delta's changed values 32
    at a time (blocks of many changes four at a time), else four at a time; either way the bytes
    are the numpy references', at every length around the blocks and the chunks, with few codes
    changed and many, at 256 levels, and with codes past the levels (a corrupt stream) too."""
    from hf_dynaquant.core import delta as delta_mod

    native = delta_mod.native
    rng = np.random.default_rng(keys)
    levels = max(keys, 2)
    for n in (31, 32, 33, 63, 64, 65, 127, 128, 129, 100_003):
        prev = rng.integers(0, keys, n).astype(np.uint8)
        cur = rng.integers(0, levels, n).astype(np.uint8)
        wild = rng.integers(0, 256, n).astype(np.uint8)  # past the levels
        few = np.where(rng.random(n) < 0.03, cur, prev)  # (a block's changes: none, one, several)
        some = np.where(rng.random(n) < 0.25, wild, prev)  # (blocks past the sparse path's eight, and under)
        compiled = {}
        for impl in (native, None):
            monkeypatch.setattr(delta_mod, "native", impl)
            given_up = prev.copy()
            compiled[impl is None] = [
                *delta_mod.grouped_delta(prev, cur, levels),
                *delta_mod.grouped_delta(prev, few, levels),
                *delta_mod.grouped_delta(prev, some, levels),
                *delta_mod.grouped_delta(prev, wild, levels),
                *delta_mod.grouped_delta(prev, wild, 256),
                undo_regrouped_delta(wild, prev, 256),
                regroup(wild, prev),
                ungroup(wild, prev),
                undo_regrouped_delta(wild, prev, levels),
                undo_regrouped_delta(regroup(cur, prev), given_up, levels, in_place=True),
            ]
        for got, expected in zip(compiled[False], compiled[True]):
            assert np.array_equal(got, expected), n
        stale = np.full(n, 0xA5, dtype=np.uint8)  # (an out that held something: unchanged values are written too)
        native.cyclic_u8(prev, few, levels, stale, np.empty(65536, dtype=np.int64))
        assert np.array_equal(stale, compiled[True][2]), n


def _before_a_guard_page(values: np.ndarray) -> np.ndarray:
    """A copy of uint8 ``values`` that ends where a page no one may read begins (Linux), so that
    a kernel reading past its end kills the process rather than reading some other allocation.
    The mapping is never unmapped (the array holds it), which a test can afford."""
    page = mmap.PAGESIZE
    size = -(-values.size // page) * page + page
    mapping = mmap.mmap(-1, size)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(start + size - page), ctypes.c_size_t(page), 0) == 0
    guarded = np.frombuffer(mapping, dtype=np.uint8, count=values.size, offset=size - page - values.size)
    guarded[:] = values
    return guarded


@pytest.mark.parametrize("levels", [9, 40])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 100_003])
def test_delta_undone_with_the_base_histogram_given(simd_path, n, levels) -> None:
    """A restore counted its base's codes for the delta's rANS models; handed to the undo, they
    give the same codes, in place; counts that are not the keys' histogram (even adding up to
    their number) are refused, never read past the delta, which ends at a page no one may read
    (at 40 levels, past the 32 groups the vector path once stopped at, in two passes)."""
    from hf_dynaquant.core.histogram import byte_counts

    rng = np.random.default_rng(n)
    keys = rng.integers(0, levels, n).astype(np.uint8)
    current = rng.integers(0, levels, n).astype(np.uint8)
    grouped = regroup(cyclic_delta(keys, current, levels), keys)
    if sys.platform == "linux":  # (a read past the delta's end faults instead of passing unseen)
        grouped = _before_a_guard_page(grouped)
    counts = byte_counts(keys)  # (as long as the largest code present: shorter than 256)
    given_up = keys.copy()
    assert undo_regrouped_delta(grouped, given_up, levels, in_place=True, groups=counts) is given_up
    assert np.array_equal(given_up, current)
    for moved in range(1, 60):  # the same total, spread otherwise: into another group, or past the last
        wrong = np.zeros(256, dtype=np.int64)
        wrong[: counts.size] = counts
        src, dst = rng.integers(0, levels + 2 if moved % 2 else 256, 2)  # (near the levels: few groups)
        if src == dst or wrong[src] < moved:
            continue
        wrong[src] -= moved
        wrong[dst] += moved
        with pytest.raises(ValueError, match="not the histogram"):
            undo_regrouped_delta(grouped, keys.copy(), levels, groups=wrong)
    if counts.size > 1:  # the last group's count given to the first, all of it (a key past the groups
        for part in (1, 5, int(counts[-1])):  # counted) or part (its values read past the delta's end)
            wrong = counts.copy()
            moved = min(part, int(wrong[-1]))
            wrong[0], wrong[-1] = wrong[0] + moved, wrong[-1] - moved
            with pytest.raises(ValueError, match="not the histogram"):
                undo_regrouped_delta(grouped, keys.copy(), levels, groups=wrong)
    with pytest.raises(ValueError, match="adding up"):
        undo_regrouped_delta(grouped, keys.copy(), levels, groups=np.append(counts, 1))
    huge = np.zeros(256, dtype=np.int64)  # (sums past 2^63 that wrap to n: refused, not overflowed)
    huge[:4], huge[4] = 1 << 62, n
    with pytest.raises(ValueError, match="adding up"):
        undo_regrouped_delta(grouped, keys.copy(), levels, groups=huge)


@pytest.mark.parametrize("levels", [1, 2, 7, 16, 17, 255, 256])
def test_grouped_delta_counts_what_the_delta_coding_needs(monkeypatch, levels) -> None:
    """One pass gives the cyclic delta regrouped and its pair counts, as the separate functions
    do (compiled and numpy); the pairs give the current codes' histogram, the regrouped groups'
    sizes and models, and the same rANS payload as counting the symbols again."""
    from hf_dynaquant.core import delta as delta_mod
    from hf_dynaquant.core.ans import ans_encode
    from hf_dynaquant.core.histogram import byte_counts, pair_counts

    assert delta_mod.native is not None, "the compiled kernels were not built"
    rng = np.random.default_rng(11)
    prev = (rng.integers(0, 256, 100_003) % levels).astype(np.uint8)
    cur = np.where(rng.random(prev.size) < 0.2, rng.integers(0, 256, prev.size) % levels, prev).astype(np.uint8)
    grouped, pairs = delta_mod.grouped_delta(prev, cur, levels)
    delta = cyclic_delta(prev, cur, levels)
    assert np.array_equal(grouped, regroup(delta, prev))
    every = pair_counts(prev, delta)
    assert pairs.shape == (levels, levels) and np.array_equal(pairs, every[:levels, :levels])
    assert every.sum() == pairs.sum()  # (every pair there is)
    assert np.array_equal(delta_mod.current_counts(pairs, levels), np.bincount(cur, minlength=256))
    assert np.array_equal(delta_mod.current_counts(every, levels), np.bincount(cur, minlength=256))
    assert np.array_equal(pairs.sum(axis=1)[: int(prev.max()) + 1], byte_counts(prev))
    assert np.array_equal(undo_regrouped_delta(grouped, prev, levels), cur)
    for lanes in (1, 4):
        assert ans_encode(grouped, lanes=lanes, histograms=pairs) == ans_encode(grouped, byte_counts(prev), lanes)
    monkeypatch.setattr(delta_mod, "native", None)  # the numpy reference
    reference, reference_pairs = delta_mod.grouped_delta(prev, cur, levels)
    assert np.array_equal(reference, grouped) and np.array_equal(reference_pairs, pairs)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
def test_grouped_delta_of_packed_previous_codes(monkeypatch, simd_path, bits) -> None:
    """A kept state's previous codes come packed (1, 2 or 4 bits a code, or as a keyframe's
    stream packed them, less a base): the kernel that unpacks them a chunk at a time as it groups
    gives the bytes and pair counts of unpacking them whole first, at lengths across its chunks of
    32768 and the packing's bytes, one pass and two (past 12 groups), and codes past the levels
    (a damaged state's); without the kernels, the same by unpacking them."""
    from hf_dynaquant.core import delta as delta_mod
    from hf_dynaquant.core.bitplanes import PackedCodes, pack_bits

    native = delta_mod.native
    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 8, 9, 63, 65, 32767, 32768, 32769, 100_003):
        for base in {0, 256 - (1 << bits)}:
            prev = (base + rng.integers(0, 1 << bits, n)).astype(np.uint8)
            levels = min(256, base + (1 << bits) + 1)
            packed = PackedCodes(pack_bits(prev, bits, base), bits, base, n)
            within, wild = rng.integers(0, levels, n).astype(np.uint8), rng.integers(0, 256, n).astype(np.uint8)
            few = np.where(rng.random(n) < 0.05, within, prev)  # (a delta's: most codes as they were)
            for cur, at in ((within, levels), (wild, 7), (few, levels)):
                if sys.platform == "linux":  # (a read past the packed codes' end faults)
                    packed = packed._replace(data=_before_a_guard_page(packed.data))
                expected = delta_mod.grouped_delta(prev, cur, at)
                for impl in (native, None):
                    monkeypatch.setattr(delta_mod, "native", impl)
                    got = delta_mod.grouped_delta(packed, cur, at)
                    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]), (n, base)
                monkeypatch.setattr(delta_mod, "native", native)
    packed = PackedCodes(pack_bits(np.arange(64, dtype=np.uint8) % 4, 2), 2, 0, 64)
    cur, pairs = np.zeros(64, np.uint8), np.zeros(65536, np.int64)
    with pytest.raises(ValueError, match="do not hold as many codes"):
        native.cyclic_packed_u8(packed.data, 2, 0, cur[:56], 4, cur[:56].copy(), pairs)  # (16 bytes hold 61-64)
    with pytest.raises(ValueError, match="past 255 with base"):
        native.cyclic_packed_u8(packed.data, 2, 253, cur, 4, cur.copy(), pairs)
    with pytest.raises(ValueError, match="apart from"):
        native.cyclic_packed_u8(packed.data, 2, 0, cur, 4, cur, pairs)


def test_grouping_refuses_an_out_that_overlaps_its_input() -> None:
    """Placed out of order, grouped values would overwrite codes not yet read."""
    from hf_dynaquant.core.kernels import native

    prev, cur = np.arange(64, dtype=np.uint8) % 5, np.arange(64, dtype=np.uint8)[::-1] % 5
    pairs = np.zeros(65536, np.int64)
    for out in (prev, cur):
        with pytest.raises(ValueError, match="apart from"):
            native.cyclic_u8(prev, cur, 5, out, pairs)
        with pytest.raises(ValueError, match="apart from"):  # (out over the keys, then over the values)
            native.regroup_u8(cur, prev, out, False)
    with pytest.raises(ValueError, match="apart from"):  # (over the keys themselves, in place, it may)
        native.ungroup_cyclic_u8(cur, prev, 5, cur)
    native.cyclic_u8(prev, cur, 5, prev, None)  # (in element order it may: each code is read first)
    assert np.array_equal(prev, cyclic_delta(np.arange(64, dtype=np.uint8) % 5, cur, 5))


def test_ans_encode_refuses_histograms_it_cannot_use() -> None:
    from hf_dynaquant.core.ans import ans_encode

    symbols = np.array([0, 1, 1, 2], dtype=np.uint8)
    with pytest.raises(ValueError, match="not both"):
        ans_encode(symbols, np.array([4]), histograms=np.array([[1, 2, 1]]))
    with pytest.raises(ValueError, match="sum to 3"):
        ans_encode(symbols, histograms=np.array([[1, 1, 1]]))
    with pytest.raises(ValueError, match="rows of at most 256"):
        ans_encode(symbols, histograms=np.array([1, 2, 1]))
    with pytest.raises(ValueError, match="does not count"):  # the symbol 2 lies beyond its table
        ans_encode(symbols, histograms=np.array([[1, 3]]))
    with pytest.raises(ValueError, match="symbols 0-4 hold"):  # in a group of one symbol, which writes no words
        ans_encode(symbols, histograms=np.array([[0, 4]]))
    with pytest.raises(ValueError, match="symbols 4-8 hold"):  # in the second group, found as it is coded
        ans_encode(np.concatenate([symbols, symbols]), histograms=np.array([[1, 2, 1], [1, 3, 0]]))
    with pytest.raises(ValueError, match="cyclic"):
        from hf_dynaquant.core.kernels import native

        native.cyclic_u8(symbols, symbols, 3, np.empty_like(symbols), np.zeros(10, np.int64))


@pytest.mark.parametrize("change", [{"delta_levels": 0}, {"delta_levels": 300}, {"delta_coding": "zip"}])
def test_delta_of_unknown_coding_or_levels_is_corrupt(change) -> None:
    rng = np.random.default_rng(12)
    prev = rng.integers(2, 6, 5000).astype(np.uint8)
    cur = np.where(rng.random(prev.size) < 0.05, 2, prev).astype(np.uint8)
    codec = DynaQuantCodec()
    encoded = codec._encode_state(_codes_state(cur), _codes_state(prev), {})
    assert encoded.params["mode"] == "delta"

    def blobs(name: str) -> np.ndarray:
        return np.frombuffer(encoded.blobs[name], np.uint8)

    blobs.where = "entry x, tensor w"  # type: ignore[attr-defined]
    assert np.array_equal(codec.decode("F32", cur.shape, encoded.params, blobs, _codes_state(prev)).codes, cur)
    with pytest.raises(CorruptCheckpointError, match="tensor w: delta coding"):
        codec.decode("F32", cur.shape, {**encoded.params, **change}, blobs, _codes_state(prev))


def test_paired_delta_reads_back_and_refuses_what_does_not_pair(monkeypatch) -> None:
    """A long delta of few levels is coded two deltas to an rANS symbol (``"ans8:pairs"``) where
    that is smaller than one a symbol, reads back to the codes (groups of odd size included), and
    is corrupt against a base holding a code past its levels, or under a suffix it does not know."""
    from hf_dynaquant.codecs import dynaquant as dynaquant_mod

    rng = np.random.default_rng(13)
    prev = rng.integers(0, 4, 300_001).astype(np.uint8)  # 4 levels, as Adam's update at two bins
    # codes move in some stretches of the tensor (rows whose gradients were large), so that
    # neighbouring deltas of a group share their odds, as a checkpoint's do
    rate = np.where(np.arange(prev.size) // 1000 % 7 == 0, 0.3, 0.02)
    cur = np.where(rng.random(prev.size) < rate, (prev + 1) % 4, prev).astype(np.uint8)

    def state(codes: np.ndarray) -> QuantState:
        return QuantState(codes, 4, np.array([-1, 1], np.float32), np.zeros(0, np.uint16), "F32", codes.shape)

    codec = DynaQuantCodec()
    with monkeypatch.context() as patch:
        patch.setattr(dynaquant_mod, "_GAP_SHARE", -1.0)  # gaps never tried (their own test below)
        paired = codec._encode_state(state(cur), state(prev), {})
    assert paired.params["mode"] == "delta" and paired.params["delta_stream"] == ["ans8:pairs", prev.size]

    def blobs(name: str) -> np.ndarray:
        return np.frombuffer(paired.blobs[name], np.uint8)

    blobs.where = "entry x, tensor w"  # type: ignore[attr-defined]
    # (a decode takes the base's codes over: each is given a copy)
    assert np.array_equal(codec.decode("F32", cur.shape, paired.params, blobs, state(prev.copy())).codes, cur)
    with monkeypatch.context() as patch:
        patch.setattr(dynaquant_mod, "PAIRED_LEVELS", 0)  # one delta a symbol
        patch.setattr(dynaquant_mod, "_GAP_SHARE", -1.0)
        single = codec._encode_state(state(cur), state(prev), {})
    assert single.params["delta_stream"] == ["ans8", prev.size]
    assert len(paired.blobs["delta"]) < 0.995 * len(single.blobs["delta"])
    from hf_dynaquant.core.ans import LANES, ans_encode
    from hf_dynaquant.core.delta import grouped_delta, pair_up, paired_sizes

    sizes = np.bincount(prev, minlength=4)
    symbols = pair_up(grouped_delta(prev, cur, 4)[0], sizes, 4)[0]
    for at, bad in ((0, 16), (-1, 4)):  # no pair of values below 4; an odd group's last value past them
        damaged = symbols.copy()
        damaged[at] = bad
        payload = ans_encode(damaged, paired_sizes(sizes), lanes=LANES)
        blob = lambda name, payload=payload: np.frombuffer(payload, np.uint8)  # noqa: E731
        blob.where = "entry x, tensor w"  # type: ignore[attr-defined]
        with pytest.raises(CorruptCheckpointError, match="tensor w: .*no pair"):
            codec.decode("F32", cur.shape, paired.params, blob, state(prev.copy()))
    with pytest.raises(CorruptCheckpointError, match="tensor w"):  # pairs of 17 levels do not fit a byte
        codec.decode("F32", cur.shape, {**paired.params, "delta_levels": 17}, blobs, state(prev.copy()))
    far = prev.copy()
    far[7] = 6  # a base code past the delta's 4 levels: its groups are not the encoder's
    with pytest.raises(CorruptCheckpointError, match="tensor w"):
        codec.decode("F32", cur.shape, paired.params, blobs, state(far))
    with pytest.raises(CorruptCheckpointError, match="tensor w"):
        unknown = {**paired.params, "delta_stream": ["ans8:pairz", prev.size]}
        codec.decode("F32", cur.shape, unknown, blobs, state(prev.copy()))


@pytest.mark.parametrize("levels", [1, 2, 5, 10, 16])
def test_pair_up_matches_numpy_reference_and_unpairs(monkeypatch, levels) -> None:
    """``pair_up`` (two deltas of a group to a byte, then the odd groups' last deltas) and
    ``unpair``, compiled and in numpy, agree and invert each other over groups of every parity,
    empty ones included; values at or past the levels, symbols that are no pair of them, and
    sizes that do not fit are refused both ways."""
    from hf_dynaquant.core import delta as delta_mod

    rng = np.random.default_rng(levels)
    for sizes in (np.array([0, 0, 0]), np.array([1]), rng.integers(0, 40, 9), np.array([5, 0, 4, 7, 1])):
        values = rng.integers(0, levels, int(sizes.sum())).astype(np.uint8)
        symbols, counts = delta_mod.pair_up(values, sizes, levels)
        assert symbols.size == int(delta_mod.paired_sizes(sizes).sum()) == int((sizes // 2 + sizes % 2).sum())
        assert np.array_equal(delta_mod.unpair(symbols, sizes, levels), values)
        with monkeypatch.context() as patch:
            patch.setattr(delta_mod, "native", None)
            reference = delta_mod.pair_up(values, sizes, levels)
            assert np.array_equal(reference[0], symbols) and np.array_equal(reference[1], counts)
            assert np.array_equal(delta_mod.unpair(symbols, sizes, levels), values)
        bounds = np.cumsum(delta_mod.paired_sizes(sizes))
        assert np.array_equal(counts.sum(axis=1), delta_mod.paired_sizes(sizes))
        assert np.array_equal(counts[-1], np.bincount(symbols[bounds[-2] :], minlength=256))
    for native in (delta_mod.native, None):
        monkeypatch.setattr(delta_mod, "native", native)
        sizes = np.array([3, 4])
        with pytest.raises(ValueError, match="levels"):
            delta_mod.pair_up(np.full(7, levels, np.uint8), sizes, levels)  # a value at the levels
        symbols = delta_mod.pair_up(np.zeros(7, np.uint8), sizes, levels)[0]
        if levels < 16:
            with pytest.raises(ValueError, match="no pair"):
                delta_mod.unpair(np.full_like(symbols, levels * levels), sizes, levels)
        tail = symbols.copy()
        tail[-1] = levels  # the odd group's last value, past the levels
        with pytest.raises(ValueError, match="no pair"):
            delta_mod.unpair(tail, sizes, levels)
        with pytest.raises(ValueError):
            delta_mod.unpair(symbols[:-1], sizes, levels)
    with pytest.raises(ValueError, match="1 to 16"):
        delta_mod.pair_up(np.zeros(4, np.uint8), np.array([4]), 17)
    for native in (delta_mod.native, None):  # sizes no grouping has
        monkeypatch.setattr(delta_mod, "native", native)
        with pytest.raises(ValueError):
            delta_mod.pair_up(np.zeros(4, np.uint8), np.array([5, -1]), 4)
        with pytest.raises(ValueError):
            delta_mod.unpair(np.zeros(3, np.uint8), np.array([5, -1]), 4)


def test_gap_delta_reads_back_and_refuses_damage(monkeypatch) -> None:
    """A long delta where few values changed is coded as the gaps between them and their values
    (``"ans8:gaps"``), in a fraction of the symbols one a symbol takes, and reads back to the
    codes, with or without the compiled kernels; a damaged value (at the levels), a header that
    does not give a token count for each group, runs past the blob or counts more tokens than a
    group's values can take (before any stream of them is made), an empty suffix, or a base coded
    past the delta's levels is corrupt. Gaps are not tried where a fifth of the values changed, nor
    where their tables would outweigh the delta."""
    from hf_dynaquant.codecs import dynaquant as dynaquant_mod
    from hf_dynaquant.core import ans as ans_mod
    from hf_dynaquant.core import delta as delta_mod
    from hf_dynaquant.core.ans import LANES, ans_encode
    from hf_dynaquant.core.delta import GAP_ESCAPE, gap_up, grouped_delta
    from hf_dynaquant.core.varint import length_prefixed, uleb128_encode

    rng = np.random.default_rng(14)
    prev = rng.integers(0, 10, 2_000_003).astype(np.uint8)  # 10 levels, as the weights at 8 bins
    # codes move in some stretches (rows whose gradients were large), mostly by one level
    rate = np.where(np.arange(prev.size) // 1000 % 7 == 0, 0.1, 0.01)
    cur = np.where(rng.random(prev.size) < rate, (prev + rng.choice([1, 9], prev.size)) % 10, prev).astype(np.uint8)

    def state(codes: np.ndarray) -> QuantState:
        centres = np.linspace(-1, 1, 8, dtype=np.float32)
        return QuantState(codes, 10, centres, np.zeros(0, np.uint16), "F32", codes.shape)

    codec = DynaQuantCodec()
    gapped = codec._encode_state(state(cur), state(prev), {})
    assert gapped.params["mode"] == "delta" and gapped.params["delta_stream"] == ["ans8:gaps", prev.size]
    with monkeypatch.context() as patch:
        patch.setattr(dynaquant_mod, "_GAP_SHARE", -1.0)  # gaps never tried
        other = codec._encode_state(state(cur), state(prev), {})
    assert other.params["delta_stream"][0] in ("ans8", "ans8:pairs")
    assert len(gapped.blobs["delta"]) < 1.02 * len(other.blobs["delta"])

    def blobs(name: str) -> np.ndarray:
        return np.frombuffer(gapped.blobs[name], np.uint8)

    blobs.where = "entry x, tensor w"  # type: ignore[attr-defined]
    assert np.array_equal(codec.decode("F32", cur.shape, gapped.params, blobs, state(prev.copy())).codes, cur)
    grouped, pairs = grouped_delta(prev, cur, 10)
    symbols, histograms, token_counts = gap_up(grouped, pairs)
    assert symbols.size < 0.1 * prev.size  # (a token and a value for each of the ~2% changed, and the escapes)
    heads = int(token_counts.sum())
    damaged = symbols.copy()
    damaged[heads] = 9  # the first changed value, at the levels (values are stored less 1)
    header = length_prefixed(uleb128_encode(token_counts.astype(np.uint64)).tobytes())
    rows = _rows_of(damaged, histograms)
    payload = np.frombuffer(header + ans_encode(damaged, lanes=LANES, histograms=rows), np.uint8)
    blob = lambda name: payload  # noqa: E731
    blob.where = "entry x, tensor w"  # type: ignore[attr-defined]
    with pytest.raises(CorruptCheckpointError, match="tensor w: .*out of range"):
        codec.decode("F32", cur.shape, gapped.params, blob, state(prev.copy()))
    rans = gapped.blobs["delta"][len(header) :]  # (the stream after the token counts)
    huge = token_counts.copy()
    huge[0] = 1 << 40  # (a table of that many escapes is cheap to write; its stream must not be made)
    table = uleb128_encode(np.array([GAP_ESCAPE + 1, *[0] * GAP_ESCAPE, 1 << 40], np.uint64)).tobytes()
    damaged_headers = {
        "holds no token count for each": uleb128_encode(np.array([2, 1, 1], np.uint64)).tobytes() + rans,
        "token counts runs past the end": uleb128_encode(np.array([200], np.uint64)).tobytes() + b"\x01" * 9,
        "more tokens than": length_prefixed(uleb128_encode(huge.astype(np.uint64)).tobytes())
        + length_prefixed(table),
    }
    for what, data in damaged_headers.items():
        blob = lambda name, data=data: np.frombuffer(data, np.uint8)  # noqa: E731
        blob.where = "entry x, tensor w"  # type: ignore[attr-defined]
        with pytest.raises(CorruptCheckpointError, match=f"tensor w: gap stream's .*{what}"):
            codec.decode("F32", cur.shape, gapped.params, blob, state(prev.copy()))
    with pytest.raises(CorruptCheckpointError, match="tensor w: .*'ans8:', not an rANS stream"):
        empty_suffix = {**gapped.params, "delta_stream": ["ans8:", prev.size]}
        codec.decode("F32", cur.shape, empty_suffix, blobs, state(prev.copy()))
    with monkeypatch.context() as patch:  # the reader without the compiled kernels (numpy and constriction)
        patch.setattr(delta_mod, "native", None)
        patch.setattr(ans_mod, "native", None)
        assert np.array_equal(codec.decode("F32", cur.shape, gapped.params, blobs, state(prev.copy())).codes, cur)
    dense = np.where(rng.random(prev.size) < 0.2, (prev + 1) % 10, prev).astype(np.uint8)  # a fifth changed
    assert codec._encode_state(state(dense), state(prev), {}).params["delta_stream"][0] != "ans8:gaps"
    few = codec._encode_state(state(cur[:3000]), state(prev[:3000]), {})  # tables that would outweigh the delta
    assert few.params["delta_stream"][0] == "ans"
    far = prev.copy()
    far[7] = 12  # a base code past the delta's 10 levels: its groups are not the encoder's
    with pytest.raises(CorruptCheckpointError, match="tensor w"):
        codec.decode("F32", cur.shape, gapped.params, blobs, state(far))


def _rows_of(symbols: np.ndarray, histograms: np.ndarray) -> np.ndarray:
    """The stream's group histograms recounted after one symbol changed: the groups keep the
    sizes of ``histograms``' rows."""
    bounds = np.concatenate(([0], np.cumsum(histograms.sum(axis=1))))
    return np.array([np.bincount(symbols[a:b], minlength=256) for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("levels", [1, 2, 10, 34, 256])
def test_gap_up_matches_numpy_reference_and_ungaps(monkeypatch, levels) -> None:
    """``gap_up`` (each group's gaps before its changed values, escapes for long ones, then the
    changed values less 1) and ``ungap``, compiled and in numpy, agree and invert each other over
    groups of every size, empty ones included, at every change rate, gaps past the escape and
    changes at a group's first and last place included; damaged streams are refused both ways."""
    from hf_dynaquant.core import delta as delta_mod

    escape = delta_mod.GAP_ESCAPE
    rng = np.random.default_rng(levels)
    for n in (0, 1, 7, 63, 64, 65, 1000, 10_007):
        for share in (0.0, 0.002, 0.05, 0.5, 1.0):
            prev = rng.integers(0, levels, n).astype(np.uint8)
            cur = np.where(rng.random(n) < share, rng.integers(0, levels, n), prev).astype(np.uint8)
            grouped, pairs = delta_mod.grouped_delta(prev, cur, levels)
            sizes, changed = pairs.sum(axis=1), pairs[:, 1:].sum(axis=1)
            symbols, counts, token_counts = delta_mod.gap_up(grouped, pairs)
            assert symbols.size == int(token_counts.sum() + changed.sum())
            bounds = np.concatenate(([0], np.cumsum(np.concatenate((token_counts, changed)))))
            for g in range(2 * sizes.size):
                assert np.array_equal(np.bincount(symbols[bounds[g] : bounds[g + 1]], minlength=256), counts[g])
            assert np.array_equal(delta_mod.ungap(symbols, token_counts, sizes, levels), grouped)
            with monkeypatch.context() as patch:
                patch.setattr(delta_mod, "native", None)
                reference = delta_mod.gap_up(grouped, pairs)
                assert all(np.array_equal(a, b) for a, b in zip(reference, (symbols, counts, token_counts)))
                assert np.array_equal(delta_mod.ungap(symbols, token_counts, sizes, levels), grouped)
    for native in (delta_mod.native, None):
        monkeypatch.setattr(delta_mod, "native", native)
        if levels > 1:
            # group 0: 2 * escape + 4 values, its last changed (2 escapes, then a gap of 3); group 1: 5, its second
            values = np.zeros(2 * escape + 9, np.uint8)
            values[2 * escape + 3], values[2 * escape + 5] = 1, 1
            pairs = np.zeros((2, levels), np.int64)
            pairs[0, :2], pairs[1, :2] = (2 * escape + 3, 1), (4, 1)
            symbols, _, token_counts = delta_mod.gap_up(values, pairs)
            assert symbols.tolist() == [escape, escape, 3, 1, 0, 0] and token_counts.tolist() == [3, 1]
            with pytest.raises(ValueError, match="changed values"):  # pairs that are not the delta's
                delta_mod.gap_up(values, pairs[:, ::-1].copy())
            sizes = pairs.sum(axis=1)
            for at, bad in ((2, 4), (3, 5), (0, escape + 1), (4, levels - 1)):  # gaps past the ends; a token; a value
                damaged = symbols.copy()
                damaged[at] = bad
                with pytest.raises(ValueError, match="out of range"):
                    delta_mod.ungap(damaged, token_counts, sizes, levels)
            with pytest.raises(ValueError):  # a value too few, or too many
                delta_mod.ungap(symbols[:-1], token_counts, sizes, levels)
            with pytest.raises(ValueError):
                delta_mod.ungap(np.append(symbols, 0), token_counts, sizes, levels)
        with pytest.raises(ValueError):  # token counts that do not fit the symbols
            delta_mod.ungap(np.zeros(1, np.uint8), np.array([2]), np.array([5]), 4)
        with pytest.raises(ValueError, match="fits the group"):  # more than a group of 5 takes; a sum that wraps
            delta_mod.ungap(np.zeros(7, np.uint8), np.array([6, 1]), np.array([5, 1]), 4)
        with pytest.raises(ValueError, match="fits the group"):
            delta_mod.ungap(np.zeros(0, np.uint8), np.full(4, 1 << 62), np.full(4, 3), 4)


@pytest.mark.parametrize("size", [0, 1, 7, 100_003])
@pytest.mark.parametrize("top", [1, 9, 256])
def test_byte_counts_is_bincount(size, top) -> None:
    from hf_dynaquant.core.histogram import byte_counts

    symbols = np.random.default_rng(size + top).integers(0, top, size).astype(np.uint8)
    for minlength in (1, 5, 300):
        assert np.array_equal(byte_counts(symbols, minlength), np.bincount(symbols, minlength=minlength))


def test_byte_counts_of_few_values_and_many(simd_path) -> None:
    """The kernel counts a span of 2^20 bytes value by value where all are below 36 (a byte
    counter per lane, summed every 255 vectors) and byte by byte otherwise: spans of each kind
    side by side, values at the edge (35, 36), a run longer than a counter counts, and lengths
    that end inside a vector, at each width the CPU has (64 bytes with AVX-512 BW, 32 with AVX2;
    16, the baseline's, with the vector paths turned off)."""
    from hf_dynaquant.core.histogram import byte_counts

    rng = np.random.default_rng(7)
    span = 1 << 20
    mixed = rng.integers(0, 10, 3 * span + 77).astype(np.uint8)
    mixed[span + 12345] = 200  # the second span counted byte by byte, the others value by value
    cases = [
        mixed,
        np.full(2 * span + 5, 35, np.uint8),  # one value: each lane's counter reaches 255 per block
        np.full(span + 3, 36, np.uint8),
        rng.integers(0, 36, span - 1).astype(np.uint8),
        rng.integers(0, 37, span + 1).astype(np.uint8),
        rng.integers(33, 36, 64 * 255 + 63).astype(np.uint8),
        rng.integers(0, 34, 64 * 255 * 3 + 5).astype(np.uint8),  # an embedding's levels: not a multiple of four
        np.full(32 * 255 * 2 + 31, 2, np.uint8),
        rng.integers(0, 5, 16 * 255 + 15).astype(np.uint8),
    ]
    for symbols in cases:
        assert np.array_equal(byte_counts(symbols), np.bincount(symbols)), symbols[:4]


def test_fidelity_kernel_matches_float64_reference(monkeypatch) -> None:
    from hf_dynaquant.core import moments as moments_mod

    assert moments_mod.native is not None, "the compiled kernels were not built"
    a = torch.randn(3_000_001)  # not a multiple of the kernel's four partial sums, over several chunks
    b = a + 0.01 * torch.randn(a.shape)
    sums = moments_mod.fidelity_sums(a, b)
    monkeypatch.setattr(moments_mod, "native", None)
    np.testing.assert_allclose(sums, moments_mod.fidelity_sums(a, b), rtol=1e-9)


def test_fidelity_of_codes_is_the_fidelity_of_their_values(monkeypatch) -> None:
    """The fidelity sums read through the codes' table are those of the dequantized values bit
    for bit (pruned and centre codes, a length off the kernel's four partial sums); protected
    values take the decoded path; a protected code without its value, or a code beyond the
    centres, is refused."""
    from hf_dynaquant.core import moments as moments_mod
    from hf_dynaquant.core.quantizer import QuantConfig, dequantize, plan_quantization, quantize

    assert moments_mod.native is not None, "the compiled kernels were not built"
    a = torch.randn(1_000_003, generator=torch.Generator().manual_seed(3))
    for protect in (0.0, 0.01):
        plan = plan_quantization({"x": a.view(-1, 1)}, QuantConfig(bins=6, prune=0.2, protect=protect, min_numel=1))
        tp = plan.tensors["x"]
        codes, kept = quantize(a, tp)
        assert bool(kept.size) == bool(protect)
        expected = moments_mod.fidelity_sums(a, torch.from_numpy(dequantize(codes, tp.centres, kept)))
        assert np.array_equal(moments_mod.quantized_fidelity_sums(a, codes, tp.centres, kept), expected)
    unprotected = QuantConfig(bins=6, protect=0.0, min_numel=1)
    codes, _ = quantize(a, plan_quantization({"x": a.view(-1, 1)}, unprotected).tensors["x"])
    for bad in (1, 2 + 6):
        spoilt = codes.copy()
        spoilt[-1] = bad
        with pytest.raises(ValueError, match="protected or beyond"):
            moments_mod.quantized_fidelity_sums(a, spoilt, np.zeros(6, np.float32), np.zeros(0, np.uint16))


def test_quantization_sums_in_parts_are_the_whole_tensors() -> None:
    """A tensor longer than a part is quantized and summed part by part on several threads: the
    sums are those of its whole codes (to float64 rounding, added in another order), the
    stochastic rounding of each part drawing its own positions' random numbers; a plan that
    reads more than the values (protected by sensitivity here) quantizes the tensor whole."""
    from hf_dynaquant.core import moments as moments_mod
    from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization, quantize

    n = 2 * moments_mod._STATS_PART + 12_345
    a = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 1e-3
    sens = a.abs() * torch.rand(n, generator=torch.Generator().manual_seed(5))
    for config, sensitivity in (
        (QuantConfig(bins=3, prune=0.1, protect=0.0, min_numel=1), None),
        (QuantConfig(bins=5, protect=0.0, min_numel=1, rounding="stochastic", rounding_seed=7), None),
        (QuantConfig(bins=4, prune=0.1, protect=0.01, prune_by="sensitivity", min_numel=1), {"x": sens.view(-1, 1)}),
    ):
        tp = plan_quantization({"x": a.view(-1, 1)}, config, sensitivity=sensitivity).tensors["x"]
        codes, kept = quantize(a, tp)
        whole = moments_mod.quantized_fidelity_sums(a, codes, tp.centres, kept)
        np.testing.assert_allclose(moments_mod.quantization_sums(a, tp), whole, rtol=1e-9)
        assert np.array_equal(moments_mod.quantization_sums(a, tp), moments_mod.quantization_sums(a.clone(), tp))


@pytest.mark.parametrize("eps", [1e-8, 1e-6, 0.0])
def test_scale_codes_made_from_v_are_the_codes_of_the_scale(eps: float) -> None:
    """An Adam scale's plan partitions v itself against thresholds found by bisection with
    adam_scale: the codes are those of the scale log(sqrt(v) + eps) for v over 30 decades, zeros,
    negatives, NaN, infinity, bfloat16 v, and the float32 neighbours of every threshold; grids
    of up to 31 midpoints and more (the kernel's search by halves)."""
    from hf_dynaquant.core.moments import adam_scale, scale_plan

    g = torch.Generator().manual_seed(1)
    v = torch.exp(torch.rand(400_000, generator=g) * 70 - 60)
    v[:10], v[10:20], v[20], v[21] = 0.0, -1e-9, float("nan"), float("inf")
    for step in (1.0, 0.25):
        top = float(adam_scale(v[22:20_000], eps).max())
        plan = scale_plan(top, eps, step)
        plain = replace(plan, thresholds=None)
        t = plan.thresholds[np.isfinite(plan.thresholds)]
        near = np.concatenate([t, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(-np.inf))])
        for values in (torch.cat([v, torch.from_numpy(near.astype(np.float32))]), v.to(torch.bfloat16)):
            from_v, _ = quantize(values.float(), plan)
            from_scale, _ = quantize(adam_scale(values, eps), plain)
            assert np.array_equal(from_v, from_scale), (step, values.dtype)
        assert plan.thresholds.size == plan.centres.size - 1 and (step == 1.0 or plan.thresholds.size > 31)


def _large_adam_state(n: int = 1100 * 1000) -> dict:
    """An AdamW state after three steps of gradients with log-normal scales: one parameter of n
    values (sketched from a sample), one small."""
    g = torch.Generator().manual_seed(11)
    state = {}
    for pid, size in enumerate((n, 5000)):
        sigma = torch.exp(torch.randn(size, generator=g)) * 1e-3
        g1, g2, g3 = (torch.randn(size, generator=g) * sigma for _ in range(3))
        m = 0.1 * (g3 + 0.9 * g2 + 0.81 * g1)
        v = 0.001 * (g3.square() + 0.999 * g2.square() + 0.998 * g1.square())
        state[pid] = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}
    return {"state": state, "param_groups": [{"params": [0, 1], "eps": 1e-8, "lr": 1e-3}]}


def test_large_moments_are_decided_from_a_sample_and_checked_whole(monkeypatch) -> None:
    """The decisions read a large state's values where a sketch samples them (the plan, the
    fidelity check, the scale gain): the same bin counts and scale grids as from every value,
    gains within a percent. Finiteness and the scale's top are of every value: a NaN or an
    infinity, or an m whose update overflows, at a position the sample skips still makes the
    state lossless; v at -inf (counted as 0) does not."""
    from hf_dynaquant.core import sketch as sketch_mod
    from hf_dynaquant.training.optimizer_state import encode_optimizer_state

    state = _large_adam_state()
    sampled = encode_optimizer_state(state)
    monkeypatch.setattr(sketch_mod, "SAMPLE_FROM", 1 << 62)  # every value, as the reference
    exact = encode_optimizer_state(state)
    monkeypatch.undo()
    assert sampled.report["bins"] == exact.report["bins"] and set(sampled.report["bins"]) == {"0", "1"}
    for key in ("/state/0/dq_scale", "/state/1/dq_scale", "/state/1/dq_update"):
        assert np.array_equal(sampled.plans[key].centres, exact.plans[key].centres), key
    centres = exact.plans["/state/0/dq_update"].centres
    assert np.abs(sampled.plans["/state/0/dq_update"].centres - centres).max() < 0.01 * np.abs(centres).max()
    for key in ("dq_gain", "dq_scale_gain"):
        assert sampled.tree["state"][0][key] == pytest.approx(exact.tree["state"][0][key], rel=0.01)
        assert sampled.tree["state"][1][key] == exact.tree["state"][1][key]  # (small: every value)
    skipped = int(np.flatnonzero(~sketch_mod._sampled_blocks(0, 1000))[3]) * 64 + 5  # a value no sample reads
    assert skipped not in set(sketch_mod.sample(torch.arange(1100 * 1000), 1100 * 1000)[0].tolist())
    overflow = {"exp_avg": 1e32, "exp_avg_sq": 0.0}  # 1e32 / (0 + 1e-8) overflows float32
    for spoil in ({"exp_avg": float("nan")}, {"exp_avg_sq": float("nan")}, {"exp_avg_sq": float("inf")}, overflow):
        spoilt = _large_adam_state()
        for moment, value in spoil.items():
            spoilt["state"][0][moment][skipped] = value
        with pytest.warns(NonFiniteTensorWarning, match="parameter 0"):
            report = encode_optimizer_state(spoilt).report
        assert report["non_finite"] == [0] and "0" not in report["bins"], spoil
    negative = _large_adam_state()
    negative["state"][0]["exp_avg_sq"][skipped] = -float("inf")
    assert "non_finite" not in encode_optimizer_state(negative).report


def test_large_moments_other_kinds_and_settings(monkeypatch) -> None:
    """The sampled decisions with a min_numel above the sample's size (the candidates are chosen
    by their full sizes), for SGD momentum (the fidelity checked on the sample holds on every
    value), and for
    float64 moments whose values lie past float32's range at a position no sample reads (the
    update or scale would be infinite: lossless); a scale threshold below v = 0's scale is -inf."""
    from hf_dynaquant.core import sketch as sketch_mod
    from hf_dynaquant.core.moments import _second_moment_thresholds, fidelity_from_sums, quantization_sums
    from hf_dynaquant.training.optimizer_state import MomentQuant, encode_optimizer_state

    big = encode_optimizer_state(_large_adam_state(), settings=MomentQuant(min_numel=1 << 18)).report
    assert set(big["bins"]) == {"0"} and big["quantized"] == 1
    g = torch.Generator().manual_seed(13)
    sgd = {
        "state": {0: {"momentum_buffer": torch.randn(1_100_000, generator=g) * torch.logspace(-3, 0, 1_100_000)}},
        "param_groups": [{"params": [0], "lr": 0.1, "momentum": 0.9}],
    }
    sampled = encode_optimizer_state(sgd)
    # the check made on the sample holds on every value (the codebook from the sample may differ
    # from the one every value gives: the paper's bucket weights count each occupied bucket's
    # magnitude once, and a sample occupies fewer of a heavy tail's sparse buckets)
    plan, settings = sampled.plans["/state/0/dq_momentum"], MomentQuant()
    cosine, rel = fidelity_from_sums(quantization_sums(sgd["state"][0]["momentum_buffer"], plan))
    assert sampled.report["bins"] == {"0": plan.centres.size} and cosine >= settings.min_cosine
    assert rel <= settings.max_rel_error
    skipped = int(np.flatnonzero(~sketch_mod._sampled_blocks(0, 1000))[3]) * 64 + 5  # a value no sample reads
    wide = _large_adam_state()
    for entry in wide["state"].values():
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg"].double(), entry["exp_avg_sq"].double()
    wide["state"][0]["exp_avg_sq"][skipped] = 1e300
    wide_sgd = {
        "state": {0: {"momentum_buffer": sgd["state"][0]["momentum_buffer"].double()}},
        "param_groups": sgd["param_groups"],
    }
    wide_sgd["state"][0]["momentum_buffer"][skipped] = -1e300
    for state in (wide, wide_sgd):
        with pytest.warns(NonFiniteTensorWarning, match="parameter 0"):
            report = encode_optimizer_state(state).report
        assert report["non_finite"] == [0], report
    below = _second_moment_thresholds(1e-8, np.array([-30.0, -10.0], dtype=np.float32).tobytes())
    assert below[0] == -np.inf and 0 < below[1] < 1e-8


def _special_moments(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam moments with every special case: zeros, a negative and NaN v, NaN and inf m."""
    g = torch.Generator().manual_seed(5)
    m = (torch.randn(317 * 313, generator=g) * 1e-3).to(dtype)
    v = (torch.randn(317 * 313, generator=g) * 1e-3).square().to(dtype)
    v[:5] = torch.tensor([0.0, -1e-9, float("nan"), 1e-30, 4.0], dtype=dtype)
    m[5:8] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    m[8] = 0.0
    return m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_update_kernel_matches_torch(monkeypatch, dtype) -> None:
    """The compiled update is torch's to an ulp (torch's vectorised sqrt is not always
    correctly rounded), NaN and inf where torch has them, from float32 and bf16 moments."""
    from hf_dynaquant.core import moments as moments_mod

    assert moments_mod.native is not None, "the compiled kernels were not built"
    m, v = (t.view(317, 313) for t in _special_moments(dtype))
    fast = moments_mod.adam_update(m, v, 1e-8)
    monkeypatch.setattr(moments_mod, "native", None)
    reference = moments_mod.adam_update(m, v, 1e-8)
    assert fast.dtype == torch.float32 and fast.shape == m.shape
    torch.testing.assert_close(fast, reference, rtol=2.5e-7, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_scale_kernel_is_the_correctly_rounded_log(monkeypatch, dtype) -> None:
    """The compiled scale ``log(sqrt(v) + eps)`` is within an ulp of the correctly rounded log of
    ``sqrt(v) + eps`` (IEEE float32 sqrt and add), NaN and inf where torch has them, and agrees with
    torch's path (whose vectorised sqrt may be an ulp off) to float32 precision."""
    from hf_dynaquant.core import moments as moments_mod

    assert moments_mod.native is not None, "the compiled kernels were not built"
    _, v = _special_moments(dtype)
    g = torch.Generator().manual_seed(9)
    spread = (torch.randn(200_003, generator=g) * 1e-3).square() * torch.exp(torch.randn(200_003, generator=g) * 6)
    v = torch.cat([v, spread.to(dtype), torch.tensor([float("inf"), 1.0, 0.25, 3e38], dtype=dtype)])
    fast = moments_mod.adam_scale(v.view(-1, 1), 1e-8)
    assert fast.dtype == torch.float32 and fast.shape == (v.numel(), 1)
    fast = fast.reshape(-1)
    y = np.sqrt(np.maximum(v.float().numpy(), np.float32(0))) + np.float32(1e-8)  # float32, correctly rounded
    exact = torch.from_numpy(np.log(y.astype(np.float64)).astype(np.float32))
    assert torch.equal(fast.isnan(), exact.isnan()) and torch.equal(fast.isinf(), exact.isinf())
    ok = ~exact.isnan() & ~exact.isinf()
    ulps = (fast[ok].view(torch.int32).long() - exact[ok].view(torch.int32).long()).abs()
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 1e-3
    monkeypatch.setattr(moments_mod, "native", None)
    reference = moments_mod.adam_scale(v, 1e-8)
    torch.testing.assert_close(fast, reference, rtol=2.5e-7, atol=2.5e-7, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_update_and_scale_in_parts_are_the_same_bits(monkeypatch, dtype) -> None:
    """A large moment's update and scale, made in parts on several threads, are bit for bit
    those made in one pass."""
    from hf_dynaquant.core import moments as moments_mod

    m, v = _special_moments(dtype)
    whole = moments_mod.adam_update(m, v, 1e-8), moments_mod.adam_scale(v, 1e-8)
    monkeypatch.setattr(moments_mod, "_SPLIT_FROM", 1000)
    monkeypatch.setattr(moments_mod._POOL, "max_workers", 4)  # parts even on a one-core machine
    assert len(moments_mod._part_bounds(m.numel())) > 2
    parts = moments_mod.adam_update(m, v, 1e-8), moments_mod.adam_scale(v, 1e-8)
    for a, b in zip(whole, parts):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_adam_update_made_in_parts_is_the_update(dtypes) -> None:
    """``adam_update_parts`` fills any parts, in any order, with the bits ``adam_update`` makes
    whole, special values included; it declines moments the kernel cannot read as they are."""
    from hf_dynaquant.core import moments as moments_mod

    m, v = _special_moments(torch.float32)
    m, v = m.to(dtypes[0]), v.to(dtypes[1])
    whole = moments_mod.adam_update(m, v, 1e-8).view(torch.int32).numpy()
    fill = moments_mod.adam_update_parts(m.view(317, 313), v.view(317, 313), 1e-8)
    assert fill is not None
    out = np.full(m.numel(), np.nan, dtype=np.float32)
    bounds = [0, 1, 999, 1000, 50_000, m.numel()]
    for a, b in reversed(list(zip(bounds, bounds[1:]))):
        fill(a, b, out[a:b])
    assert np.array_equal(out.view(np.int32), whole)
    assert moments_mod.adam_update_parts(m.view(317, 313).t(), v.view(317, 313).t(), 1e-8) is None  # not contiguous
    assert moments_mod.adam_update_parts(m.double(), v.double(), 1e-8) is None
    assert moments_mod.adam_update_parts(m, v[:-1], 1e-8) is None


def test_bf16_values_widened_in_parts_are_their_float32() -> None:
    """``bf16_parts`` widens any part of a contiguous bfloat16 CPU tensor to its exact float32
    (special values included), and declines any other tensor."""
    from hf_dynaquant.core.dtypes import bf16_parts

    m, v = _special_moments(torch.bfloat16)
    fill = bf16_parts(m.view(317, 313))
    assert fill is not None
    out = np.empty(m.numel(), dtype=np.float32)
    for a, b in ((5000, m.numel()), (0, 7), (7, 5000)):
        fill(a, b, out[a:b])
    assert np.array_equal(out.view(np.int32), m.float().view(torch.int32).numpy())
    for other in (m.float(), m.view(317, 313).t(), v.half()):
        assert bf16_parts(other) is None


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("kind", ["plain", "protect", "sensitivity", "dither"])
def test_values_made_in_parts_are_quantized_as_the_whole(monkeypatch, kernels, kind) -> None:
    """``quantize`` of values made a part at a time (``ValuesInParts``) gives the codes and
    protected values of the whole tensor: a part at a time where the plan partitions the values
    alone (pruned, protected by magnitude or not, over many parts), made whole first where it
    reads more (a sensitivity, stochastic rounding), which is never filled a part at a time."""
    from hf_dynaquant.core.dtypes import ValuesInParts

    if not kernels:
        monkeypatch.setattr(quantizer_mod, "native", None)
    monkeypatch.setattr(quantizer_mod, "PART_VALUES", 1000)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(101, 99, generator=g) * 0.05
    config = QuantConfig(
        bins=6,
        prune=0.2,
        protect=0.0 if kind == "plain" else 0.01,
        min_numel=1,
        rounding="stochastic" if kind == "dither" else "nearest",
    )
    sensitivity = {"w": (w * torch.randn(101, 99, generator=g)).abs()} if kind == "sensitivity" else None
    plan = plan_quantization({"w": w}, config, sensitivity=sensitivity).tensors["w"]
    assert plan.reads_parts() == (kind in ("plain", "protect"))
    flat = w.reshape(-1).numpy()
    parts: list[tuple[int, int]] = []

    def fill(start: int, stop: int, out: np.ndarray) -> None:
        parts.append((start, stop))
        out[...] = flat[start:stop]

    codes, protected = quantize(ValuesInParts((101, 99), fill), plan)
    expected_codes, expected_protected = quantize(w, plan)
    assert np.array_equal(codes, expected_codes) and np.array_equal(protected, expected_protected)
    assert (protected.size > 0) == (kind != "plain")
    if plan.reads_parts():
        assert parts == [(a, min(a + 1000, w.numel())) for a in range(0, w.numel(), 1000)]
    else:
        assert parts == [(0, w.numel())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [1.0, 0.25, 3.0])
def test_adam_scale_stats_are_the_scales_stats(dtype, step) -> None:
    """The statistics of Adam's scale made straight from ``v`` (no scale tensor) are those of
    the scale: finiteness and maximum exactly, the gain sum but for the order of its additions;
    a NaN or infinite ``v`` makes them not finite."""
    from hf_dynaquant.core import moments as moments_mod
    from hf_dynaquant.core.moments import adam_scale, adam_scale_stats, scale_stats

    _, v = _special_moments(dtype)
    v = torch.cat([v[3:], v[3:].flip(0)] * 24)  # finite, over several of the kernel's blocks and two parts
    assert v.numel() > moments_mod._STATS_PART
    for values in (v, v[:0], v[:5]):
        fused, separate = adam_scale_stats(values, 1e-8, step), scale_stats(adam_scale(values, 1e-8), 1e-8, step)
        assert fused[:2] == separate[:2] and fused[0]
        np.testing.assert_allclose(fused[2], separate[2], rtol=1e-12)
    for bad in (float("nan"), float("inf")):
        spoilt = v.clone()
        spoilt[12_345] = bad
        assert not adam_scale_stats(spoilt, 1e-8, step)[0] and not scale_stats(adam_scale(spoilt, 1e-8), 1e-8, step)[0]


@pytest.mark.parametrize("step", [1.0, 0.25, 3.0])
def test_scale_stats_kernel_matches_torch(monkeypatch, step) -> None:
    """Finiteness, maximum and scale-gain sums of the compiled pass agree with torch's (the
    vectorised exp to 1e-7; a step above 1 takes the C library's exp)."""
    from hf_dynaquant.core import moments as moments_mod

    assert moments_mod.native is not None, "the compiled kernels were not built"
    _, v = _special_moments(torch.float32)
    scale = moments_mod.adam_scale(v[3:], 1e-8)  # finite (no NaN v)
    bad = scale.clone()
    bad[17] = float("inf")
    fast = [moments_mod.scale_stats(s, 1e-8, step) for s in (scale, bad, scale[:0])]
    monkeypatch.setattr(moments_mod, "native", None)
    finite, top, sums = moments_mod.scale_stats(scale, 1e-8, step)
    assert fast[0][:2] == (True, top) and finite
    np.testing.assert_allclose(fast[0][2], sums, rtol=2e-7)
    assert not fast[1][0] and not moments_mod.scale_stats(bad, 1e-8, step)[0]
    assert fast[2][0] and fast[2][1] == -math.inf and list(fast[2][2]) == [0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gains", [(1.0, 1.0), (1.37, 1.05)])
def test_moments_from_update_and_scale_kernel_matches_torch(monkeypatch, dtype, gains) -> None:
    """Adam's moments back from a decoded update and scale: the compiled pass (one expf per
    distinct scale value, through its cache) is torch's to an ulp, on a scale of grid values
    (more of them than the cache has ways for some sets), NaN, a scale under the floor and
    zeros; in place for float32, converted for bf16."""
    from hf_dynaquant.core import moments as moments_mod

    assert moments_mod.native is not None, "the compiled kernels were not built"
    g = torch.Generator().manual_seed(5)
    n = 300_000
    u = torch.randn(n, generator=g)
    s = math.log(1e-8) + torch.randint(0, 254, (n,), generator=g).float() * 0.37  # the grid's centres
    s[:4] = torch.tensor([float("nan"), math.log(1e-8) - 1.0, math.log(1e-8), 0.0])
    u[4:6] = torch.tensor([float("nan"), 0.0])
    gain, scale_gain = gains
    results = []
    for native in (moments_mod.native, None):
        monkeypatch.setattr(moments_mod, "native", native)
        uu, ss = u.clone(), s.clone()
        m, v = moments_mod.update_scale_to_adam(uu, ss, 1e-8, dtype, gain=gain, scale_gain=scale_gain, inplace=True)
        assert m.dtype == v.dtype == dtype
        if dtype == torch.float32:
            assert m.data_ptr() == uu.data_ptr() and v.data_ptr() == ss.data_ptr()  # in place
        results.append((m.float(), v.float()))
    (fast_m, fast_v), (ref_m, ref_v) = results
    ulp = 2.5e-7 if dtype == torch.float32 else 2**-7  # (a float32 ulp can round to the other bf16)
    torch.testing.assert_close(fast_m, ref_m, rtol=ulp, atol=0, equal_nan=True)
    torch.testing.assert_close(fast_v, ref_v, rtol=2 * ulp, atol=0, equal_nan=True)
    assert fast_v[1] == 0 and fast_v[2] == 0 and torch.isnan(fast_v[0]) and torch.isnan(fast_m[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gains", [(1.0, 1.0), (1.37, 1.05)])
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("with_protected", [True, False])
def test_moments_from_codes_match_decoding_then_converting(monkeypatch, dtype, gains, parts, with_protected) -> None:
    """Adam's moments straight from the codes of an update and a scale (the restore's path, which
    never holds their float32 values) are bit for bit the moments of their decoded values: with
    pruned and protected codes in both (a NaN and an infinity among the update's protected
    values, a protected scale under the floor), or none protected (the optimizer's codes), gains,
    float32 and bf16 out; compiled, and in
    torch (whose conversion is the compiled one's to an ulp, test above); the compiled one whole
    and cut into three parts converted on three threads at once, whose protected values each
    begin where the part before stopped."""
    from types import SimpleNamespace

    from hf_dynaquant.core import moments as moments_mod
    from hf_dynaquant.core.pool import ForkSafePool

    assert moments_mod.native is not None, "the compiled kernels were not built"
    if parts > 1:
        monkeypatch.setattr(moments_mod, "_POOL", ForkSafePool("test-adam", parts))
        monkeypatch.setattr(moments_mod, "_SPLIT_FROM", 1000)
    rng = np.random.default_rng(7)
    n, eps = 200_003, 1e-8

    def coded(centres: np.ndarray, protected: np.ndarray) -> SimpleNamespace:
        codes = rng.integers(0, 2 + centres.size, n).astype(np.uint8)
        codes[rng.choice(n, protected.size, replace=False)] = PROTECTED
        codes[np.flatnonzero(codes == PROTECTED)[protected.size :]] = 0  # exactly one code per protected value
        bits = torch.from_numpy(protected).bfloat16().view(torch.int16).numpy().view(np.uint16)
        return SimpleNamespace(codes=codes, centres=centres.astype(np.float32), protected=bits, shape=(n,))

    u_special = np.array([np.nan, np.inf, -3.5, 0.0], dtype=np.float32)
    update = coded(rng.normal(size=7), np.concatenate([u_special, rng.normal(size=500).astype(np.float32)]))
    s_special = np.array([math.log(eps) - 2.0, 0.0, 1.5, np.nan, np.inf, -np.inf], np.float32)
    scale = coded(math.log(eps) + 0.37 * np.arange(254), s_special)  # (a table of 256 entries)
    if not with_protected:
        update = coded(rng.normal(size=3), np.zeros(0, np.float32))
        scale = coded(math.log(eps) + 0.37 * np.arange(14), np.zeros(0, np.float32))
    gain, scale_gain = gains
    for native in (moments_mod.native, None):
        monkeypatch.setattr(moments_mod, "native", native)
        reference = moments_mod.update_scale_to_adam(
            *(torch.from_numpy(decoded_values(c.codes, c.centres, c.protected)) for c in (update, scale)),
            eps,
            dtype,
            gain=gain,
            scale_gain=scale_gain,
            inplace=True,
        )
        m, v = moments_mod.codes_to_adam(update, scale, eps, dtype, gain=gain, scale_gain=scale_gain)
        assert m.dtype == v.dtype == dtype and m.shape == v.shape == (n,)
        for got, want in zip((m, v), reference):
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan)  # (torch and the kernel spell a bf16 NaN differently)
            as_int = torch.int32 if dtype == torch.float32 else torch.int16
            assert torch.equal(got[~nan].view(as_int), want[~nan].view(as_int))  # bit for bit: -0.0 too


@pytest.mark.parametrize("compiled", [True, False])
def test_moments_from_codes_refuse_what_does_not_decode(monkeypatch, compiled) -> None:
    """Codes beyond their centres, or protected values that do not match the codes needing one,
    are refused (the restore names the parameter), compiled or not."""
    from types import SimpleNamespace

    from hf_dynaquant.core import moments as moments_mod

    if not compiled:
        monkeypatch.setattr(moments_mod, "native", None)

    def coded(codes: list[int], centres: int = 3, protected: int = 0) -> SimpleNamespace:
        return SimpleNamespace(
            codes=np.array(codes, np.uint8),
            centres=np.arange(centres, dtype=np.float32),
            protected=np.zeros(protected, np.uint16),
            shape=(len(codes),),
        )

    ok = coded([2, 3, 4, 0])
    with pytest.raises(ValueError, match="beyond the stored centres"):
        moments_mod.codes_to_adam(coded([2, 3, 5, 0]), ok, 1e-8)
    with pytest.raises(ValueError, match="beyond the stored centres"):
        moments_mod.codes_to_adam(ok, coded([2, 9, 4, 0]), 1e-8)
    with pytest.raises(ValueError, match="0 protected values stored, 1 codes need one"):
        moments_mod.codes_to_adam(coded([2, 1, 4, 0]), ok, 1e-8)
    with pytest.raises(ValueError, match="2 protected values stored, 1 codes need one"):
        moments_mod.codes_to_adam(ok, coded([2, 1, 4, 0], protected=2), 1e-8)
    with pytest.raises(ValueError, match=r"the update has shape \(4,\) \(4 codes\), the scale \(3,\) \(3\)"):
        moments_mod.codes_to_adam(ok, coded([2, 3, 4]), 1e-8)
    reshaped = coded([2, 3, 4, 0])
    reshaped.shape = (2, 2)
    with pytest.raises(ValueError, match=r"the scale \(2, 2\)"):
        moments_mod.codes_to_adam(ok, reshaped, 1e-8)
    if compiled:  # cut into parts on several threads: the same refusals, wherever in the tensor
        from hf_dynaquant.core.pool import ForkSafePool

        monkeypatch.setattr(moments_mod, "_POOL", ForkSafePool("test-adam", 3))
        monkeypatch.setattr(moments_mod, "_SPLIT_FROM", 6)
        many = coded([2, 3, 4, 0] * 3)
        with pytest.raises(ValueError, match="beyond the stored centres"):
            moments_mod.codes_to_adam(coded([2, 3, 4, 0, 2, 3, 4, 0, 2, 3, 5, 0]), many, 1e-8)  # the last part
        with pytest.raises(ValueError, match="beyond the stored centres"):
            moments_mod.codes_to_adam(many, coded([2, 3, 4, 0, 2, 9, 4, 0, 2, 3, 4, 0]), 1e-8)  # the middle one
        cut = [2, 1, 1, 0, 1, 3, 4, 1, 2, 3, 1, 0]  # protected codes in every part: 2, 2 and 1
        for stored in (4, 6):  # one short of them, or one over
            with pytest.raises(ValueError, match=f"update: {stored} protected values stored, 5 codes need one"):
                moments_mod.codes_to_adam(coded(cut, protected=stored), many, 1e-8)
        m, v = moments_mod.codes_to_adam(coded(cut, protected=5), many, 1e-8)
        assert m.shape == v.shape == (12,)
    from hf_dynaquant.errors import CorruptCheckpointError
    from hf_dynaquant.training import optimizer_state

    entry = {"dq_moments": "adam-v1", "dq_dtype": "torch.float32", "step": torch.tensor(1.0)}
    bad = {**entry, "dq_update": coded([2, 9, 4, 0]), "dq_scale": ok}
    with pytest.raises(CorruptCheckpointError, match="ckpt: parameter 7's Adam moments: .*beyond the stored centres"):
        optimizer_state._decoded_entry(7, bad, {7: 1e-8}, "ckpt")


def test_dequantize_kernel_matches_numpy(monkeypatch) -> None:
    from hf_dynaquant.core import quantizer as quantizer_mod

    assert quantizer_mod.native is not None, "the compiled kernels were not built"
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 10, 50_001).astype(np.uint8)
    centres = np.sort(rng.normal(size=8)).astype(np.float32)
    count = int((codes == PROTECTED).sum())
    protected = torch.randn(count).bfloat16().view(torch.int16).numpy().view(np.uint16)
    reference = rng.normal(size=codes.size).astype(np.float32)
    fast = [dequantize(codes, centres, protected), decoded_values(codes, centres, protected, reference)]
    with pytest.raises(ValueError, match="protected values stored"):
        dequantize(codes, centres, protected[1:])
    with pytest.raises(ValueError, match="beyond the stored centres"):
        dequantize(np.full(3, 10, np.uint8), centres, protected[:0])
    monkeypatch.setattr(quantizer_mod, "native", None)
    slow = [dequantize(codes, centres, protected), decoded_values(codes, centres, protected, reference)]
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    with pytest.raises(ValueError, match="protected values stored"):
        dequantize(codes, centres, protected[1:])


def test_protected_values_are_selected_as_a_mask_selects_them(monkeypatch) -> None:
    """quantize gathers the protected values where the codes say (the select kernel), in order,
    as the boolean mask of the numpy path does, into an array of the partition's count; the
    kernel refuses more such values than its output holds."""
    from hf_dynaquant.core import quantizer as quantizer_mod
    from hf_dynaquant.core.quantizer import TensorPlan, quantize

    assert quantizer_mod.native is not None, "the compiled kernels were not built"
    w = torch.randn(300, 257) * 0.05
    plan = plan_quantization({"w": w}, QuantConfig(bins=8, prune=0.1, protect=0.01, min_numel=1)).tensors["w"]
    assert isinstance(plan, TensorPlan)
    codes, kept = quantize(w, plan)
    assert kept.size == int((codes == PROTECTED).sum()) > 0
    monkeypatch.setattr(quantizer_mod, "native", None)  # the numpy path: a mask of every value
    reference_codes, reference_kept = quantize(w, plan)
    assert np.array_equal(codes, reference_codes) and np.array_equal(kept, reference_kept)
    monkeypatch.undo()
    values = np.arange(codes.size, dtype=np.float32)
    out = np.empty(kept.size, np.float32)
    assert quantizer_mod.native.select_u8(codes, PROTECTED, values, out) == kept.size
    assert np.array_equal(out, values[codes == PROTECTED])
    bits = np.arange(codes.size, dtype=np.uint16)  # (bfloat16 bits: two bytes a value)
    out16 = np.empty(kept.size, np.uint16)
    assert quantizer_mod.native.select_u8(codes, PROTECTED, bits, out16) == kept.size
    assert np.array_equal(out16, bits[codes == PROTECTED])
    with pytest.raises(ValueError, match="more values hold the code than out holds"):
        quantizer_mod.native.select_u8(codes, PROTECTED, values, out[:-1])
    with pytest.raises(ValueError, match="of 2 or 4 bytes, one per code"):
        quantizer_mod.native.select_u8(codes, PROTECTED, values[:-1], out)


def _partition_reference(w, sens, tau_mag, tau_sens, tau_prune, by_sens, mids) -> tuple[np.ndarray, int]:
    """The partition's rules, spelled out in float64 (the kernel's contract): protected where
    ``|w| > tau_mag`` or ``sens > tau_sens``, else pruned where the criterion is below
    ``tau_prune`` or exactly 0 (pruning off when ``tau_prune < 0``), else 2 + the number of
    midpoints below ``w`` (NaN: none)."""
    mag = np.abs(w).astype(np.float64)
    protected = mag > tau_mag
    if sens is not None:
        protected |= sens.astype(np.float64) > tau_sens
    criterion = (sens if by_sens and sens is not None else np.abs(w)).astype(np.float64)
    pruned = ((criterion < tau_prune) | (criterion == 0)) if tau_prune >= 0 else np.zeros(w.size, bool)
    below = (mids[None, :] < w[:, None]).sum(axis=1) if mids.size else np.zeros(w.size, np.int64)
    codes = np.where(protected, 1, np.where(pruned, 0, 2 + below)).astype(np.uint8)
    return codes, int(protected.sum())


@pytest.mark.parametrize("nmids", [0, 1, 3, 4, 7, 8, 15, 16, 31, 32, 40, 63, 64, 100, 253])
def test_partition_kernel_follows_its_rules_at_every_edge(simd_path, nmids: int) -> None:
    """The compiled partition (float32 comparisons against the double thresholds' float32
    neighbours, midpoints counted without branches up to 31 of them, past that counted on from
    a look-up by the value's top 16 bits; with AVX-512, up to 63 searched by halves in vector
    registers, with AVX2 alone in two levels: a group of midpoints, then its members) against
    the rules in float64: values on and beside
    each threshold, thresholds between two float32s, zeros of both signs, NaN and infinities,
    with and without a sensitivity, pruning by either criterion or not at all; midpoints of
    both signs, and (past 31) two at zero of opposite signs and some in one look-up bucket."""
    native = quantizer_mod.native
    assert native is not None, "the compiled kernels were not built"
    rng = np.random.default_rng(nmids)
    tau_mag, tau_sens, tau_prune = 1.5 + 1e-9, 0.75, 0.1 + 3e-10  # the first and last between float32s
    near = [np.nextafter(np.float32(t), np.float32(d)) for t in (tau_mag, tau_prune, 1.5, 0.1) for d in (-1, 2)]
    special = np.array(
        [0.0, -0.0, np.nan, np.inf, -np.inf, 1.5, -1.5, 0.1, -0.1, *near, *(-np.array(near))], dtype=np.float32
    )
    w = np.concatenate([special, rng.normal(0, 0.8, 5000).astype(np.float32)])
    sens = np.abs(rng.normal(0, 0.5, w.size)).astype(np.float32)
    sens[:40:3] = 0.0
    sens[1:40:5] = np.float32(tau_sens)
    sens[2:40:7] = np.nan  # (neither protects nor prunes)
    mids = rng.normal(0, 0.6, nmids).astype(np.float32)
    if nmids > 31:  # -0.0 and 0.0, and a run of midpoints within one bucket of the look-up
        mids[:2], mids[2:6] = (-0.0, 0.0), np.float32(0.5) + np.arange(4, dtype=np.float32) * np.float32(1e-6)
    mids = np.sort(mids)
    if nmids:
        w[100 : 100 + nmids] = mids  # values exactly on a midpoint
        w[400 : 400 + nmids] = np.nextafter(mids, np.float32(np.inf))  # and just above one
    bits = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    widened = (bits.astype(np.uint32) << 16).view(np.float32)  # the values bfloat16 weights hold
    for with_sens, by_sens, prune in [(False, False, tau_prune), (True, False, tau_prune), (True, True, tau_prune),
                                      (False, False, -1.0), (True, True, -1.0)]:  # fmt: skip
        s = sens if with_sens else None
        given = s if with_sens else mids
        for values, read in ((w, w), (widened, bits)):  # float32, and bfloat16 read as its bits
            codes = np.empty(w.size, np.uint8)
            as_bits = read is bits
            nprot = native.partition(read, as_bits, given, with_sens, tau_mag, tau_sens, prune, by_sens, mids, codes)
            want, want_prot = _partition_reference(values, s, tau_mag, tau_sens, prune, by_sens, mids)
            bad = np.flatnonzero(codes != want)
            assert bad.size == 0, (with_sens, by_sens, prune, values[bad[:5]], codes[bad[:5]], want[bad[:5]])
            assert nprot == want_prot
            short = np.empty(13, np.uint8)  # fewer values than a vector holds: all in the plain loop's tail
            native.partition(read[:13], as_bits, s[:13] if with_sens else mids, with_sens, tau_mag, tau_sens,
                             prune, by_sens, mids, short)  # fmt: skip
            assert np.array_equal(short, want[:13])
    with pytest.raises(ValueError, match="disagree in length"):  # bfloat16 bits are two bytes a value
        native.partition(bits.view(np.uint8)[:-1], True, mids, False, tau_mag, tau_sens, -1.0, False, mids, codes)


@pytest.mark.parametrize("config", [
    QuantConfig(bins=8, prune=0.1, protect=0.01, min_numel=1),
    QuantConfig(bins=40, prune=0.0, protect=0.0, min_numel=1),  # (more midpoints than the vector search takes)
    QuantConfig(bins=8, prune=0.1, protect=0.01, min_numel=1, rounding="stochastic"),
])  # fmt: skip
def test_bf16_weights_are_quantized_as_they_are(monkeypatch, simd_path, config) -> None:
    """A bfloat16 tensor is partitioned as its bits, and rounded stochastically as them after a
    restore (no float32 copy of the whole tensor is made to quantize it or to sketch it): the
    codes and protected values are those of its float32 copy, with a sensitivity or without,
    with the kernels or numpy; its protected values (none included) are an array of their own."""
    from hf_dynaquant.core.quantizer import quantize

    torch.manual_seed(3)
    w = (torch.randn(300, 257) * 0.05).to(torch.bfloat16)
    w[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5])  # zeros, a subnormal in float32, a far value
    sens = {"w": torch.rand(300, 257)}
    widened: list[int] = []
    flat_f32 = quantizer_mod.flat_f32
    def recorded(t: torch.Tensor) -> torch.Tensor:  # the bfloat16 values widened, and how many
        if t.dtype == torch.bfloat16:
            widened.append(t.numel())
        return flat_f32(t)

    monkeypatch.setattr(quantizer_mod, "flat_f32", recorded)
    for sensitivity in (None, sens):
        plan = plan_quantization({"w": w}, config, sensitivity=sensitivity).tensors["w"]
        widened.clear()
        codes, kept = quantize(w, plan)
        assert max(widened, default=0) < w.numel(), widened
        want_codes, want_kept = quantize(w.float(), plan)
        assert np.array_equal(codes, want_codes) and np.array_equal(kept, want_kept)
        assert not np.shares_memory(kept, w.view(torch.int16).numpy())  # (a kept state must not pin the tensor)
        assert kept.size == int((codes == PROTECTED).sum()) and (kept.size > 0) == (config.protect > 0)
        with monkeypatch.context() as patch:
            patch.setattr(quantizer_mod, "native", None)
            slow_codes, slow_kept = quantize(w, plan)
        assert np.array_equal(codes, slow_codes) and np.array_equal(kept, slow_kept)
    large = (torch.randn(1024, 1100) * 0.05).to(torch.bfloat16)  # (sketched from a sample: past SAMPLE_FROM)
    widened.clear()
    plan_quantization({"w": large}, config)
    assert 0 < max(widened) < large.numel() / 4, widened  # the sample's values widened, not the tensor's


def test_rle_rejects_malformed_streams() -> None:
    with pytest.raises(ValueError):
        rle_decode(np.array([3, 0]))
    with pytest.raises(ValueError):
        rle_decode(np.array([0, 3, 4]))
    with pytest.raises(ValueError):
        varint_decode(np.array([0x80], dtype=np.uint8))


@pytest.mark.parametrize("coding", ["ans", "regroup", "rle", "entropy"])
def test_chain_of_20_checkpoints_reconstructs_codes_exactly(tmp_path, coding: str) -> None:
    """Bins change along the chain; every checkpoint decodes to exactly the codes it quantized to."""
    store = CheckpointStore(tmp_path / coding)
    torch.manual_seed(0)
    w = {"a.weight": torch.randn(80, 80) * 0.05, "b.weight": torch.randn(40, 200) * 0.05, "b.bias": torch.randn(40)}
    prev, expected = None, []
    for step in range(20):
        w = {k: v + 1e-3 * torch.randn_like(v) * (step % 3 == 0) for k, v in w.items()}
        config = QuantConfig(bins=[8, 16, 6, 32, 12][step % 5], prune=0.1, protect=0.005, min_numel=1000)
        plan = plan_quantization(w, config)
        codes = {n: quantize(w[n], tp) for n, tp in plan.tensors.items()}
        expected.append({n: dequantize(c, plan.tensors[n].centres, p) for n, (c, p) in codes.items()})
        prev = compress_state_dict(store, w, config, base=prev, ref=f"s{step}", delta_coding=coding)
        expected[-1]["b.bias"] = w["b.bias"].numpy().copy()
    assert len(store.chain("s19")) == 20 and store.info("s5").base is not None
    for step in range(20):
        got = store.open(f"s{step}").load_section("model")
        for n, values in expected[step].items():
            np.testing.assert_array_equal(got[n].reshape(-1).numpy(), values.reshape(-1))
    assert store.verify(deep=True) == []


def test_delta_smaller_than_keyframe_and_compaction(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    w = {"w": torch.randn(300, 300) * 0.05}
    config = QuantConfig(bins=16, prune=0.2, min_numel=100)
    first = compress_state_dict(store, w, config, ref="k")
    w2 = {"w": w["w"] + 1e-4 * torch.randn(300, 300)}
    second = compress_state_dict(store, w2, config, base=first, ref="d")
    assert store.info(second).base == first
    assert store.info(second).nbytes < 0.6 * store.info(first).nbytes
    before = store.open("d").load_section("model")["w"]
    store.compact("d")
    store.delete_ref("k")
    store.gc()
    assert len(store.entries()) == 1 and torch.equal(store.open("d").load_section("model")["w"], before)


def test_no_protected_values_no_protected_blob(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    w = {"w": torch.randn(200, 100) * 0.05}
    entry = compress_state_dict(store, w, QuantConfig(bins=8, prune=0.1, protect=0.0, min_numel=100), ref="k")
    record = store.open(entry).record("model", "w")
    assert set(record["blobs"]) == {"codes"} and record["params"]["protected"] == {"n": 0}
    decoded = store.open("k").load_section("model")["w"]
    assert decoded.shape == w["w"].shape and (decoded - w["w"]).norm() < 0.3 * w["w"].norm()


def test_small_entries_carry_little_header_padding(tmp_path) -> None:
    """The payload's header reservation is an upper bound; a small entry is rewritten rather
    than keep kilobytes of padding (on a 0.4 M-parameter checkpoint it was 8 KB)."""
    store = CheckpointStore(tmp_path)
    state = {f"layer{i}.bias": torch.randn(64) for i in range(150)}
    entry = store.write({"model": state}, ref="small")
    data = (store.path / "entries" / entry / "payload.safetensors").read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    assert header_len - len(data[8 : 8 + header_len].rstrip(b" ")) < 8  # only the 8-byte alignment
    assert torch.equal(store.open("small").load_section("model")["layer7.bias"], state["layer7.bias"])


def test_bare_codec_needs_a_plan() -> None:
    from hf_dynaquant.core.dtypes import to_raw

    with pytest.raises(CodecError, match="plan"):
        DynaQuantCodec().encode(to_raw(torch.randn(10, 10)))
    state = QuantState(
        np.array([2, 3, 0, 1], np.uint8),
        4,
        np.array([-1.0, 1.0], np.float32),
        np.array([0x3F80], np.uint16),
        "F32",
        (2, 2),
    )
    raw = DynaQuantCodec().to_raw(state)
    assert raw.dtype == "F32" and np.frombuffer(raw.bits.tobytes(), np.float32).tolist() == [-1.0, 1.0, 0.0, 1.0]


def test_gradient_ema_formula_and_window() -> None:
    lin = torch.nn.Linear(3, 2, bias=False)
    ema = GradientEMA(lin.named_parameters(), beta=0.9)
    grads = [torch.ones(2, 3), 2 * torch.ones(2, 3), -torch.ones(2, 3)]
    expected = grads[0].reshape(-1)
    for i, g in enumerate(grads):
        lin.weight.grad = g.clone()
        ema.start()
        ema.finish()
        if i:
            expected = 0.9 * g.reshape(-1) + 0.1 * expected
    torch.testing.assert_close(ema.get("weight"), expected)
    torch.testing.assert_close(ema.sensitivity("weight", lin.weight), (expected.view(2, 3) * lin.weight).abs().detach())
    with pytest.warns(UserWarning, match="falls back to magnitude"):
        GradientEMA(lin.named_parameters()).sensitivity("weight", lin.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_ema_device_fold_is_the_host_fold(dtype: torch.dtype) -> None:
    """The fold a CUDA device runs (fused over all gradients; here on CPU tensors, where the same
    torch calls run) gives the host fold's averages bit for bit, float32 whatever the gradients'
    dtype, for averages seeded at different steps; a seed is a copy, never the gradient."""
    torch.manual_seed(0)
    shapes = {"a": (5, 7), "b": (11,), "c": (3, 2)}
    host, here = GradientEMA([], beta=0.9), GradientEMA([], beta=0.9)
    for step in range(4):
        grads = [(n, torch.randn(shape).to(dtype)) for n, shape in shapes.items() if step or n != "c"]  # c: late
        for name, g in grads:
            host._fold(name, g)
        assert here._fold_here(grads)
        for name, g in grads:
            assert here.ema[name].dtype == torch.float32 and here.ema[name].data_ptr() != g.data_ptr()
            assert torch.equal(here.ema[name], host.ema[name]), (step, name)


def test_a_process_that_neither_writes_nor_searches_drops_the_window_average(tmp_path, tiny_net) -> None:
    """A checkpoint taken on a process that does not write it (no search) releases the window's
    gradient average: nothing would read it, and on a GPU it is device memory."""
    from hf_dynaquant.training.manager import CheckpointManager

    comp = Compressor(tiny_net, tmp_path / "s", QuantConfig(bins=4, prune=0.0, min_numel=16))
    manager = CheckpointManager(comp, background=False)
    for p in tiny_net.parameters():
        p.grad = torch.ones_like(p)
    comp.on_backward_pass_end()
    comp.before_gradient_flush()
    assert comp.ema.ema
    pending = manager.take(1, writer=False)
    assert pending.snapshot is None and comp.ema.ema == {}


def test_compressor_listing1_loop(tmp_path, tiny_net) -> None:
    opt = torch.optim.AdamW(tiny_net.parameters(), lr=1e-3)
    comp = Compressor(
        tiny_net,
        tmp_path,
        QuantConfig(bins=12, prune=0.1, prune_by="sensitivity", min_numel=256),
        optimizer=opt,
        checkpoint_every=10,
        ema_steps=3,
        keyframe_every=3,
    )
    recorded = []
    for step in range(1, 31):
        tiny_net(torch.randint(0, 50, (4, 6))).pow(2).mean().backward()
        comp.on_backward_pass_end()
        opt.step()
        comp.before_gradient_flush()
        opt.zero_grad()
        if step % 10 == 0:
            recorded.append(comp.ema.steps)
            comp.compress(step)
    assert recorded == [3, 3, 3]  # only the window before each checkpoint
    assert [comp.store.info(f"step-{s}").base is None for s in (10, 20, 30)] == [True, False, False]
    fresh = type(tiny_net)()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    meta = comp.restore(30, fresh, fresh_opt)
    assert meta["step"] == 30 and meta["quant_config"]["bins"] == 12
    decoded = comp.store.open("step-30").load_section("model")
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, decoded[name])
    assert fresh.out.weight is fresh.emb.weight  # still tied
    assert torch.equal(fresh.steps, tiny_net.steps) and torch.equal(fresh.bf16_buf, tiny_net.bf16_buf)
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def _trained_steps(steps: int):
    """A small MLP with AdamW state, and a function taking one training step on it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(torch.randn(16, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def _bases(store: CheckpointStore, steps) -> list[list[int]]:
    """For each step, the steps of the entries its restore reads, newest first."""
    return [[store.open(e).metadata["step"] for e in store.chain(f"step-{s}")] for s in steps]


def test_restore_depth_codes_anchors_on_the_keyframe_and_restores_the_same(tmp_path) -> None:
    """``restore_depth=2``: a delta that would make a restore replay a third is coded on the
    keyframe instead (an anchor). Every checkpoint restores from its keyframe and at most two
    deltas, to exactly what a chain without anchors restores (the codes are the snapshot's either
    way; only what they are coded against differs), and keyframe_every still counts every entry."""
    model, optimizer, step = _trained_steps(10)
    config = QuantConfig(bins=6, prune=0.1, min_numel=1024)
    anchored = Compressor(model, tmp_path / "a", config, optimizer=optimizer, keyframe_every=8, restore_depth=2)
    plain = Compressor(model, tmp_path / "b", config, optimizer=optimizer, keyframe_every=8)
    for s in range(1, 11):
        step()
        anchored.compress(s)
        plain.compress(s)
    assert _bases(anchored.store, range(1, 11)) == [
        [1], [2, 1], [3, 2, 1], [4, 1], [5, 4, 1], [6, 1], [7, 6, 1], [8, 1], [9], [10, 9]
    ]
    assert [anchored.store.open(f"step-{s}").metadata["chain_position"] for s in range(1, 11)] == [
        0, 1, 2, 3, 4, 5, 6, 7, 0, 1
    ]
    assert len(plain.store.chain("step-8")) == 8
    for s in range(1, 11):
        with anchored.store.open(f"step-{s}") as a, plain.store.open(f"step-{s}") as b:
            for section in ("model", "optimizer"):
                got, want = a.load_section(section), b.load_section(section)
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), (s, section)
    # an anchor is a delta on the keyframe: larger than one on the checkpoint before, smaller than a keyframe
    sizes = {s: anchored.store.info(f"step-{s}").nbytes for s in (1, 4)}
    assert plain.store.info("step-4").nbytes < sizes[4] < sizes[1]
    assert anchored.store.verify(deep=True) == []


def test_restore_depth_goes_on_after_a_resume_from_its_entries(tmp_path) -> None:
    """A run resumed from an entry of an anchored chain (``continue_chain``, as the Trainer's
    callback does) goes on as the run that wrote it would have: the chain's position from the
    entry's metadata (keyframe_every counts on), its depth from its bases, and the keyframe's
    codes read back from the store for the next anchor."""
    model, optimizer, step = _trained_steps(7)
    config = QuantConfig(bins=6, prune=0.1, min_numel=1024)
    first = Compressor(model, tmp_path / "s", config, optimizer=optimizer, keyframe_every=6, restore_depth=2)
    for s in range(1, 5):
        step()
        first.compress(s)
    resumed = Compressor(model, tmp_path / "s", config, optimizer=optimizer, keyframe_every=6, restore_depth=2)
    resumed.continue_chain("step-4")  # an anchor: one delta deep, four entries since the keyframe
    assert resumed._states and resumed._keyframe_states is None  # (the keyframe's read when an anchor needs it)
    for s in range(5, 8):
        step()
        resumed.compress(s)
    assert _bases(resumed.store, range(4, 8)) == [[4, 1], [5, 4, 1], [6, 1], [7]]
    assert resumed.store.verify(deep=True) == []
    resumed.continue_chain("step-5")  # two deltas deep: the next is an anchor, on the keyframe's codes
    assert resumed._next_base() == resumed.store.resolve("step-1") and not resumed._states
    with pytest.raises(InvalidSettingError, match="restore_depth"):
        Compressor(model, tmp_path / "t", config, restore_depth=0)


def test_manager_saves_in_the_background_what_compress_writes(tmp_path, tiny_net) -> None:
    """A loop without a framework: ``CheckpointManager(compressor).save(step)`` returns after the
    snapshot and writes on the background thread; the entries decode to exactly what the same
    steps' foreground ``compress`` wrote, and training after the snapshot does not reach them."""
    from hf_dynaquant import CheckpointManager

    opt = torch.optim.AdamW(tiny_net.parameters(), lr=1e-3)
    config = QuantConfig(bins=12, prune=0.1, min_numel=256)
    fg = Compressor(tiny_net, tmp_path / "foreground", config, optimizer=opt, keyframe_every=2)
    manager = CheckpointManager(Compressor(tiny_net, tmp_path / "background", config, optimizer=opt, keyframe_every=2))
    for step in range(1, 7):
        tiny_net(torch.randint(0, 50, (4, 6))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            fg.compress(step)
            manager.save(step)
    manager.close()
    assert [(r.step, r.keyframe) for r in manager.reports] == [(2, True), (4, False), (6, True)]
    bg = manager.compressor.store
    for step in (2, 4, 6):
        ref = f"step-{step}"
        assert (bg.info(ref).base is None) == (fg.store.info(ref).base is None)
        for section in ("model", "optimizer"):
            for name, t in fg.store.open(ref).load_section(section).items():
                assert torch.equal(bg.open(ref).load_section(section)[name], t), (step, section, name)


def test_compressor_warns_without_gradients_only_when_sensitivity_is_used(tmp_path, tiny_net) -> None:
    with warnings.catch_warnings():  # pruning by magnitude needs no gradients: nothing to warn about
        warnings.simplefilter("error")
        comp = Compressor(tiny_net, tmp_path / "magnitude", QuantConfig(min_numel=256))
        comp.compress(1)
        comp.restore(1)
        searched = Compressor(
            tiny_net,
            tmp_path / "search-magnitude",
            QuantConfig(min_numel=256),
            threshold=1.0,
            metric=lambda m: 1.0,
            search_space=SearchSpace(bins=(4,), prune=(0.0,), protect=(0.005,), prune_by=("magnitude",)),
        )
        searched.compress(1)
    comp = Compressor(tiny_net, tmp_path / "sensitivity", QuantConfig(min_numel=256, prune_by="sensitivity"))
    with pytest.warns(UserWarning, match="fall back to magnitude"):
        comp.compress(1)
    searched = Compressor(
        tiny_net, tmp_path / "search", QuantConfig(min_numel=256), threshold=1.0, metric=lambda m: 1.0
    )
    with pytest.warns(UserWarning, match="no gradients were recorded"):
        searched.compress(1)


def test_tied_weights_planned_once_as_embedding(tmp_path) -> None:
    emb = torch.nn.Embedding(300, 32)
    head = torch.nn.Linear(32, 300, bias=False)
    head.weight = emb.weight
    state = {"head.weight": head.weight, "emb.weight": emb.weight}  # the head comes first
    types = {"head.weight": "Linear", "emb.weight": "Embedding"}
    plan = plan_quantization(state, QuantConfig(prune=0.3, min_numel=1000), types=types)
    assert list(plan.tensors) == ["head.weight"] and plan.tensors["head.weight"].layer_type == "Embedding"
    assert plan.tensors["head.weight"].prune_threshold is None  # tied to an embedding: never pruned
    store = CheckpointStore(tmp_path)
    compress_state_dict(store, state, QuantConfig(prune=0.3, min_numel=1000), types=types, ref="t")
    got = store.open("t").load_section("model")
    assert got["emb.weight"] is got["head.weight"] and int((got["emb.weight"] == 0).sum()) == 0


@pytest.mark.parametrize(
    "bins, prune, width", [(2, 0.1, 2), (12, 0.1, 4), (6, 0.0, 4), (40, 0.1, None)]
)  # (width: the most bits a code; unpruned, the smallest code present is past 0: packed from it)
def test_kept_states_give_the_same_entries_as_decoding_the_base(
    tmp_path, bins: int, prune: float, width: int | None
) -> None:
    """The states kept for the next delta hold their codes packed as tightly as their levels
    allow (none over 16 levels), and the deltas coded on them are the ones coded on the base
    decoded from the store."""
    torch.manual_seed(1)
    ws = [{"w": torch.randn(120, 90) * 0.05}]
    for _ in range(3):
        ws.append({"w": ws[-1]["w"] + 1e-3 * torch.randn(120, 90)})
    config = QuantConfig(bins=bins, prune=prune, min_numel=100)
    ids, bases = {}, set()
    for cached in (False, True):
        store, prev, states = CheckpointStore(tmp_path / str(cached)), None, {}
        out = []
        for w in ws:
            kept: dict = {}
            given = states if cached else None
            prev = compress_state_dict(store, w, config, base=prev, base_states=given, keep_states=kept)
            assert not given  # consumed as the new codes replace them: never both held whole
            states = kept
            out.append(prev)
            decoded = store.open(prev).state("model", "w")
            if width is None:
                assert isinstance(kept["model", "w"], QuantState)
                assert np.array_equal(kept["model", "w"].codes, decoded.codes)
            else:
                # (as the keyframe's stream packed them: from the smallest code present, maybe narrower)
                packed = kept["model", "w"].packed
                assert isinstance(kept["model", "w"], KeptState) and packed.width <= width
                bases.add(packed.base)
                assert packed.data.size == (decoded.codes.size * packed.width + 7) // 8
                assert np.array_equal(kept["model", "w"].unpacked().codes, decoded.codes)
                # a state read back from the store is kept packed by its levels (a resumed chain's)
                assert np.array_equal(DynaQuantCodec().kept(decoded).unpacked().codes, decoded.codes)
        ids[cached] = out
    assert ids[True] == ids[False]  # content-addressed: identical manifests and payloads
    assert sum(store.open(e).record("model", "w")["params"]["mode"] == "delta" for e in ids[True]) >= 1
    assert prune or width is None or bases - {0}  # (unpruned: packed from past 0 at least once)


def test_small_lossless_tensors_are_kept_for_the_next_delta(tmp_path, monkeypatch) -> None:
    """A small tensor stored losslessly (a bias, a norm, their optimizer moments) is kept as a
    copy of its bits for the next delta, which then reads no base state of it back from the
    store (each such read replayed the chain of its XOR deltas); a larger one (past
    ``KEEP_BYTES``) is not kept and is read back. The entries are those coded on the base read
    back from the store, XOR deltas among them."""
    from hf_dynaquant.codecs.lossless import KEEP_BYTES
    from hf_dynaquant.store.store import EntryReader

    torch.manual_seed(2)
    ws = [{"w": torch.randn(120, 90) * 0.05, "b": torch.randn(90), "steps": torch.arange(KEEP_BYTES // 8 + 1)}]
    for _ in range(4):
        w, b, steps = ws[-1]["w"], ws[-1]["b"], ws[-1]["steps"]
        ws.append({"w": w + 1e-3 * torch.randn(120, 90), "b": b * (1 + 1e-6), "steps": steps + 1})
    config = QuantConfig(bins=8, min_numel=100)
    read: list[str] = []
    state = EntryReader.state
    monkeypatch.setattr(EntryReader, "state", lambda self, sec, name: read.append(name) or state(self, sec, name))
    ids = {}
    for cached in (False, True):
        store, prev, states, out = CheckpointStore(tmp_path / str(cached)), None, {}, []
        for w in ws:
            kept: dict = {}
            read.clear()
            given = states if cached else None
            prev = compress_state_dict(store, w, config, base=prev, base_states=given, keep_states=kept)
            assert set(read) == ({"steps"} if cached and out else {"b", "steps", "w"} if out else set())
            b = kept["model", "b"]
            assert isinstance(b, RawTensor) and np.array_equal(b.bits, w["b"].numpy().view(np.uint32))
            assert not np.shares_memory(b.bits, w["b"].numpy())  # (training goes on changing the tensor)
            assert ("model", "steps") not in kept and isinstance(kept["model", "w"], KeptState)
            states = kept
            out.append(prev)
        ids[cached] = out
    assert ids[True] == ids[False]  # content-addressed: identical manifests and payloads
    assert any(store.open(e).record("model", "b")["uses_base"] for e in ids[True])  # (XOR deltas)


@pytest.mark.parametrize("coding", ["ans", "regroup", "rle", "entropy"])
def test_incompressible_code_streams_stay_readable(tmp_path, coding: str) -> None:
    """Streams zstd cannot shrink are stored raw; the coding must be recorded and honoured."""
    store = CheckpointStore(tmp_path)
    w = torch.rand(64, 64)
    config = QuantConfig(bins=254, prune=0.0, protect=0.0, min_numel=1)
    first = compress_state_dict(store, {"w": w}, config, ref="k", delta_coding=coding)
    assert store.open("k").record("model", "w")["params"]["codes_stream"] == "raw"
    rng = np.random.default_rng(0)
    for seed in range(20):  # small tensors with noisy deltas: some delta streams do not compress
        small = torch.from_numpy(rng.normal(0, 1, (16, 9)).astype(np.float32))
        cfg = QuantConfig(bins=int(rng.integers(4, 33)), prune=0.2, min_numel=16)
        base = compress_state_dict(store, {"s": small}, cfg, ref=f"b{seed}", delta_coding=coding)
        compress_state_dict(
            store, {"s": small + 0.05 * torch.randn(16, 9)}, cfg, base=base, ref=f"d{seed}", delta_coding=coding
        )
        store.open(f"d{seed}").load_section("model")
    assert store.verify(deep=True) == [] and first


def test_zero_sensitivity_is_pruned() -> None:
    w = torch.randn(100, 100)
    sens = torch.rand(100, 100)
    sens[:, :40] = 0  # dead units: 40% of the sensitivities are exactly zero
    plan = plan_quantization(
        {"w": w}, QuantConfig(prune=0.3, prune_by="sensitivity", min_numel=100), sensitivity={"w": sens}
    )
    codes, _ = quantize(w, plan.tensors["w"])
    assert np.all(codes.reshape(100, 100)[:, :40][~(codes.reshape(100, 100)[:, :40] == PROTECTED)] == PRUNED)


def _bf16_mlp_with_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small bf16 MLP and its AdamW after three steps (both moments in bf16)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_compressor_keeps_the_codes_packed_between_checkpoints(tmp_path) -> None:
    """Between two saves a compressor holds each quantized tensor's codes packed (weights,
    Adam's update and scale alike); what reads them (the next delta, the search's base codes,
    a "previous" residual's reference) gets them a byte a code, as stored."""
    model, opt = _bf16_mlp_with_adam()
    comp = Compressor(model, tmp_path, QuantConfig(bins=8, min_numel=256, residual="previous"), optimizer=opt)
    comp.compress(1)
    packed = {key for key, st in comp._states.items() if isinstance(st, KeptState)}
    assert {section for section, _ in packed} == {"model", "optimizer"}
    # (a bfloat16 v's scale spans over 16 levels: its codes stay a byte each; the biases and
    # their moments, stored losslessly, are kept as copies of their bits)
    lossless = {key for key, st in comp._states.items() if isinstance(st, RawTensor)}
    assert {name for sec, name in lossless if sec == "model"} == {"0.bias", "2.bias"}
    assert all(name.startswith("/state/") for sec, name in lossless if sec == "optimizer")
    assert all(st.levels > 16 for key, st in comp._states.items() if key not in packed | lossless)
    base_codes = comp._base_codes()
    with comp.store.open("step-1") as entry:
        for name in base_codes:
            assert np.array_equal(base_codes[name], entry.state("model", name).codes)
            previous = comp._previous_values({name: model.state_dict()[name]})[name]
            assert torch.equal(previous, entry.tensor("model", name).float())
    model(torch.randn(16, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    comp.compress(2)
    with comp.store.open("step-2") as entry:
        modes = [entry.record(s, n)["params"].get("mode") for s in entry.sections for n in entry.names(s)]
        assert "delta" in modes
    with comp.store.open("step-2") as entry:  # what is kept now is what the store decodes, both sections
        assert {sec for sec, _ in comp._states} == {"model", "optimizer"}
        for (sec, name), kept in comp._states.items():
            if isinstance(kept, RawTensor):
                assert np.array_equal(kept.bits, entry.state(sec, name).bits), (sec, name)
                continue
            codes = kept.unpacked().codes if isinstance(kept, KeptState) else kept.codes
            assert np.array_equal(codes, entry.state(sec, name).codes), (sec, name)
    restored, restored_opt = _bf16_mlp_with_adam()
    comp.restore(2, restored, restored_opt)
    with comp.store.open("step-2") as entry:
        for name, value in restored.state_dict().items():
            assert torch.equal(value, entry.tensor("model", name).to(value.dtype))


def test_a_resumed_state_with_codes_past_its_levels_is_corrupt() -> None:
    """A resumed chain keeps the stored states packed by their levels: codes past them (only a
    damaged record holds such) are refused by name, not packed wrong."""
    from hf_dynaquant.training.compressor import _kept

    def state(codes: list[int]) -> QuantState:
        centres = np.array([-1.0, 1.0], np.float32)
        return QuantState(np.array(codes, np.uint8), 4, centres, np.zeros(0, np.uint16), "F32", (len(codes),))

    assert np.array_equal(_kept(state([0, 3, 2, 1]), "here").unpacked().codes, [0, 3, 2, 1])
    with pytest.raises(CorruptCheckpointError, match="model/w: codes past the tensor's 4 levels"):
        _kept(state([0, 3, 9, 1]), "model/w")


def test_optimizer_state_decodes_from_a_stream_in_any_order(tmp_path) -> None:
    """A restore decodes the optimizer state parameter by parameter as the section's tensors
    arrive: the same state whatever the order they come in, a tensor that never comes is fetched
    (and one that does not exist raises, naming it)."""
    import random

    from hf_dynaquant.errors import EntryNotFoundError
    from hf_dynaquant.training.compressor import OPTIMIZER, read_optimizer_state
    from hf_dynaquant.training.optimizer_state import TensorKey, decode_optimizer_state

    model, opt = _bf16_mlp_with_adam()
    comp = Compressor(model, tmp_path, QuantConfig(min_numel=256), optimizer=opt)
    comp.compress(1)
    with comp.store.open("step-1") as entry:
        reference = read_optimizer_state(entry, "test")
        fetched = []
        fetch = lambda key: fetched.append(key) or entry.tensor(OPTIMIZER, key)  # noqa: E731
        items = list(entry.iter_section(OPTIMIZER))
        half = items[: len(items) // 2]
        for order in (items[::-1], random.Random(0).sample(items, len(items)), half):
            fetched.clear()
            tree = entry.tree(OPTIMIZER, leaf=TensorKey)
            arriving = ((key, t.clone()) for key, t in order)  # the decoder converts them in place
            state = decode_optimizer_state(tree, arriving, fetch, where="test")
            assert list(state["state"]) == list(reference["state"])
            for pid, values in reference["state"].items():
                for key, value in values.items():
                    assert torch.equal(state["state"][pid][key], value), (pid, key)
            assert state["param_groups"] == reference["param_groups"]
            # only what never arrived is decoded again
            assert sorted(fetched) == sorted({k for k, _ in items} - {k for k, _ in order})
        with pytest.raises(EntryNotFoundError, match="no tensor"):
            decode_optimizer_state(entry.tree(OPTIMIZER, leaf=TensorKey), iter(()), lambda k: fetch(k + "x"))
    assert reference["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert set(reference["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bf16_sgd_momentum_is_made_in_parts_and_stored_as_made_whole(tmp_path, monkeypatch) -> None:
    """A bfloat16 SGD momentum's float32 form is filled a part at a time (a float32 one is read
    as it is): the stored entry is the one written with it made whole."""
    from hf_dynaquant.store.tree import DeferredTensor
    from hf_dynaquant.training import optimizer_state

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model(torch.randn(16, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    encoded = optimizer_state.encode_optimizer_state(opt.state_dict())
    assert encoded is not None
    leaf = encoded.tree["state"][0]["dq_momentum"]
    assert isinstance(leaf, DeferredTensor) and leaf.fill is not None
    parts = np.empty(leaf.numel(), dtype=np.float32)
    leaf.fill(0, leaf.numel(), parts)
    assert np.array_equal(parts, leaf.make().reshape(-1).numpy())
    wide = {"state": {0: {"momentum_buffer": opt.state_dict()["state"][0]["momentum_buffer"].float()}}}
    wide["param_groups"] = opt.state_dict()["param_groups"]
    assert optimizer_state._Moment(optimizer_state.SGD, wide["state"][0], None).target_parts() is None
    ids = []
    for name in ("parts", "whole"):
        if name == "whole":
            monkeypatch.setattr(optimizer_state, "bf16_parts", lambda t: None)
        ids.append(Compressor(model, tmp_path / name, QuantConfig(min_numel=256), optimizer=opt).compress(1))
    assert ids[0] == ids[1]


def test_restored_momentum_keeps_the_original_norm_and_step_size(tmp_path) -> None:
    """The quantizer's centres (about the means of their bins) change a momentum's length (Adam's
    update, SGD's buffer); the stored norm gain gives the restored one the original's L2 norm,
    its direction within the checked cosine. Adam's scale rounded on its log grid makes steps
    longer on average; the stored scale gain makes their mean the original's."""
    from hf_dynaquant.core.moments import fidelity
    from hf_dynaquant.training.optimizer_state import MomentQuant

    def updates(state: dict) -> dict:
        out = {}
        for pid, entry in state["state"].items():
            if "exp_avg" in entry:
                out[pid] = entry["exp_avg"].float() / (entry["exp_avg_sq"].float().sqrt() + 1e-8)
            else:
                out[pid] = entry["momentum_buffer"].float()
        return out

    adam_model, adam = _bf16_mlp_with_adam()
    torch.manual_seed(1)
    sgd_model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        sgd_model(torch.randn(16, 64)).pow(2).mean().backward()
        sgd.step()
        sgd.zero_grad()
    for name, (model, opt, fresh) in {
        "adam": (adam_model, adam, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
        "sgd": (sgd_model, sgd, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
    }.items():
        # the 1-nat grid for the bf16 moments too, whose rounding bias is large enough to see
        coarse = MomentQuant(bf16_scale_step=1.0)
        comp = Compressor(model, tmp_path / name, QuantConfig(min_numel=256), optimizer=opt, moment_quant=coarse)
        comp.compress(1)
        with comp.store.open("step-1") as entry:
            stored = {pid: e for pid, e in entry.tree("optimizer")["state"].items() if "dq_gain" in e}
        gains = [e["dq_gain"] for e in stored.values()]
        assert len(gains) == 3 and max(abs(g - 1) for g in gains) > 0.01, (name, gains)  # a gain to test
        into = fresh(model)
        comp.restore(1, optimizer=into)
        live, back = updates(opt.state_dict()), updates(into.state_dict())
        for pid in stored:
            cos, _ = fidelity(live[pid], back[pid])
            assert cos >= MomentQuant().min_cosine, (name, pid)
            assert float(back[pid].norm()) == pytest.approx(float(live[pid].norm()), rel=1e-2), (name, pid)
            if name == "adam":  # the mean step-size factor a restore leaves is 1, not the grid's ~1.04
                scale_gain = stored[pid]["dq_scale_gain"]
                assert 1.01 < scale_gain < 1.08, pid
                denominator = lambda state: state["state"][pid]["exp_avg_sq"].float().sqrt() + 1e-8  # noqa: E731
                factor = denominator(opt.state_dict()) / denominator(into.state_dict())
                assert float(factor.mean()) == pytest.approx(1.0, abs=0.01), pid


def test_scale_gain_is_the_mean_shortfall_on_the_grid_in_use() -> None:
    """The scale gain of values spread evenly over many bins is ``sinh(h/2)/(h/2)``; its sums add
    over any split; a grid widened for a scale that spans too many steps gets the widened
    grid's gain."""
    import math

    from hf_dynaquant.core.moments import MAX_SCALE_LEVELS, adam_scale, grid_step, scale_gain, scale_gain_sums
    from hf_dynaquant.training.optimizer_state import MomentQuant, encode_optimizer_state

    eps = 1e-8
    s = math.log(eps) + torch.linspace(0, 40, 400_001)
    for h in (1.0, 0.5):
        assert scale_gain(scale_gain_sums(s, eps, h)) == pytest.approx(math.sinh(h / 2) / (h / 2), abs=1e-3)
    halves = scale_gain_sums(s[:1234], eps, 1.0) + scale_gain_sums(s[1234:], eps, 1.0)
    assert np.allclose(halves, scale_gain_sums(s, eps, 1.0), rtol=1e-12)
    assert scale_gain(np.zeros(2)) == 1.0
    assert grid_step(math.log(eps) + 40, eps, 1.0) == 1.0
    assert grid_step(math.log(eps) + 40, eps, 0.01) == pytest.approx(40 / (MAX_SCALE_LEVELS - 1))

    _, opt = _bf16_mlp_with_adam()
    state = opt.state_dict()
    encoded = encode_optimizer_state(state, settings=MomentQuant(scale_step=0.01, bf16_scale_step=0.01))
    assert encoded is not None
    scale = adam_scale(state["state"][0]["exp_avg_sq"], eps)
    widened = grid_step(float(scale.max()), eps, 0.01)
    assert widened > 0.01
    expected = scale_gain(scale_gain_sums(scale, eps, widened))
    assert encoded.tree["state"][0]["dq_scale_gain"] == pytest.approx(expected, rel=1e-12)
    assert expected != pytest.approx(scale_gain(scale_gain_sums(scale, eps, 0.01)), rel=1e-6)


def test_bf16_second_moments_take_the_finer_scale_grid() -> None:
    """A bf16 ``v`` hardly decays (bf16 cannot hold 0.1% steps), so its scale grid is
    ``bf16_scale_step``; a float32 one keeps ``scale_step``."""
    from hf_dynaquant.training.optimizer_state import MomentQuant, encode_optimizer_state

    settings = MomentQuant()
    assert settings.scale_step_for(torch.bfloat16) == 0.25 and settings.scale_step_for(torch.float32) == 1.0
    with pytest.raises(ValueError, match="scale steps must be positive"):
        MomentQuant(bf16_scale_step=0.0)
    _, opt = _bf16_mlp_with_adam()
    bf16_state = opt.state_dict()
    fp32_state = {
        "state": {pid: {k: v.float() if k != "step" else v for k, v in e.items()} for pid, e in bf16_state["state"].items()},
        "param_groups": bf16_state["param_groups"],
    }
    for state, step in ((bf16_state, 0.25), (fp32_state, 1.0)):
        encoded = encode_optimizer_state(state, settings=settings)
        assert encoded is not None
        grids = [tp.centres for tp in encoded.plans.values() if tp.layer_type == "moment_scale"]
        assert grids and all(np.allclose(np.diff(c), step, rtol=1e-5) for c in grids if c.size > 1)


def test_an_update_takes_the_first_bin_count_of_the_ladder_that_passes() -> None:
    """Bin counts are tried in order and the first whose fidelity passes is kept: a heavy-tailed
    update (Student's t, 5 degrees of freedom) fails at 4 bins and passes at 5, so the default
    ladder stores it at 5, the ladder without that rung at 6, and a ladder that stops at 4
    losslessly."""
    from hf_dynaquant.core.moments import adam_update, fidelity
    from hf_dynaquant.core.quantizer import decoded_values, quantize
    from hf_dynaquant.training.optimizer_state import MomentQuant, encode_optimizer_state

    torch.manual_seed(0)
    m = torch.distributions.StudentT(torch.tensor(5.0)).sample((65536,))
    state = {
        "state": {0: {"step": torch.tensor(10.0), "exp_avg": m, "exp_avg_sq": torch.ones(65536)}},
        "param_groups": [{"params": [0], "eps": 1e-8, "lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}],
    }
    settings = MomentQuant()
    assert 5 in settings.bins
    encoded = encode_optimizer_state(state, settings=settings)
    assert encoded is not None and encoded.report["bins"] == {"0": 5} and not encoded.report["lossless"]
    update = adam_update(m, torch.ones(65536), 1e-8)
    plan = next(tp for tp in encoded.plans.values() if tp.layer_type == "moment")
    codes, kept = quantize(update.reshape(-1, 1), plan)
    cos, rel = fidelity(update, torch.from_numpy(decoded_values(codes, plan.centres, kept)))
    assert cos >= settings.min_cosine and rel <= settings.max_rel_error
    without_five = encode_optimizer_state(state, settings=MomentQuant(bins=(2, 3, 4, 6, 8, 16, 32)))
    assert without_five is not None and without_five.report["bins"] == {"0": 6}
    coarse = encode_optimizer_state(state, settings=MomentQuant(bins=(2, 3, 4)))
    assert coarse is not None and coarse.report["bins"] == {} and coarse.report["lossless"] == [0]


def test_moment_gains_are_checked_when_decoded() -> None:
    """An entry without gains (written before they existed) decodes with none; a gain that is not
    a positive finite number is refused, naming the parameter."""
    from hf_dynaquant.errors import FormatError
    from hf_dynaquant.training.optimizer_state import TensorKey, decode_optimizer_state

    u, s = torch.tensor([0.5, -1.0, 0.25]), torch.tensor([-2.0, -1.0, 0.0])

    def decoded(**gains: object) -> dict:
        entry = {"dq_moments": "adam-v1", "dq_dtype": "torch.float32", "step": 3.0}
        entry |= {"dq_update": TensorKey("u"), "dq_scale": TensorKey("s"), **gains}
        tree = {"state": {0: entry}, "param_groups": [{"params": [0], "eps": 1e-8}]}
        tensors = iter([("u", u.clone()), ("s", s.clone())])
        return decode_optimizer_state(tree, tensors, lambda key: None, where="step 7")["state"][0]

    assert torch.allclose(decoded()["exp_avg"], u * s.exp())
    assert torch.allclose(decoded()["exp_avg_sq"], (s.exp() - 1e-8) ** 2)
    both = decoded(dq_gain=2.0, dq_scale_gain=1.5)
    assert torch.allclose(both["exp_avg"], 2 * u * ((s.exp() - 1e-8) * 1.5 + 1e-8))
    assert torch.allclose(both["exp_avg_sq"], ((s.exp() - 1e-8) * 1.5) ** 2)
    for key, name in (("dq_gain", "moment norm gain"), ("dq_scale_gain", "scale gain")):
        for bad in (-1.0, 0.0, float("nan"), float("inf"), "2", True, None):
            with pytest.raises(FormatError, match=f"step 7: parameter 0 has a {name}"):
                decoded(**{key: bad})


def test_a_restore_holds_only_a_few_parameters_moments_waiting_for_the_rest(tmp_path, monkeypatch) -> None:
    """A restore converts a parameter's moments once all of its stored tensors are in; the tensors
    decoded first (the large ones) keep a parameter's tensors together, so what waits stays a
    few parameters' worth however many parameters there are (decoding every large update and
    scale first held the whole optimizer's until the small step tensors came)."""
    from hf_dynaquant.store import store as store_mod
    from hf_dynaquant.training import compressor as compressor_mod

    monkeypatch.setattr(store_mod, "VALUES_IN_FLIGHT", 100_000)  # each 256 x 256 update and scale is large
    torch.manual_seed(0)
    layers = 12
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    Compressor(model, tmp_path, QuantConfig(bins=8), optimizer=optimizer).compress(1)

    peak, as_codes, real = [0], [0], compressor_mod.decode_optimizer_state

    def watched(tree, tensors, fetch, **kwargs):
        def arriving():
            waiting: dict[str, int] = {}
            for key, tensor in tensors:
                node = key.rpartition("/")[0]
                as_codes[0] += isinstance(tensor, QuantState)  # (the moments are made from the codes)
                waiting[key] = tensor.codes.size if isinstance(tensor, QuantState) else tensor.numel()
                peak[0] = max(peak[0], sum(waiting.values()))
                yield key, tensor
                done = [k for k in waiting if k.rpartition("/")[0] == node]
                if len(done) == 3:  # step, update, scale: the parameter is converted
                    for k in done:
                        del waiting[k]

        return real(tree, arriving(), fetch, **kwargs)

    monkeypatch.setattr(compressor_mod, "decode_optimizer_state", watched)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    Compressor(fresh, tmp_path, optimizer=fresh_optimizer).restore(1)
    weights = 2 * 256 * 256  # one weight's update and scale
    assert 0 < peak[0] <= 4 * weights < layers * weights
    assert as_codes[0] == 2 * 2 * layers  # the update and scale of every weight and bias


class _TiedNet(torch.nn.Module):
    """An embedding tied to its output layer, a quantized linear layer and a bias (stored losslessly)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 64)
        self.body = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.emb.weight


def test_a_restore_dequantizes_weights_straight_into_the_parameters(tmp_path, monkeypatch) -> None:
    """A quantized float32 weight is dequantized into the model's own parameter (the same object,
    no decoded copy, and never through load_state_dict), a tied one once; what the store decodes
    is what the parameters hold. A module with a load hook, a custom ``_load_from_state_dict``
    or a bf16 parameter goes through ``load_state_dict`` as before; codes that do not decode are
    refused naming the tensor."""
    import dataclasses

    from hf_dynaquant.codecs import dynaquant as dynaquant_mod
    from hf_dynaquant.training.compressor import _filled_in_place

    torch.manual_seed(0)
    model = _TiedNet()
    Compressor(model, tmp_path, QuantConfig(bins=8, min_numel=1000)).compress(1)
    with CheckpointStore(tmp_path).open("step-1") as entry:
        want = entry.load_section("model")
    restored = _TiedNet()
    params = {name: p for name, p in restored.named_parameters()}
    calls, writes, real_load = [], [], torch.nn.Module.load_state_dict

    def watched(self, state_dict, *args, **kwargs):
        calls.append(sorted(state_dict))
        return real_load(self, state_dict, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", watched)
    from hf_dynaquant.training import compressor as compressor_mod

    real_into = compressor_mod.decoded_values
    monkeypatch.setattr(
        compressor_mod, "decoded_values", lambda *a, **k: writes.append(k["out"].size) or real_into(*a, **k)
    )
    Compressor(restored, tmp_path).restore(1)
    assert all(p is params[name] for name, p in restored.named_parameters())  # the same parameter objects
    assert restored.head.weight is restored.emb.weight
    for name, tensor in restored.state_dict().items():
        assert torch.equal(tensor, want.get(name, want["emb.weight"])), name
    assert sorted(writes) == [64 * 64, 300 * 64]  # the tied weight written once
    assert all(name.endswith("bias") for names in calls for name in names)  # only the lossless bias copied

    # what plain load_state_dict would not merely copy into is loaded by it
    hooked = _TiedNet()
    hooked.body.register_load_state_dict_post_hook(lambda module, keys: None)
    assert not _filled_in_place(hooked, "body.weight", hooked.body.weight)
    assert _filled_in_place(hooked, "emb.weight", hooked.emb.weight)
    hooked.to(torch.bfloat16)
    assert not _filled_in_place(hooked, "emb.weight", hooked.emb.weight)
    hooked.float()

    class CustomLinear(torch.nn.Linear):
        def _load_from_state_dict(self, *args) -> None:
            super()._load_from_state_dict(*args)

    class CustomParent(_TiedNet):  # (a parent's override sees its children's entries too)
        def _load_from_state_dict(self, *args) -> None:
            super()._load_from_state_dict(*args)

    custom = _TiedNet()
    custom.body.__class__ = CustomLinear
    assert not _filled_in_place(custom, "body.weight", custom.body.weight)
    parented = CustomParent()
    assert not any(_filled_in_place(parented, n, t) for n, t in parented.state_dict(keep_vars=True).items())
    own = _TiedNet()
    own.load_state_dict = lambda *a, **k: torch.nn.Module.load_state_dict(own, *a, **k)  # (on the instance)
    assert not _filled_in_place(own, "emb.weight", own.emb.weight)
    with torch.inference_mode():
        inference = _TiedNet()
    assert not _filled_in_place(inference, "emb.weight", inference.emb.weight)
    for other, written in ((hooked, [300 * 64]), (custom, [300 * 64]), (parented, [])):
        calls.clear()
        writes.clear()
        Compressor(other, tmp_path).restore(1)
        assert sorted(writes) == written and any("body.weight" in c for c in calls)
        for name, tensor in other.state_dict().items():
            assert torch.equal(tensor, want.get(name, want["emb.weight"])), name
    in_bf16 = _TiedNet().to(torch.bfloat16)
    writes.clear()
    Compressor(in_bf16, tmp_path).restore(1)
    assert writes == []  # (decoded, then rounded to bf16 by load_state_dict)
    for name, tensor in in_bf16.state_dict().items():
        assert torch.equal(tensor, want.get(name, want["emb.weight"]).to(torch.bfloat16)), name
    version = restored.body.weight._version
    Compressor(restored, tmp_path).restore(1)
    assert restored.body.weight._version > version  # (written in place, marked as copy_ marks it)

    # codes beyond their centres: refused, naming the tensor
    real_coded = dynaquant_mod.DynaQuantCodec.coded

    def broken(self, state):
        codes = real_coded(self, state)
        if codes is not None and codes.shape == (64, 64):
            codes = dataclasses.replace(codes, codes=np.full_like(codes.codes, 250))
        return codes

    monkeypatch.setattr(dynaquant_mod.DynaQuantCodec, "coded", broken)
    with pytest.raises(CorruptCheckpointError, match="tensor 'body.weight': a code lies beyond the stored centres"):
        Compressor(_TiedNet(), tmp_path).restore(1)


def test_a_restore_hands_freed_memory_back_while_it_converts_the_moments(tmp_path, monkeypatch) -> None:
    """The decoding threads' freed temporaries go back to the system every so many moment values
    converted (glibc's malloc_trim; they stayed in the threads' arenas, 0.2x of a bf16 checkpoint)."""
    from hf_dynaquant.core import memory
    from hf_dynaquant.training import optimizer_state

    if memory._TRIM is None:
        pytest.skip("this C library has no malloc_trim")
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    Compressor(model, tmp_path, QuantConfig(bins=8, min_numel=1000), optimizer=optimizer).compress(1)
    trims = []
    monkeypatch.setattr(memory, "_TRIM", lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(optimizer_state, "_RESTORE_TRIM_EVERY", 64 * 64)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    Compressor(fresh, tmp_path, optimizer=fresh_optimizer).restore(1)
    assert len(trims) >= 4 and set(trims) == {0}  # (each weight's m and v: 2 x 64 x 64 values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_save_hands_freed_memory_back_only_past_its_allowance(tmp_path, monkeypatch, dtype) -> None:
    """A save's optimizer-state decisions and its write trim only once the resident set has
    grown past its allowance since the save began (freed pages kept are reused without a
    fault): SAVE_ALLOWANCE of a float32 checkpoint, a quarter of a bfloat16 one (its float32
    temporaries are twice its own share); past it, every count that comes due trims, as before."""
    import itertools

    from hf_dynaquant.core import memory
    from hf_dynaquant.training.snapshot import raw_optimizer_size, unique_size

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, dtype=dtype)).sum().backward()
    optimizer.step()
    (state_raw, state_values), (optimizer_raw, optimizer_values) = (
        unique_size(model.state_dict().values()),
        raw_optimizer_size(optimizer.state_dict()),
    )
    checkpoint, values = state_raw + optimizer_raw, state_values + optimizer_values
    allowance = memory.save_allowance(checkpoint, values)
    share = 1.0 if dtype == torch.float32 else 0.5  # (Adam's float32 step counts are a few bytes more)
    assert allowance == pytest.approx(memory.SAVE_ALLOWANCE * checkpoint * share, rel=1e-3)
    trims: list[int] = []
    monkeypatch.setattr(memory, "_TRIM", lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(memory, "TRIM_EVERY", 64 * 64)

    def saved_with_growth(extra: int) -> int:
        """Trims in one save whose resident set grows by ``extra`` bytes after its start."""
        calls = itertools.count()
        monkeypatch.setattr(memory, "resident_bytes", lambda: 1 << 30 if next(calls) == 0 else (1 << 30) + extra)
        trims.clear()
        store = tmp_path / f"grown-{extra}"
        Compressor(model, store, QuantConfig(bins=8, min_numel=1000), optimizer=optimizer).compress(1)
        return len(trims)

    within, past = saved_with_growth(allowance), saved_with_growth(allowance + 1)
    assert within <= 2  # (the hand-back at the save's end)
    assert past >= within + 4  # (the decisions' and the write's counts: several of 64 x 64 values each)


def test_optimizer_moments_are_decided_a_group_at_a_time_and_made_when_stored(tmp_path, monkeypatch) -> None:
    """A save never holds the whole optimizer's float32 update and scale: the fidelity decisions
    take a group of parameters at a time (here one each: the same plans and report as all at
    once), and the encoded tree holds deferred leaves, made only when the store encodes them
    (the scale's codes made from v itself)."""
    from hf_dynaquant.core.moments import adam_scale, adam_update
    from hf_dynaquant.store.tree import DeferredTensor
    from hf_dynaquant.training import optimizer_state

    model, opt = _bf16_mlp_with_adam()
    state = opt.state_dict()
    together = optimizer_state.encode_optimizer_state(state)
    monkeypatch.setattr(optimizer_state, "VALUES_IN_FLIGHT", 1)  # every parameter a group of its own
    apart = optimizer_state.encode_optimizer_state(state)
    assert together is not None and apart is not None
    assert apart.report == together.report and apart.report["quantized"] == 3  # (the 8-value bias is too small)
    assert apart.plans.keys() == together.plans.keys()
    for key, tp in apart.plans.items():
        assert np.array_equal(tp.centres, together.plans[key].centres), key
    entry = apart.tree["state"][0]
    update, scale = entry["dq_update"], entry["dq_scale"]
    assert isinstance(update, DeferredTensor) and isinstance(scale, DeferredTensor)
    m, v = state["state"][0]["exp_avg"], state["state"][0]["exp_avg_sq"]
    assert update.shape == tuple(m.shape) and update.numel() == m.numel()
    assert torch.equal(update.make(), adam_update(m, v, 1e-8).reshape(m.shape))
    # both are also made a part at a time, as the codec quantizes them (a float32 v is read as it is)
    for leaf in (update, scale):
        assert leaf.fill is not None
        parts = np.empty(m.numel(), dtype=np.float32)
        leaf.fill(0, m.numel(), parts)
        assert np.array_equal(parts, leaf.make().reshape(-1).numpy())
    assert optimizer_state._Moment(optimizer_state.ADAM, {"exp_avg": m.float(), "exp_avg_sq": v.float()}, 1e-8).scale_parts() is None
    # the scale's leaf is made as v in float32, which its plan partitions into the scale's codes
    assert torch.equal(scale.make(), v.float())
    scale_plan = apart.plans["/state/0/dq_scale"]
    made, _ = quantize(scale.make(), scale_plan)
    assert np.array_equal(made, quantize(adam_scale(v, 1e-8), replace(scale_plan, thresholds=None))[0])
    # and a checkpoint written with groups of one restores the same state as one written at once
    restored = {}
    for name, budget in (("apart", 1), ("together", 1 << 25)):
        monkeypatch.setattr(optimizer_state, "VALUES_IN_FLIGHT", budget)
        comp = Compressor(model, tmp_path / name, QuantConfig(min_numel=256), optimizer=opt)
        comp.compress(1)
        into = torch.optim.AdamW(model.parameters(), lr=1e-3)
        comp.restore(1, optimizer=into)
        restored[name] = into.state_dict()["state"]
    for pid, values in restored["together"].items():
        for key, value in values.items():
            assert torch.equal(restored["apart"][pid][key], value), (pid, key)


def test_pair_counts_is_joint_bincount(monkeypatch) -> None:
    from hf_dynaquant.core import histogram as histogram_mod

    rng = np.random.default_rng(8)
    keys, values = (rng.integers(0, 256, 100_003).astype(np.uint8) for _ in range(2))
    expected = np.bincount(keys.astype(np.int64) * 256 + values, minlength=65536).reshape(256, 256)
    assert histogram_mod.native is not None, "the compiled kernels were not built"
    assert np.array_equal(histogram_mod.pair_counts(keys, values), expected)
    monkeypatch.setattr(histogram_mod, "native", None)
    assert np.array_equal(histogram_mod.pair_counts(keys, values), expected)
    with pytest.raises(ValueError, match="keys for"):
        histogram_mod.pair_counts(keys[1:], values)


def _codes_state(codes: np.ndarray) -> QuantState:
    return QuantState(codes, 6, np.linspace(-1, 1, 4).astype(np.float32), np.zeros(0, np.uint16), "F32", codes.shape)


def test_delta_size_is_known_before_coding_it(monkeypatch) -> None:
    """The regrouped delta's and the keyframe's rANS sizes are known from their histograms to a
    few bytes; a delta estimated no smaller than the keyframe as coded is never coded."""
    from hf_dynaquant.codecs import dynaquant as dynaquant_mod
    from hf_dynaquant.core.ans import ans_encode
    from hf_dynaquant.core.entropy import ans_bytes
    from hf_dynaquant.core.histogram import byte_counts, pair_counts

    rng = np.random.default_rng(9)
    prev = rng.integers(2, 6, 400_000).astype(np.uint8)
    moved = rng.random(prev.size) < 0.05
    close = np.where(moved, rng.integers(2, 6, prev.size), prev).astype(np.uint8)  # a slow-moving tensor
    delta = cyclic_delta(prev, close, 6)
    for stream, groups, counts in [
        (regroup(delta, prev), byte_counts(prev), pair_counts(prev, delta)),
        (close, None, byte_counts(close)),
    ]:
        coded, estimate = len(ans_encode(stream, groups)), ans_bytes(counts)
        assert abs(coded - estimate) <= 0.001 * estimate + 16
    codec = DynaQuantCodec()
    assert codec._encode_state(_codes_state(close), _codes_state(prev), {}).params["mode"] == "delta"
    unrelated = rng.integers(2, 6, prev.size).astype(np.uint8)  # its delta's tables make it the larger

    def refuse(*args: object) -> None:
        raise AssertionError("the losing delta was coded")

    monkeypatch.setattr(dynaquant_mod, "_delta_payload", refuse)
    assert codec._encode_state(_codes_state(unrelated), _codes_state(prev), {}).params["mode"] == "keyframe"


def test_the_blobs_a_tensor_may_take_are_counted_from_its_plan() -> None:
    """The payload header is reserved for the blobs each tensor may take: the codes (or delta;
    an Adam scale's factored keyframe keeps its terms in blob codes too), the rare rows' flags
    where the plan has rare rows, and the protected values' chunks only where the plan may
    protect (an optimizer moment's never does). Each bound holds."""
    from hf_dynaquant.codecs.lossless import LosslessCodec
    from hf_dynaquant.core.dtypes import to_raw
    from hf_dynaquant.core.moments import adam_scale, scale_plan

    torch.manual_seed(0)
    w = torch.randn(3000, 1000)
    n = w.numel()
    for protect, expect in ((0.01, 1 + LosslessCodec().max_blobs(n)), (0.0, 1)):
        plan = plan_quantization({"w": w}, QuantConfig(bins=8, prune=0.1, protect=protect, min_numel=1)).tensors["w"]
        codec = DynaQuantCodec(plan)
        assert codec.max_blobs(n) == expect
        assert len(codec.encode(to_raw(w)).blobs) == (2 if protect else 1) <= expect
    v = torch.rand(n) * 1e-4
    codec = DynaQuantCodec(scale_plan(float(adam_scale(v, 1e-8).max()), 1e-8, 1.0))
    assert codec.max_blobs(n) == 1 and len(codec.encode(to_raw(v)).blobs) == 1
    rows, cols = torch.rand(3000, 1) * 1e-4, torch.rand(1, 1000) * 1e-4  # v close to a product
    factored = codec.encode(to_raw(rows * cols * (1 + 0.1 * torch.rand(3000, 1000))))
    assert factored.params["codes_stream"] == "ans-factored" and list(factored.blobs) == ["codes"]
    rare = replace(plan, rare_rows=np.zeros(3000, np.uint8))
    assert DynaQuantCodec(rare).max_blobs(n) == 2  # (the rows' flags)
    assert DynaQuantCodec().max_blobs(n) == 2 + LosslessCodec().max_blobs(n)  # (no plan: every blob it could)
