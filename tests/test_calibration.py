"""Calibration for snapshots: error feedback while rounding (GPTQ over DynaQuant's codebooks) and
rare embedding rows with a codebook of their own, through the real codec, store and folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from hf_dynaquant import CheckpointStore
from hf_dynaquant.codecs import MemoryBlobs
from hf_dynaquant.codecs.dynaquant import DynaQuantCodec
from hf_dynaquant.core.dtypes import to_raw
from hf_dynaquant.core.entropy import encode_stream
from hf_dynaquant.core import quantizer
from hf_dynaquant.core.feedback import columnwise, feedback_round, inverse_factor
from hf_dynaquant.core.quantizer import (
    FIRST_CENTRE,
    PROTECTED,
    Calibration,
    QuantConfig,
    decoded_values,
    plan_quantization,
    quantize,
)
from hf_dynaquant.errors import CorruptCheckpointError
from hf_dynaquant.pipeline import plan_key, write_planned
from hf_dynaquant.pretrained.calibration import PRETRAINED_BASE, calibrate, calibration_batches, corpus_tokens
from hf_dynaquant.pretrained.folder import compress_folder, decompress_folder
from hf_dynaquant.search import output_cosine
from hf_dynaquant.search.configuration import measured_bits


def _correlated_inputs(n: int, width: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose features are strongly correlated, as a layer's inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width**0.5 + torch.eye(width)
    shared = torch.randn(n, 8, generator=g) @ torch.randn(8, width, generator=g)
    return shared + 0.3 * torch.randn(n, width, generator=g) @ mix


def _output_error(w: torch.Tensor, decoded: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ (w - decoded).T) ** 2).sum())


@pytest.fixture
def layer() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(96, 64, generator=g) * 0.05, _correlated_inputs(2048, 64)


def test_feedback_cuts_the_output_error_and_decodes_to_what_it_rounded(layer) -> None:
    w, x = layer
    config = QuantConfig(bins=6, prune=0, protect=0.01, sigma=1.0, error_feedback=True, min_numel=16)
    fed = plan_quantization({"w": w}, config, calibration=Calibration({"w": x.T @ x})).tensors["w"]
    near = plan_quantization({"w": w}, QuantConfig(bins=6, prune=0, protect=0.01, sigma=1.0, min_numel=16)).tensors["w"]
    assert fed.feedback is not None and near.feedback is None
    np.testing.assert_array_equal(fed.centres, near.centres)  # the same codebook, only the rounding differs

    def decode(plan) -> torch.Tensor:
        codes, kept = quantize(w, plan)
        return torch.from_numpy(decoded_values(codes, plan.centres, kept)).view(w.shape)

    fed_values, near_values = decode(fed), decode(near)
    assert _output_error(w, fed_values, x) < 0.6 * _output_error(w, near_values, x)
    assert float(((w - fed_values) ** 2).sum()) > float(((w - near_values) ** 2).sum())  # it trades weight error away
    # the codec stores exactly the values the rounding chose, protected ones included
    codec = DynaQuantCodec(fed)
    encoded = codec.encode(to_raw(w))
    state = codec.decode("F32", tuple(w.shape), encoded.params, MemoryBlobs(encoded.blobs))
    assert (state.codes == PROTECTED).any()
    torch.testing.assert_close(torch.from_numpy(codec.to_raw(state).bits).view(torch.float32).view(w.shape), fed_values)


@pytest.mark.skipif(quantizer.native is None, reason="the compiled kernels are not built")
def test_compiled_feedback_equals_its_reference(layer, monkeypatch: pytest.MonkeyPatch) -> None:
    w, x = layer
    w = torch.cat([w, w * 3], dim=1).repeat(1, 3)  # 384 columns: three blocks, the last one short
    x = _correlated_inputs(1024, 384, seed=2)
    sens = (w * torch.randn_like(w)).abs()
    for prune_by in ("magnitude", "sensitivity"):
        config = QuantConfig(bins=5, prune=0.2, protect=0.02, sigma=1.0, error_feedback=True, prune_by=prune_by)
        tp = plan_quantization(
            {"w": w}, config, sensitivity={"w": sens}, calibration=Calibration({"w": x.T @ x})
        ).tensors["w"]
        compiled = tp.feedback_codes(w.reshape(-1).numpy())
        with monkeypatch.context() as patch:
            patch.setattr(quantizer, "native", None)
            reference = tp.feedback_codes(w.reshape(-1).numpy())
        assert {0, 1} <= set(np.unique(compiled[0]).tolist())  # pruned and protected values were met
        np.testing.assert_array_equal(compiled[0], reference[0])
        np.testing.assert_array_equal(compiled[1], reference[1])


def test_feedback_without_correlations_is_nearest_rounding(layer) -> None:
    w, _ = layer
    values = w.numpy().copy()
    factor, order = inverse_factor(torch.diag(torch.rand(64) + 1.0))
    assert sorted(order.tolist()) == list(range(64))
    centres = np.linspace(-0.1, 0.1, 7, dtype=np.float32)
    nearest = centres[np.abs(values[..., None] - centres).argmin(-1)]
    columns = []

    def round_column(col: np.ndarray, k: int) -> np.ndarray:
        columns.append(int(order[k]))
        np.testing.assert_array_equal(col, values[:, order[k]])  # nothing was fed forward into it
        return centres[np.abs(col[:, None] - centres).argmin(-1)]

    rounded = feedback_round(values, factor, order, columnwise(round_column))
    assert columns == order.tolist()
    np.testing.assert_array_equal(rounded, nearest)


def test_a_dead_input_feature_is_rounded_and_feeds_nothing_back() -> None:
    gram = torch.eye(4)
    gram[2, 2] = 0.0  # an input that is always 0
    factor, order = inverse_factor(gram)
    assert np.isfinite(factor).all() and order[-1] == 2  # rounded last: it has nothing to pass on


def test_rare_rows_get_their_own_codebook_and_are_coded_apart() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(300, 32, generator=g) * 0.1
    used = np.zeros(300, dtype=np.int64)
    used[:40] = np.arange(1, 41)
    config = QuantConfig(bins=8, embedding_bins=16, rare_bins=3, prune=0, sigma=1.0)
    calibration = Calibration(rows={"embed.weight": used})
    tp = plan_quantization({"embed.weight": table}, config, calibration=calibration).tensors["embed.weight"]
    assert tp.common == 16 and tp.centres.size == 19
    codes, kept = quantize(table, tp)
    rows = codes.reshape(300, 32)
    unprotected = rows >= FIRST_CENTRE
    assert (rows[:40][unprotected[:40]] < FIRST_CENTRE + 16).all()
    assert (rows[40:][unprotected[40:]] >= FIRST_CENTRE + 16).all()
    # the search sizes the entry as the codec stores it: each kind of row with its own model
    store_bits = 8 * len(DynaQuantCodec(tp).encode(to_raw(table)).blobs["codes"])
    plan = plan_quantization({"embed.weight": table}, config, calibration=calibration)
    sized = measured_bits({"embed.weight": table}, plan) * table.numel() - 16 * kept.size
    assert abs(sized - store_bits) < 0.02 * store_bits + 8 * 64
    # one codebook over both kinds of row would cost more
    assert store_bits < 8 * len(DynaQuantCodec(tp, delta_coding="ans").encode(to_raw(table)).blobs["codes"]) + 1
    plain = plan_quantization({"embed.weight": table}, QuantConfig(bins=8, embedding_bins=16, prune=0, sigma=1.0))
    assert measured_bits({"embed.weight": table}, plan) < measured_bits({"embed.weight": table}, plain)


def test_rare_rows_round_trip_through_a_store_and_a_damaged_row_map_is_named(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(200, 24, generator=g) * 0.1, "fc.weight": torch.randn(16, 24, generator=g)}
    used = np.zeros(200, dtype=np.int64)
    used[::7] = 3
    config = QuantConfig(bins=8, embedding_bins=12, rare_bins=3, prune=0, sigma=1.0)
    keyed = {plan_key("model", n): t for n, t in state.items()}
    plan = plan_quantization(
        keyed,
        config,
        types={plan_key("model", "embed.weight"): "Embedding"},
        calibration=Calibration(rows={plan_key("model", "embed.weight"): used}),
    )
    expected = {}
    for key, tp in plan.tensors.items():
        codes, kept = quantize(keyed[key], tp)
        expected[key.partition("::")[2]] = torch.from_numpy(decoded_values(codes, tp.centres, kept))
    store = CheckpointStore(tmp_path / "store")
    entry = write_planned(store, {"model": state}, plan, config=config)
    with store.open(entry) as opened:
        for name, values in expected.items():
            got = torch.from_numpy(opened.raw("model", name).bits.view(np.float32))
            torch.testing.assert_close(got, values, rtol=0, atol=0)
        record = opened.record("model", "embed.weight")
    assert record["params"]["codes_stream"] == "ans-rows"
    # a row map that claims a third kind of row is refused, naming the tensor
    codec = DynaQuantCodec(plan.tensors[plan_key("model", "embed.weight")])
    encoded = codec.encode(to_raw(state["embed.weight"]))
    bad = np.zeros(200, dtype=np.uint8)
    bad[3] = 2
    coding, payload = encode_stream(bad)
    with pytest.raises(CorruptCheckpointError, match="tensor 't'.*row map"):
        params, blobs = {**encoded.params, "rows_stream": coding}, MemoryBlobs({**encoded.blobs, "rows": payload}, "tensor 't'")
        codec.decode("F32", (200, 24), params, blobs)


def test_calibrate_records_input_grams_and_used_rows() -> None:
    torch.manual_seed(0)
    model = BertModel(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    ).eval()
    batches = [{"input_ids": torch.tensor([[1, 2, 3, 3, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}]
    seen: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["x"] = args[0].reshape(-1, 16).double()

    hook = model.encoder.layer[0].intermediate.dense.register_forward_hook(keep)
    calibration = calibrate(model, batches)
    hook.remove()
    x = seen["x"][:4]  # the padding position is left out
    torch.testing.assert_close(
        calibration.grams["encoder.layer.0.intermediate.dense.weight"], (x.T @ x).float(), rtol=1e-5, atol=1e-5
    )
    assert len(calibration.grams) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    used = calibration.rows["embeddings.word_embeddings.weight"]
    assert used.shape == (50,) and used[3] == 2 and used[1] == 1 and used[0] == 1 and used[5] == 0
    # more token ids (a corpus) are counted besides the batches'
    more = calibrate(model, batches, tokens=[torch.tensor([4, 4, 4])]).rows["embeddings.word_embeddings.weight"]
    assert more[4] == 3 and more[3] == 2


def test_tied_output_embeddings_keep_every_row() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)).eval()
    calibration = calibrate(model, [{"input_ids": torch.tensor([[1, 2, 3]])}])
    assert calibration.rows == {}  # the LM head shares the rows: every one scores every output
    assert "transformer.h.0.mlp.c_fc.weight" not in calibration.grams  # Conv1D layers are not nn.Linear


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="nearest"):
        QuantConfig(error_feedback=True, rounding="stochastic")
    with pytest.raises(ValueError, match="nearest"):
        QuantConfig(rare_bins=3, rounding="stochastic")
    with pytest.raises(ValueError, match="254"):
        QuantConfig(embedding_bins=200, rare_bins=60)
    with pytest.raises(ValueError, match="rare_bins"):
        QuantConfig(rare_bins=1)
    assert PRETRAINED_BASE.error_feedback and PRETRAINED_BASE.rare_bins is not None
    assert not PRETRAINED_BASE.trellis  # the trellis base's default snapshot fine-tuned worse (RESULTS, issue 19)


@pytest.mark.slow  # compresses MiniLM three times (~40 s on 2 cores)
def test_minilm_snapshot_with_calibration_keeps_its_outputs_closer(tmp_path: Path, minilm_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    held_out = calibration_batches(tokenizer, batches=2, offset=1)  # paragraphs the calibration did not see
    original = AutoModel.from_pretrained(str(minilm_dir)).eval()

    def distortion(folder: Path) -> float:
        model = AutoModel.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            pairs = [(model(**b).last_hidden_state, original(**b).last_hidden_state) for b in held_out]
        return sum(float(((a - b) ** 2).sum()) for a, b in pairs) / sum(float((b**2).sum()) for _, b in pairs)

    results = {}
    for label, config in {
        "nearest": QuantConfig(bins=12, embedding_bins=16, prune=0, sigma=1.0),
        "calibrated": QuantConfig(bins=12, embedding_bins=16, rare_bins=3, prune=0, sigma=1.0, error_feedback=True),
    }.items():
        packed = compress_folder(minilm_dir, tmp_path / label, codec="dynaquant", config=config, progress=False)
        decompress_folder(packed.path, tmp_path / f"{label}-plain", progress=False)
        results[label] = (packed.ratio, distortion(tmp_path / f"{label}-plain"))
    (ratio_near, d_near), (ratio_cal, d_cal) = results["nearest"], results["calibrated"]
    assert ratio_cal > 1.3 * ratio_near  # the rare rows' 3 levels
    assert d_cal < 0.75 * d_near  # and the outputs are closer all the same


def test_output_cosine_is_the_cosine_distance_over_kept_positions() -> None:
    torch.manual_seed(0)
    model = BertModel(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    ).eval()
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}
    metric = output_cosine(model, [batch])
    assert metric.name == "output_cosine_distance" and not metric.higher_is_better
    with torch.no_grad():
        assert abs(metric.fn(model)) < 1e-6
        before = model(**batch).last_hidden_state[0, :4]
        dense = model.encoder.layer[0].intermediate.dense.weight
        dense.add_(torch.randn(dense.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
        after = model(**batch).last_hidden_state[0, :4]
    expected = 1 - float(torch.nn.functional.cosine_similarity(after, before, dim=-1).mean())
    assert expected > 1e-4
    with torch.no_grad():
        assert metric.fn(model) == pytest.approx(expected, rel=1e-5)


def test_minilm_rows_count_the_corpus_and_the_special_tokens(minilm_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    model = AutoModel.from_pretrained(str(minilm_dir)).eval()
    batches = calibration_batches(tokenizer, batches=1, batch_size=2, seq_len=16)
    used = calibrate(model, batches, corpus_tokens(tokenizer)).rows["embeddings.word_embeddings.weight"]
    assert used[tokenizer.cls_token_id] > 0 and used[tokenizer.sep_token_id] > 0  # every input has them
    assert 4000 < int((used > 0).sum()) < 10000  # the docstrings use a fifth of the vocabulary
