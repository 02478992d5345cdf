"""Keyframe codes coded with contexts from their rows' and columns' terms (``"ans-factored"``,
core/factored.py): an Adam scale's codes, close to a row term plus a column term."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dynaquant.codecs import dynaquant as dynaquant_mod
from hf_dynaquant.codecs.dynaquant import DynaQuantCodec, QuantState
from hf_dynaquant.core import ans as ans_mod
from hf_dynaquant.core import delta as delta_mod
from hf_dynaquant.core import factored as factored_mod
from hf_dynaquant.core.delta import grouped_delta
from hf_dynaquant.core.factored import FactoredContexts, context_count, factored_contexts, factored_terms
from hf_dynaquant.core.moments import scale_plan
from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization
from hf_dynaquant.errors import CorruptCheckpointError
from hf_dynaquant.training.compressor import Compressor

WHERE = "entry x, tensor exp_avg_sq"


def _scale_codes(rows: int, cols: int, levels: int = 14, seed: int = 0) -> np.ndarray:
    """Codes as an Adam scale's lie: a row term plus a column term plus noise, on the grid."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(levels / 2, 2, (rows, 1)), rng.normal(0, 2, (1, cols))
    return np.clip(np.rint(a + b + rng.normal(0, 0.8, (rows, cols))), 0, levels - 1).astype(np.uint8).reshape(-1)


def _state(codes: np.ndarray, shape: tuple[int, ...], levels: int = 14) -> QuantState:
    return QuantState(codes, levels, np.arange(levels - 2, dtype=np.float32), np.zeros(0, np.uint16), "F32", shape)


def _scale_codec(factored: bool = True) -> DynaQuantCodec:
    plan = scale_plan(2.0, 1e-8, 1.0)
    plan.factored = factored
    return DynaQuantCodec(plan)


def _blobs(blobs: dict[str, bytes]):
    def read(name: str) -> np.ndarray:
        return np.frombuffer(blobs[name], np.uint8)

    read.where = WHERE  # type: ignore[attr-defined]
    return read


@pytest.mark.parametrize("shape", [(1, 5), (7, 1), (300, 257), (64, 4096), (3, 40000)])
def test_terms_and_contexts_match_the_numpy_reference(monkeypatch, shape) -> None:
    """The compiled sums and contexts are the numpy reference's, also for terms a damaged file
    holds (any int16: clipped, never an overflow), and the delta grouped on contexts made a chunk
    at a time is the one on the contexts made whole; bad arguments are refused."""
    rows, cols = shape
    codes = np.random.default_rng(1).integers(0, 256, rows * cols).astype(np.uint8)
    wild = np.random.default_rng(2).integers(-32768, 32768, rows + cols).astype(np.int16)
    native = (factored_terms(codes, rows), factored_contexts(wild, rows, cols, 200))
    with monkeypatch.context() as patch:
        patch.setattr(factored_mod, "native", None)
        reference = (factored_terms(codes, rows), factored_contexts(wild, rows, cols, 200))
    assert np.array_equal(native[0], reference[0]) and np.array_equal(native[1], reference[1])
    row_means = codes.reshape(rows, cols).mean(axis=1)
    assert np.array_equal(native[0][:rows], np.rint(4 * row_means).astype(np.int16))
    codes14 = codes % 14
    for contexts in (1, 53, 200):  # grouped on the contexts never made, as on them made whole
        base = FactoredContexts(wild, rows, cols, contexts)
        never_made = grouped_delta(base, codes14, max(contexts, 14))
        whole = grouped_delta(base.unpacked(), codes14, max(contexts, 14))
        assert np.array_equal(never_made[0], whole[0]) and np.array_equal(never_made[1], whole[1])
    assert context_count(14) == 53 and context_count(64) == 253
    with pytest.raises(ValueError):
        context_count(65)
    with pytest.raises(ValueError):
        factored_terms(codes, next(k for k in range(rows + 1, rows + 100) if codes.size % k))
    with pytest.raises(ValueError):
        factored_contexts(wild[:-1], rows, cols, 200)


@pytest.mark.parametrize("terms", ["fitted", "clipped at both ends", "wild", "one column term"])
@pytest.mark.parametrize("shape", [(300, 257), (2000, 96), (5, 3000)])
def test_grouping_by_classes_of_columns_is_the_counting_sort(monkeypatch, terms, shape) -> None:
    """The kernels group and ungroup a row's codes a class of equal column terms at a time
    (rows whose end contexts take two classes or more go column by column): the grouped
    delta, its pairs, the contexts' counts and the codes undone are the numpy reference's on
    the contexts made whole, for terms fitted to the codes, terms that clip many rows at both
    ends, a damaged file's terms and columns that all share one term."""
    rows, cols = shape
    levels = 14
    contexts = context_count(levels)
    codes = _scale_codes(rows, cols, levels, seed=rows)
    fitted = factored_terms(codes, rows)
    rng = np.random.default_rng(cols)
    given = {
        "fitted": fitted,
        "clipped at both ends": np.concatenate((fitted[:rows] + rng.integers(-40, 41, rows), fitted[rows:])),
        "wild": rng.integers(-32768, 32768, rows + cols),
        "one column term": np.concatenate((fitted[:rows], np.full(cols, 3))),
    }[terms].astype(np.int16)
    base = FactoredContexts(given, rows, cols, contexts)
    whole = base.unpacked()
    grouped, pairs = grouped_delta(base, codes, contexts)
    reference = grouped_delta(whole, codes, contexts)
    assert np.array_equal(grouped, reference[0]) and np.array_equal(pairs, reference[1])
    assert np.array_equal(base.counts(), np.bincount(whole, minlength=1))
    assert np.array_equal(delta_mod.undo_regrouped_delta(grouped, base, contexts), codes)
    with monkeypatch.context() as patch:
        patch.setattr(factored_mod, "native", None)
        patch.setattr(delta_mod, "native", None)
        assert np.array_equal(base.counts(), np.bincount(whole, minlength=1))
        assert np.array_equal(delta_mod.undo_regrouped_delta(grouped, base, contexts), codes)
    native = delta_mod.native
    if native is not None:  # arguments the kernels refuse
        r, c = base.bounded_terms()
        out = np.empty_like(codes)
        with pytest.raises(ValueError, match="ungroup_factored"):
            native.ungroup_factored_u8(grouped[:-1], r, c, contexts, contexts, out)
        with pytest.raises(ValueError, match="ungroup_factored"):
            native.ungroup_factored_u8(grouped, r, c, 0, contexts, out)
        with pytest.raises(ValueError, match="ungroup_factored"):
            native.ungroup_factored_u8(grouped, r, c, contexts, contexts, grouped)
        with pytest.raises(ValueError, match="factored_counts"):
            native.factored_counts(r, c, contexts, np.zeros(255, np.int64))
        with pytest.raises(ValueError, match="factored_counts"):
            native.factored_counts(r, np.full(cols, 5000, np.int16), contexts, np.zeros(256, np.int64))


def test_a_scale_keyframe_codes_with_factored_contexts_and_reads_back(monkeypatch) -> None:
    """Codes close to a row term plus a column term take a quarter fewer bytes with factored
    contexts than the plain keyframe's coding, and read back exactly; without the compiled
    kernels the same bytes are written and read. Codes that the plain coding takes at their
    entropy (packed, uniform over 16 levels), vectors, short tensors and plans that do not ask
    for it (the weights') keep the plain keyframe."""
    shape = (1024, 768)
    codes = _scale_codes(*shape)
    encoded = _scale_codec()._encode_state(_state(codes, shape), None, {})
    plain = _scale_codec(False)._encode_state(_state(codes, shape), None, {})
    assert encoded.params["mode"] == "keyframe" and encoded.params["codes_stream"] == "ans-factored"
    assert encoded.params["factored"]["contexts"] == context_count(14) and not encoded.uses_base
    assert plain.params["codes_stream"] != "ans-factored" and list(encoded.blobs) == list(plain.blobs) == ["codes"]
    assert len(encoded.blobs["codes"]) < 0.8 * len(plain.blobs["codes"])
    assert np.array_equal(DynaQuantCodec().decode("F32", shape, encoded.params, _blobs(encoded.blobs)).codes, codes)
    with monkeypatch.context() as patch:  # the writer and the reader without the compiled kernels
        for module in (factored_mod, delta_mod, ans_mod):
            patch.setattr(module, "native", None)
        assert np.array_equal(DynaQuantCodec().decode("F32", shape, encoded.params, _blobs(encoded.blobs)).codes, codes)
        assert _scale_codec()._encode_state(_state(codes, shape), None, {}).blobs == encoded.blobs
    noise = np.random.default_rng(3).integers(0, 16, codes.size).astype(np.uint8)  # (packed: 4 bits, its entropy)
    assert _scale_codec()._encode_state(_state(noise, shape, 16), None, {}).params["codes_stream"] != "ans-factored"
    for other_shape in ((codes.size,), (4, 100)):
        few = codes[: int(np.prod(other_shape))]
        assert _scale_codec()._encode_state(_state(few, other_shape), None, {}).params["codes_stream"] != "ans-factored"
    weights = plan_quantization({"w": torch.randn(shape)}, QuantConfig(bins=12, min_numel=1)).tensors["w"]
    assert not weights.factored
    as_weights = DynaQuantCodec(weights)._encode_state(_state(codes, shape), None, {})
    assert as_weights.params["codes_stream"] != "ans-factored"


@pytest.mark.parametrize(
    "damage",
    [
        ("no factored param", lambda p, b: p.pop("factored")),
        ("contexts 0", lambda p, b: p["factored"].update(contexts=0)),
        ("contexts 300", lambda p, b: p["factored"].update(contexts=300)),
        ("contexts not an int", lambda p, b: p["factored"].update(contexts="53")),
        ("unknown terms stream", lambda p, b: p["factored"].update(terms_stream="lzma")),
        ("unknown rANS stream", lambda p, b: p["factored"].update(stream="ans9")),
        ("no terms length", lambda p, b: b.update(codes=b"\x80")),
        ("terms past the blob", lambda p, b: b.update(codes=b"\xff\x7f" + b["codes"][2:40])),
        ("terms cut short", lambda p, b: b.update(codes=_with_terms(b["codes"], lambda t: t[:-3]))),
        ("terms changed", lambda p, b: b.update(codes=_with_terms(b["codes"], _raised_row))),
        ("stream cut short", lambda p, b: b.update(codes=b["codes"][: len(b["codes"]) // 2])),
    ],
    ids=lambda d: d[0],
)
def test_a_damaged_factored_keyframe_is_corrupt(damage) -> None:
    """Each damage to a factored keyframe's params or blobs raises CorruptCheckpointError naming
    the tensor, never another error or wrong codes."""
    shape = (512, 384)
    codes = _scale_codes(*shape, seed=4)
    encoded = _scale_codec()._encode_state(_state(codes, shape), None, {})
    params = {**encoded.params, "factored": dict(encoded.params["factored"])}
    blobs = dict(encoded.blobs)
    damage[1](params, blobs)
    with pytest.raises(CorruptCheckpointError, match="tensor exp_avg_sq"):
        DynaQuantCodec().decode("F32", shape, params, _blobs(blobs))
    with pytest.raises(CorruptCheckpointError, match="tensor exp_avg_sq"):
        DynaQuantCodec().decode("F32", (codes.size,), encoded.params, _blobs(encoded.blobs))  # (no rows and columns)


def _with_terms(blob: bytes, change) -> bytes:
    """A factored keyframe's blob ``codes`` with its terms (as stored) changed by ``change``."""
    from hf_dynaquant.core.varint import length_prefixed, split_prefixed

    terms, stream = split_prefixed(np.frombuffer(blob, np.uint8), "terms")
    return length_prefixed(change(terms.tobytes())) + stream.tobytes()


def _raised_row(stored: bytes) -> bytes:
    """Terms (zstd-coded as written) with the first row's raised by a level (its contexts move)."""
    from hf_dynaquant.core.entropy import decode_stream, encode_stream

    terms = decode_stream("zstd", np.frombuffer(stored, np.uint8), 2 * (512 + 384), WHERE).view("<i2").copy()
    terms[0] += 4
    return encode_stream(terms.view(np.uint8))[1]


def test_checkpoints_with_factored_scales_restore_as_plain_ones(tmp_path, monkeypatch) -> None:
    """Through the Compressor, with AdamW's moments: the scales' keyframes take factored
    contexts, the next checkpoint's deltas are taken on their codes, and both restore to the
    very optimizer state and weights a store without factored contexts restores, in fewer
    bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(384, 512), torch.nn.GELU(), torch.nn.Linear(512, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 384) * torch.rand(1, 384) * 3, torch.randn(256, 8)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    made = {
        name: Compressor(model, tmp_path / name, QuantConfig(bins=8, min_numel=1), optimizer=optimizer)
        for name in ("factored", "plain")
    }
    sizes: dict[str, list[int]] = {"factored": [], "plain": []}
    streams: set[str] = set()
    for checkpoint in (1, 2):
        for _ in range(3):
            step()
        for name, compressor in made.items():
            with monkeypatch.context() as patch:
                if name == "plain":
                    patch.setattr(dynaquant_mod, "_FACTORED_MIN", 1 << 62)
                entry = compressor.compress(checkpoint)
            sizes[name].append(compressor.store.info(entry).nbytes)
            if name == "factored":
                with compressor.store.open(entry) as opened:
                    records = [record["params"] for _, _, record in opened.tensor_records()]
                    streams |= {params.get("codes_stream", params.get("mode")) for params in records}
    assert "ans-factored" in streams and "delta" in streams
    assert sizes["factored"][0] < sizes["plain"][0]
    for checkpoint in (1, 2):
        restored = {}
        for name in ("factored", "plain"):
            fresh = torch.nn.Sequential(torch.nn.Linear(384, 512), torch.nn.GELU(), torch.nn.Linear(512, 8))
            opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
            Compressor(fresh, tmp_path / name, optimizer=opt).restore(checkpoint)
            restored[name] = (fresh.state_dict(), opt.state_dict()["state"])
        for key, value in restored["plain"][0].items():
            assert torch.equal(value, restored["factored"][0][key])
        for index, moments in restored["plain"][1].items():
            for key, value in moments.items():
                assert torch.equal(value, restored["factored"][1][index][key]), (checkpoint, index, key)
