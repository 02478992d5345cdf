"""Stochastic rounding (hf_dynaquant.core.rounding) and its use after a restore."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dynaquant.core.kernels import native
from hf_dynaquant.core.quantizer import FIRST_CENTRE, PRUNED, QuantConfig, dequantize, plan_quantization, quantize
from hf_dynaquant.core.rounding import seeded_stochastic_codes, stochastic_codes, uniform
from hf_dynaquant.training.compressor import Compressor

CENTRES = np.array([-0.3, -0.1, 0.1, 0.3], dtype=np.float32)


def nearest_codes(w: np.ndarray) -> np.ndarray:
    mids = (CENTRES[1:] + CENTRES[:-1]) / 2
    return (np.searchsorted(mids, w) + FIRST_CENTRE).astype(np.uint8)


def test_uniform_is_deterministic_sliceable_and_uniform() -> None:
    u = uniform(7, 0, 100_000)
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert np.array_equal(u, uniform(7, 0, 100_000))
    assert np.array_equal(u[1234:5678], uniform(7, 1234, 5678 - 1234))  # a shard draws its rows' numbers
    assert not np.array_equal(u, uniform(8, 0, 100_000))
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.mean(u < 0.25) - 0.25) < 0.01


@pytest.mark.parametrize("x", [0.1, 0.13, 0.2, 0.27, -0.15, 0.35])
def test_rounding_between_centres_is_unbiased(x: float) -> None:
    w = np.full(200_000, x, dtype=np.float32)
    codes = stochastic_codes(nearest_codes(w), w, CENTRES, uniform(3, 0, w.size), FIRST_CENTRE, PRUNED)
    decoded = np.concatenate(([0, 0], CENTRES))[codes]
    expected = np.clip(x, CENTRES[0], CENTRES[-1])  # beyond the outer centres: clipped
    assert abs(decoded.mean() - expected) < 2e-3
    lo, hi = CENTRES[CENTRES <= expected].max(), CENTRES[CENTRES >= expected].min()
    assert set(np.unique(decoded)) <= {lo, hi}  # only the two bracketing centres


def test_pruned_values_round_between_zero_and_their_centre() -> None:
    w = np.full(200_000, 0.025, dtype=np.float32)
    w[::2] = -0.025
    codes = np.full(w.size, PRUNED, dtype=np.uint8)
    stochastic_codes(codes, w, CENTRES, uniform(5, 0, w.size), FIRST_CENTRE, PRUNED)
    decoded = np.concatenate(([0, 0], CENTRES))[codes]
    assert abs(np.mean(codes != PRUNED) - 0.25) < 0.01  # |x| / |innermost centre| = 0.025 / 0.1
    assert abs(decoded[1::2].mean() - 0.025) < 1e-3 and abs(decoded[::2].mean() + 0.025) < 1e-3
    assert set(np.unique(decoded[1::2])) <= {0.0, np.float32(0.1)}


def test_protected_codes_are_left_alone() -> None:
    w = np.array([0.2, 5.0, 0.2], dtype=np.float32)
    codes = np.array([FIRST_CENTRE + 2, 1, FIRST_CENTRE + 2], dtype=np.uint8)
    out = stochastic_codes(codes.copy(), w, CENTRES, np.zeros(3, np.float32), FIRST_CENTRE, PRUNED)
    assert out[1] == 1


@pytest.mark.parametrize("k", [1, 2, 3, 7, 40, 254])
def test_the_compiled_rounding_is_numpys_bit_for_bit(monkeypatch, k: int) -> None:
    """The kernel makes each value's uniform number as it reads the value, and rounds as the
    numpy steps do, to the same codes: float32 weights and bfloat16 bits, one centre to 254,
    centres at zero and two equal ones (a gap of 0), values on the midpoints and the centres,
    zeros of both signs, NaN, infinities and values past the outer centres, protected codes,
    a seed past 2^63 and an offset (a shard's rows); a code past the centres is refused."""
    from hf_dynaquant.core import rounding

    assert native is not None, "the compiled kernels were not built"
    rng = np.random.default_rng(k)
    for case in range(3):
        c = rng.normal(0, 0.05, k).astype(np.float32)
        if case == 1 and k > 2:
            c[k // 2] = 0.0
        if case == 2 and k > 3:
            c[1] = c[2]
        c = np.sort(c)
        mids = (c[1:] + c[:-1]) / 2
        w = rng.normal(0, 0.06, 100_003).astype(np.float32)
        w[:10] = [0.0, -0.0, np.nan, np.inf, -np.inf, c[0], c[-1], -c[0], 1e-38, 0.5]
        w[10 : 10 + mids.size] = mids
        codes = (np.searchsorted(mids, w) + FIRST_CENTRE).astype(np.uint8)
        codes[np.abs(w) < 0.01] = PRUNED
        codes[np.abs(w) > 0.15] = 1  # protected
        seed, offset = (1 << 63) + 12345 * k + case, 777 * case
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 values, as their bits
        for values in (w, bits):
            compiled = seeded_stochastic_codes(codes.copy(), values, c, seed, offset, FIRST_CENTRE, PRUNED)
            with monkeypatch.context() as patch:
                patch.setattr(rounding, "native", None)
                reference = seeded_stochastic_codes(codes.copy(), values, c, seed, offset, FIRST_CENTRE, PRUNED)
            widened = values if values is w else (bits.astype(np.uint32) << 16).view(np.float32)
            direct = stochastic_codes(codes.copy(), widened, c, uniform(seed, offset, w.size), FIRST_CENTRE, PRUNED)
            assert np.array_equal(compiled, reference) and np.array_equal(reference, direct), (case, values.dtype)
            assert (compiled != codes).any() or k == 1
    if FIRST_CENTRE + k <= 255:
        past = np.full(4, FIRST_CENTRE + k, np.uint8)  # a code one past the last centre
        with pytest.raises(ValueError, match="a code past the centres"):
            seeded_stochastic_codes(past, np.zeros(4, np.float32), c, 1, 0, FIRST_CENTRE, PRUNED)


def test_small_updates_survive_stochastic_but_not_nearest_rounding() -> None:
    """The stagnation the module exists for: weights restored onto centres, then moved by a
    tenth of a bin, keep that move in expectation only with stochastic rounding."""
    torch.manual_seed(0)
    w = torch.randn(256, 256) * 0.05
    nearest = plan_quantization({"w": w}, QuantConfig(bins=8, prune=0.0, protect=0.0, min_numel=1))
    restored = torch.from_numpy(_decode(w, nearest.tensors["w"])).view_as(w)  # every weight on a centre
    gap = float(np.diff(nearest.tensors["w"].centres).min())
    direction = torch.where(torch.rand(w.shape) < 0.5, -1.0, 1.0)  # (a common shift would move the centres)
    moved = restored + 0.1 * gap * direction
    results = {}
    for rounding in ("nearest", "stochastic"):
        config = QuantConfig(bins=8, prune=0.0, protect=0.0, min_numel=1, rounding=rounding)
        plan = plan_quantization({"w": moved}, config)
        decoded = torch.from_numpy(_decode(moved, plan.tensors["w"])).view_as(w)
        results[rounding] = float(((decoded - restored) * direction).mean()) / (0.1 * gap)
    assert abs(results["nearest"]) < 0.2  # the update is (nearly) erased
    assert abs(results["stochastic"] - 1) < 0.2  # the update is kept on average


def _decode(w: torch.Tensor, tp) -> np.ndarray:
    codes, protected = quantize(w, tp)
    return dequantize(codes, tp.centres, protected)


def test_plans_and_codes_are_deterministic_and_shard_consistent() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    config = QuantConfig(bins=6, prune=0.3, protect=0.01, min_numel=1, rounding="stochastic", rounding_seed=9)
    tp = plan_quantization({"w": w}, config).tensors["w"]
    codes, _ = quantize(w, tp)
    assert np.array_equal(codes, quantize(w, plan_quantization({"w": w}, config).tensors["w"])[0])
    tp.dither_offset = 40 * 96  # the rows 40.. of the tensor, as a shard sees them
    assert np.array_equal(quantize(w[40:], tp)[0], codes[40 * 96 :])
    nearest = plan_quantization({"w": w}, QuantConfig(bins=6, prune=0.3, protect=0.01, min_numel=1)).tensors["w"]
    assert nearest.dither_seed is None and not np.array_equal(quantize(w, nearest)[0], codes)


def test_compressor_rounds_stochastically_after_a_restore(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    config = QuantConfig(bins=6, prune=0.2, min_numel=1024)
    comp = Compressor(model, tmp_path / "store", config)
    comp.compress(1)
    assert comp.config.rounding == "nearest"
    assert comp.store.open("step-1").metadata["quant_config"]["rounding"] == "nearest"
    comp.restore(1)
    assert comp.config.rounding == "stochastic"
    comp.compress(2)
    recorded = comp.store.open("step-2").metadata["quant_config"]
    assert recorded["rounding"] == "stochastic" and recorded["rounding_seed"] == comp.config.rounding_seed
    # a new process resuming the chain rounds stochastically too, with the same seed for the same entry
    resumed = Compressor(model, tmp_path / "store", config)
    resumed.continue_chain("step-1")
    assert resumed.config.rounding == "stochastic"
    other = Compressor(model, tmp_path / "store", config)
    other.continue_chain("step-1")
    assert other.config.rounding_seed == resumed.config.rounding_seed


def test_a_resumed_chain_keeps_its_base_codes_as_a_run_does(tmp_path, monkeypatch) -> None:
    """Going on from a stored delta in a new process (``continue_chain``, as the Trainer's
    callback does), the compressor reads the base entry's codes of every quantized tensor, the
    weights' and the optimizer state's, packed as a run keeps them between saves: the next save
    (a delta, rounded stochastically) decodes none of those from the store (it held up to 1.04x
    a pure-bf16 checkpoint at 124M doing so), and reads back."""
    from hf_dynaquant.store.store import EntryReader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    config = QuantConfig(bins=6, prune=0.2, min_numel=1024)
    first = Compressor(model, tmp_path / "store", config, optimizer=optimizer)
    first.compress(1)
    optimizer.step()
    first.compress(2)
    resumed = Compressor(model, tmp_path / "store", config, optimizer=optimizer)
    resumed.continue_chain("step-2")
    kept = set(resumed._states)
    assert {section for section, _ in kept} == {"model", "optimizer"}, kept
    decoded: list[tuple[str, str]] = []
    state = EntryReader.state
    monkeypatch.setattr(EntryReader, "state", lambda self, *a: decoded.append(a) or state(self, *a))
    optimizer.step()
    resumed.compress(3)
    assert decoded and not kept & set(decoded)  # every base code came from what was kept (small tensors are lossless)
    monkeypatch.undo()
    entry = resumed.store.open("step-3")
    assert entry.metadata["quant_config"]["rounding"] == "stochastic"
    assert any(entry.record("model", n)["uses_base"] for n in entry.names("model"))
    assert resumed.store.verify("step-3", deep=True) == []
