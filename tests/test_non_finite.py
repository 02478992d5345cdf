"""NaN and infinite values (a diverged run) are stored bit-exact with a warning naming the tensor
and the step, or refused on request; meta tensors are refused by name."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from hf_dynaquant import (
    CheckpointStore,
    Compressor,
    NonFiniteTensorError,
    NonFiniteTensorWarning,
    QuantConfig,
    UnsupportedTensorError,
    compress_state_dict,
)
from hf_dynaquant.core.quantizer import plan_quantization
from hf_dynaquant.search import SearchSpace


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32)


def _trained(optimizer_state: str = "compress") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_stored_losslessly_with_a_warning(tmp_path: Path, bad: float) -> None:
    model = _model()
    with torch.no_grad():
        model[0].weight[3, 5] = bad
    original = {n: t.clone() for n, t in model.state_dict().items()}
    comp = Compressor(model, tmp_path, QuantConfig(min_numel=256))
    with pytest.warns(NonFiniteTensorWarning, match=r"'0\.weight' holds NaN or infinite values at step 7"):
        comp.compress(7)
    restored = _model()
    comp.restore(7, restored)
    assert torch.equal(_bits(restored[0].weight), _bits(original["0.weight"]))  # bit-exact, the NaN included
    assert not torch.equal(restored[2].weight, original["2.weight"])  # the finite one is still quantized
    assert comp.store.info("step-7").metadata.get("quant_config", {}).get("non_finite") == "lossless"


def test_non_finite_weight_raises_on_request(tmp_path: Path) -> None:
    model = _model()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    comp = Compressor(model, tmp_path, QuantConfig(min_numel=256, non_finite="raise"))
    with pytest.raises(NonFiniteTensorError, match=r"'2\.weight' holds NaN or infinite values at step 3") as info:
        comp.compress(3)
    assert info.value.tensors == ["'2.weight'"] and info.value.where == "step 3"
    with pytest.raises(NonFiniteTensorError, match="'w'"):
        plan_quantization({"w": torch.full((64, 64), float("nan"))}, QuantConfig(non_finite="raise"))


def test_non_finite_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="non_finite"):
        QuantConfig(non_finite="ignore")


def test_nan_in_adam_moment_is_stored_losslessly(tmp_path: Path) -> None:
    model, opt = _trained()
    opt.state[model[0].weight]["exp_avg"][1, 2] = float("nan")
    expected = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    comp = Compressor(model, tmp_path, QuantConfig(min_numel=256), optimizer=opt, optimizer_state="compress")
    with pytest.warns(NonFiniteTensorWarning, match=r"Adam moments .* of parameter 0 holds NaN .* at step 2"):
        comp.compress(2)
    report = comp.last_report.optimizer_state
    assert report["non_finite"] == [0] and report["quantized"] > 0  # the others are still compressed
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    comp.restore(2, fresh, fresh_opt)
    state = fresh_opt.state[fresh[0].weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(_bits(state[key]), _bits(expected[key]))


def test_nan_in_adam_moment_raises_on_request(tmp_path: Path) -> None:
    model, opt = _trained()
    opt.state[model[2].weight]["exp_avg_sq"][0, 0] = float("inf")
    comp = Compressor(model, tmp_path, QuantConfig(min_numel=256, non_finite="raise"), optimizer=opt)
    with pytest.raises(NonFiniteTensorError, match=r"parameter 2 holds NaN or infinite values at step 5"):
        comp.compress(5)


def test_search_stores_a_diverged_checkpoint_losslessly(tmp_path: Path) -> None:
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    batches = [(torch.randn(8, 64), torch.randint(0, 8, (8,)))]
    space = SearchSpace(bins=(4, 8), prune=(0.0,), protect=(0.005,), prune_by=("magnitude",))
    comp = Compressor(
        model, tmp_path, QuantConfig(min_numel=256), threshold=0.01, eval_data=batches, search_space=space
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp.compress(4)
    messages = [(w.category, str(w.message)) for w in caught]
    assert any(c is NonFiniteTensorWarning and "'0.weight' holds" in m and "step 4" in m for c, m in messages)
    assert any("loss of the unquantized model is nan at step 4" in m for _, m in messages)
    assert comp.last_search.mode == "non-finite" and comp.last_search.config is None
    restored = _model()
    comp.restore(4, restored)
    for name, t in model.state_dict().items():
        assert torch.equal(_bits(restored.state_dict()[name]), _bits(t))
    strict = Compressor(
        model,
        tmp_path / "strict",
        QuantConfig(min_numel=256, non_finite="raise"),
        threshold=0.01,
        eval_data=batches,
        search_space=space,
    )
    with pytest.raises(NonFiniteTensorError, match=r"'0\.weight'"):
        strict.compress(4)


def test_non_finite_sensitivity_falls_back_to_magnitude() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    sens = w.abs().clone()
    sens[0, 0] = float("nan")
    with pytest.warns(NonFiniteTensorWarning, match=r"sensitivity .* of 'w' holds NaN"):
        plan = plan_quantization({"w": w}, QuantConfig(protect=0.01), sensitivity={"w": sens})
    assert plan.tensors["w"].protect_sensitivity is None  # ranked by magnitude


def test_meta_tensors_are_refused_by_name(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(64, 128)
    with pytest.raises(UnsupportedTensorError, match="'weight' is on the meta device"):
        Compressor(model, tmp_path / "a", QuantConfig(min_numel=256)).compress(1)
    with pytest.raises(UnsupportedTensorError, match="'weight' is on the meta device"):
        compress_state_dict(CheckpointStore(tmp_path / "b"), model.state_dict(), QuantConfig(min_numel=256))
    with pytest.raises(UnsupportedTensorError, match="'model/bias' is on the meta device"):
        compress_state_dict(CheckpointStore(tmp_path / "c"), {"bias": model.bias}, QuantConfig(min_numel=256))


def test_finite_checkpoints_do_not_warn(tmp_path: Path) -> None:
    model, opt = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Compressor(model, tmp_path, QuantConfig(min_numel=256), optimizer=opt).compress(1)


def test_sharded_plan_leaves_non_finite_tensors_out() -> None:
    """plan_sharded (one process here; the flags are summed over the ranks) as plan_quantization."""
    from hf_dynaquant.training.sharded import plan_sharded

    torch.manual_seed(0)
    local = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    local["b"][1, 1] = float("inf")
    shapes = {n: t.shape for n, t in local.items()}
    with pytest.warns(NonFiniteTensorWarning, match=r"'b' holds NaN or infinite values at step 9"):
        plan = plan_sharded(local, QuantConfig(), shapes=shapes, where="step 9")
    assert set(plan.tensors) == {"a"}
    with pytest.raises(NonFiniteTensorError, match="'b'"):
        plan_sharded(local, QuantConfig(non_finite="raise"), shapes=shapes)


def test_sharded_plan_ranks_by_magnitude_when_sensitivity_is_not_finite() -> None:
    """A NaN in a shard's sensitivity (summed over the ranks, so every rank agrees) makes that
    checkpoint rank by magnitude, with a warning naming the tensor, instead of a bare error."""
    from hf_dynaquant.training.sharded import plan_sharded

    torch.manual_seed(0)
    local = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    sens = {n: t.abs() for n, t in local.items()}
    sens["b"][0, 0] = float("nan")
    shapes = {n: t.shape for n, t in local.items()}
    config = QuantConfig(prune_by="sensitivity", prune=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_sharded(local, config, shapes=shapes, sensitivity=sens, where="step 3")
    assert [str(w.message)[:40] for w in caught] == [str(caught[0].message)[:40]]  # one warning, ours
    assert caught[0].category is NonFiniteTensorWarning and "'b'" in str(caught[0].message)
    assert "at step 3" in str(caught[0].message) and set(plan.tensors) == {"a", "b"}
