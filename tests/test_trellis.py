"""Trellis-coded quantization (core/trellis.py, QuantConfig.trellis): the Viterbi search inside error
feedback, the stored symbols and the decoder's state machine, the compiled kernels against their
numpy references, and the codec's round trip."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from hf_dynaquant.codecs import MemoryBlobs
from hf_dynaquant.codecs.dynaquant import DynaQuantCodec
from hf_dynaquant.core import quantizer, trellis
from hf_dynaquant.core.dtypes import to_raw
from hf_dynaquant.core.entropy import encode_codes
from hf_dynaquant.core.quantizer import (
    FIRST_CENTRE,
    PROTECTED,
    PRUNED,
    Calibration,
    QuantConfig,
    code_table,
    decoded_values,
    plan_quantization,
    quantize,
)
from hf_dynaquant.errors import CorruptCheckpointError
from hf_dynaquant.search.configuration import measured_bits


def _inputs(n: int, width: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose features are correlated, as a layer's inputs are."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(n, 8, generator=g) @ torch.randn(8, width, generator=g)
    return shared + 0.3 * torch.randn(n, width, generator=g)


def _plan(w: torch.Tensor, x: torch.Tensor, **options) -> quantizer.TensorPlan:
    config = QuantConfig(**{"bins": 8, "prune": 0, "protect": 0.01, "sigma": 1.0, "error_feedback": True, **options})
    return plan_quantization({"w": w}, config, calibration=Calibration({"w": x.T @ x})).tensors["w"]


@pytest.fixture
def layer() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(200, 96, generator=g) * 0.05, _inputs(4096, 96)


def test_grid_is_uniform_holds_zero_and_spans_the_codebook() -> None:
    centres = np.array([-0.3, -0.1, 0.05, 0.2], dtype=np.float32)
    levels, step = trellis.grid(centres)
    assert levels.size % 8 == 0 and levels.size <= trellis.MAX_LEVELS
    np.testing.assert_allclose(np.diff(levels), step, rtol=1e-5)
    assert step == pytest.approx(0.5 / 6)  # each parity's levels: 4 of them span the codebook
    assert 0.0 in levels and levels[levels.size // 2] == 0.0
    assert levels[0] <= trellis.REACH * -0.3 and levels[-1] >= 0.3
    with pytest.raises(ValueError, match="two distinct"):
        trellis.grid(np.array([0.1, 0.1], dtype=np.float32))
    # past about 80 bins the finest grid a byte allows, still reaching past the codebook
    levels, step = trellis.grid(np.linspace(-1, 1, 200, dtype=np.float32))
    assert levels.size <= trellis.MAX_LEVELS and levels[0] <= -trellis.REACH * 0.999 and levels[-1] >= 1.0


def test_trellis_rounds_with_feedback_to_fewer_bits_and_less_output_error(layer) -> None:
    w, x = layer
    kmeans, tcq = _plan(w, x), _plan(w, x, trellis=True)
    assert kmeans.trellis_steps is None and tcq.trellis_steps is not None
    assert not tcq.partitions_on_device()

    def stored(plan) -> tuple[float, int]:
        codes, kept = quantize(w, plan)
        decoded = torch.from_numpy(decoded_values(codes, plan.centres, kept)).view(w.shape)
        error = float(((x @ (w - decoded).T) ** 2).sum() / ((x @ w.T) ** 2).sum())
        symbols = trellis.pack(codes) if plan.trellis_steps is not None else codes
        return error, len(encode_codes(symbols)[1])

    (e_kmeans, b_kmeans), (e_tcq, b_tcq) = stored(kmeans), stored(tcq)
    # the same bins: a finer grid, so less error, in about the bits (a symbol names one parity's levels)
    assert e_tcq < 0.8 * e_kmeans and b_tcq < 1.15 * b_kmeans


@pytest.mark.skipif(quantizer.native is None, reason="the compiled kernels are not built")
def test_compiled_trellis_equals_its_reference(layer, monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = layer
    w = torch.cat([w, w * 3], dim=1).repeat(1, 2)[:, :300]  # 300 columns: three blocks, the last one short
    x = _inputs(2048, 300, seed=2)
    sens = (w * torch.randn_like(w)).abs()
    for prune_by in ("magnitude", "sensitivity"):
        config = QuantConfig(
            bins=5, prune=0.2, protect=0.02, sigma=1.0, error_feedback=True, trellis=True, prune_by=prune_by
        )
        tp = plan_quantization(
            {"w": w}, config, sensitivity={"w": sens}, calibration=Calibration({"w": x.T @ x})
        ).tensors["w"]
        compiled = tp.feedback_codes(w.reshape(-1).numpy())
        symbols = trellis.pack(compiled[0])
        unpacked = trellis.unpack(symbols, w.shape[0], (tp.centres.size,))
        with monkeypatch.context() as patch:
            patch.setattr(quantizer, "native", None)
            patch.setattr(trellis, "native", None)
            reference = tp.feedback_codes(w.reshape(-1).numpy())
            np.testing.assert_array_equal(trellis.unpack(symbols, w.shape[0], (tp.centres.size,)), compiled[0])
        assert {PRUNED, PROTECTED} <= set(np.unique(compiled[0]).tolist())  # pruned and protected values were met
        np.testing.assert_array_equal(compiled[0], reference[0])
        np.testing.assert_array_equal(compiled[1], reference[1])
        np.testing.assert_array_equal(unpacked, compiled[0])


def test_symbols_follow_the_trellis_down_each_column() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 7)).astype(np.float32)
    levels, step = trellis.grid(np.array([-1.5, 1.5], dtype=np.float32))
    table = code_table(levels)
    codes = np.full(x.shape, FIRST_CENTRE, dtype=np.uint8)
    codes[5, 2], codes[9, 4] = PRUNED, PROTECTED  # skipped: they leave the state alone
    columns = np.ascontiguousarray(codes.T)
    trellis.round_sequences(np.ascontiguousarray(x.T), columns, float(levels[0]), step, table)
    codes = np.ascontiguousarray(columns.T)
    assert codes[5, 2] == PRUNED and codes[9, 4] == PROTECTED
    np.testing.assert_array_equal(trellis.unpack(trellis.pack(codes), 40, (levels.size,)), codes.reshape(-1))
    # each state allows one parity of levels: a path's consecutive levels are never free
    i = codes[:, 0].astype(np.int64) - FIRST_CENTRE
    state = 0
    for level in i:
        assert level % 2 == state % 2
        state = int(trellis.NEXT[state][list(trellis.SUB[state]).index(level % 4)])


def test_codec_stores_symbols_and_decodes_what_was_rounded(layer) -> None:
    w, x = layer
    tp = _plan(w, x, trellis=True, protect=0.02)
    codes, kept = quantize(w, tp)
    expected = decoded_values(codes, tp.centres, kept)
    codec = DynaQuantCodec(tp)
    encoded = codec.encode(to_raw(w))
    assert encoded.params["trellis"] == "tcq8" and encoded.params["mode"] == "keyframe"
    assert "codes" not in encoded.blobs  # a reader that knows no trellis finds no codes to misread
    state = codec.decode("F32", tuple(w.shape), encoded.params, MemoryBlobs(encoded.blobs, "tensor 'w'"))
    assert state.trellis and (state.codes == PROTECTED).any()
    np.testing.assert_array_equal(state.codes, codes)
    np.testing.assert_array_equal(codec.to_raw(state).bits.view(np.float32), expected)
    # a keyframe of the decoded state (a store's compaction) stores the same symbols
    again = codec.keyframe(state)
    assert again.params["trellis"] == "tcq8" and bytes(again.blobs["symbols"]) == bytes(encoded.blobs["symbols"])
    # a later checkpoint of the same tensor is a keyframe too: no delta is tried on trellis codes
    assert codec.encode(to_raw(w), base=state).params["mode"] == "keyframe"
    # the search sizes the tensor as stored: by its symbols, which take about a bit a value less
    # than its codes would (rANS lies a few percent above the order-0 size the search counts, on
    # symbols of many levels; the codes would be over 30% above it here)
    plan = plan_quantization(
        {"w": w}, QuantConfig(bins=8, prune=0, protect=0.02, sigma=1.0, error_feedback=True, trellis=True),
        calibration=Calibration({"w": x.T @ x}),
    )  # fmt: skip
    sized = measured_bits({"w": w}, plan) * w.numel() - 16 * kept.size
    store_bits = 8 * len(encoded.blobs["symbols"])
    assert abs(sized - store_bits) < 0.07 * store_bits


def test_damaged_trellis_symbols_are_named(layer) -> None:
    w, x = layer
    tp = _plan(w, x, trellis=True)
    codec = DynaQuantCodec(tp)
    encoded = codec.encode(to_raw(w))
    blobs = MemoryBlobs(encoded.blobs, "tensor 'w'")
    too_far = np.full(w.numel(), FIRST_CENTRE + tp.centres.size // 2, dtype=np.uint8)  # past the grid from state 1
    coding, payload = encode_codes(too_far)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'.*past its grid"):
        codec.decode("F32", tuple(w.shape), {**encoded.params, "codes_stream": coding}, MemoryBlobs({"symbols": payload}, "tensor 'w'"))
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'.*trellis 'tcq16'"):
        codec.decode("F32", tuple(w.shape), {**encoded.params, "trellis": "tcq16"}, blobs)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'.*grids of \\[200, 100\\] levels"):
        codec.decode("F32", tuple(w.shape), {**encoded.params, "trellis_levels": [200, 100]}, blobs)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'.*only keyframes"):
        codec.decode("F32", tuple(w.shape), {**encoded.params, "mode": "delta"}, blobs, base=None)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'.*no columns"):
        codec.decode("F32", (w.numel(),), encoded.params, blobs)


def test_trellis_needs_error_feedback() -> None:
    with pytest.raises(ValueError, match="error_feedback"):
        QuantConfig(trellis=True)
    # without calibration there is nothing to round with feedback: the K-means codebook as before
    w = torch.randn(64, 64)
    tp = plan_quantization({"w": w}, QuantConfig(error_feedback=True, trellis=True)).tensors["w"]
    assert tp.trellis_steps is None and tp.feedback is None


def _embedding() -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(5)
    used = np.zeros(300, dtype=np.int64)
    used[::4] = 2
    return torch.randn(300, 48, generator=g) * 0.1, used


@pytest.mark.skipif(quantizer.native is None, reason="the compiled kernels are not built")
def test_columns_rounded_in_place_as_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    """Down the columns of a row-major matrix (transposed views, many columns in lockstep, the
    last block short) the compiled search gives the codes it gives the columns copied out as
    contiguous sequences, and the numpy reference's."""
    rng = np.random.default_rng(3)
    m = (rng.standard_normal((500, 65)) * 0.5).astype(np.float32)  # blocks of 32, 32 and 1 columns
    levels, step = trellis.grid(np.linspace(-1.0, 1.0, 9, dtype=np.float32))
    table = code_table(levels)
    codes = np.where(rng.random(m.shape) < 0.1, PRUNED, FIRST_CENTRE).astype(np.uint8)
    codes[rng.random(m.shape) < 0.02] = PROTECTED
    in_place = codes.copy()
    trellis.round_sequences(m.T, in_place.T, float(levels[0]), step, table)
    copied = np.ascontiguousarray(codes.T)
    trellis.round_sequences(np.ascontiguousarray(m.T), copied, float(levels[0]), step, table)
    with monkeypatch.context() as patch:
        patch.setattr(trellis, "native", None)
        reference = codes.copy()
        trellis.round_sequences(m.T, reference.T, float(levels[0]), step, table)
    np.testing.assert_array_equal(in_place, copied.T)
    np.testing.assert_array_equal(in_place, reference)
    assert ((in_place == PRUNED) == (codes == PRUNED)).all() and ((in_place == PROTECTED) == (codes == PROTECTED)).all()
    # a value off the trellis is never read, whatever it holds
    m[codes == PRUNED] = np.nan
    again = codes.copy()
    trellis.round_sequences(m.T, again.T, float(levels[0]), step, table)
    np.testing.assert_array_equal(again, in_place)
    # the search sizes symbols from the codes' counts: what packing them would count
    rare = (rng.random(500) < 0.3).astype(np.uint8)
    counts = np.stack([np.bincount(in_place[rare == k].ravel(), minlength=256) for k in (0, 1)])
    packed = trellis.pack(in_place.reshape(-1), rare, 8)
    keys = np.repeat(rare.astype(np.int64), 65) * 256 + packed
    np.testing.assert_array_equal(trellis.symbol_counts(counts, 8), np.bincount(keys, minlength=512).reshape(2, 256))
    alone = trellis.symbol_counts(np.bincount(in_place.ravel()))
    np.testing.assert_array_equal(alone, np.bincount(trellis.pack(in_place.reshape(-1)), minlength=alone.size))


@pytest.mark.parametrize("compiled", [True, False])
def test_rare_and_common_rows_each_follow_their_own_trellis(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if compiled and quantizer.native is None:
        pytest.skip("the compiled kernels are not built")
    table, used = _embedding()
    config = QuantConfig(bins=8, embedding_bins=12, rare_bins=3, prune=0, protect=0.01, sigma=1.0, error_feedback=True)
    calibration = Calibration(rows={"embed.weight": used})
    kmeans = plan_quantization({"embed.weight": table}, config, calibration=calibration).tensors["embed.weight"]
    tp = plan_quantization(
        {"embed.weight": table}, replace(config, trellis=True), calibration=calibration
    ).tensors["embed.weight"]
    assert tp.trellis_steps is not None and len(tp.trellis_steps) == 2 and tp.common % 8 == 0
    with monkeypatch.context() as patch:
        if not compiled:
            patch.setattr(quantizer, "native", None)
            patch.setattr(trellis, "native", None)
        codes, kept = quantize(table, tp)
        rows = codes.reshape(300, 48)
        on = rows >= FIRST_CENTRE
        assert (rows[used > 0][on[used > 0]] < FIRST_CENTRE + tp.common).all()
        assert (rows[used == 0][on[used == 0]] >= FIRST_CENTRE + tp.common).all()
        levels = (tp.common, tp.centres.size - tp.common)
        symbols = trellis.pack(codes, tp.rare_rows, tp.common)
        np.testing.assert_array_equal(trellis.unpack(symbols, 300, levels, tp.rare_rows), codes)
        encoded = DynaQuantCodec(tp).encode(to_raw(table))
    if compiled:
        # the numpy reference rounds to the same codes
        with monkeypatch.context() as patch:
            patch.setattr(quantizer, "native", None)
            patch.setattr(trellis, "native", None)
            np.testing.assert_array_equal(quantize(table, tp)[0], codes)
    assert encoded.params["codes_stream"] == "ans-rows" and encoded.params["trellis_levels"] == list(levels)
    state = DynaQuantCodec(tp).decode("F32", (300, 48), encoded.params, MemoryBlobs(encoded.blobs, "tensor 'e'"))
    np.testing.assert_array_equal(state.codes, codes)
    assert state.common == tp.common
    again = DynaQuantCodec().keyframe(state)
    assert bytes(again.blobs["symbols"]) == bytes(encoded.blobs["symbols"])
    # each grid is matched to its codebook's error (on a sample of the columns), in fewer bytes
    error = lambda plan, c, k: float(((decoded_values(c, plan.centres, k) - table.reshape(-1).numpy()) ** 2).sum())
    k_codes, k_kept = quantize(table, kmeans)
    k_bytes = len(DynaQuantCodec(kmeans).encode(to_raw(table)).blobs["codes"])
    assert error(tp, codes, kept) == pytest.approx(error(kmeans, k_codes, k_kept), rel=0.1)
    assert len(encoded.blobs["symbols"]) < k_bytes
    # the search sizes it by kind of row, as stored
    plan = plan_quantization({"embed.weight": table}, replace(config, trellis=True), calibration=calibration)
    sized = measured_bits({"embed.weight": table}, plan) * table.numel() - 16 * kept.size
    store_bits = 8 * len(encoded.blobs["symbols"])
    assert abs(sized - store_bits) < 0.07 * store_bits + 8 * 64


@pytest.mark.slow  # compresses MiniLM twice (~30 s on 2 cores)
def test_minilm_snapshot_by_trellis_is_smaller_at_the_same_fidelity(tmp_path, minilm_dir) -> None:
    from transformers import AutoModel, AutoTokenizer

    from hf_dynaquant.pretrained.calibration import PRETRAINED_BASE, calibration_batches
    from hf_dynaquant.pretrained.folder import compress_folder, decompress_folder

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    held_out = calibration_batches(tokenizer, batches=2, offset=1)  # paragraphs the calibration did not see
    original = AutoModel.from_pretrained(str(minilm_dir)).eval()

    def distortion(folder) -> float:
        model = AutoModel.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            pairs = [(model(**b).last_hidden_state, original(**b).last_hidden_state) for b in held_out]
        return sum(float(((a - b) ** 2).sum()) for a, b in pairs) / sum(float((b**2).sum()) for _, b in pairs)

    results = {}
    for trellis_on in (False, True):
        config = replace(PRETRAINED_BASE, bins=16, embedding_bins=12, prune=0, protect=0.002, trellis=trellis_on)
        packed = compress_folder(minilm_dir, tmp_path / f"t{trellis_on}", codec="dynaquant", config=config, progress=False)
        decompress_folder(packed.path, tmp_path / f"plain{trellis_on}", progress=False)
        results[trellis_on] = (packed.ratio, distortion(tmp_path / f"plain{trellis_on}"))
    (ratio_k, d_k), (ratio_t, d_t) = results[False], results[True]
    assert ratio_t > 1.05 * ratio_k  # RESULTS: 12.1x against 11.3x
    assert d_t < 1.25 * d_k  # at about the outputs' fidelity


def test_embedding_grids_past_one_byte_keep_their_codebooks() -> None:
    table, used = _embedding()
    config = QuantConfig(
        bins=8, embedding_bins=200, rare_bins=40, prune=0, protect=0.01, sigma=1.0, error_feedback=True, trellis=True
    )
    tp = plan_quantization({"embed.weight": table}, config, calibration=Calibration(rows={"embed.weight": used}))
    plan = tp.tensors["embed.weight"]
    assert plan.trellis_steps is None and plan.centres.size <= 254  # K-means codebooks: the two grids need more
    codes, kept = quantize(table, plan)
    assert codes.max() < 2 + plan.centres.size
