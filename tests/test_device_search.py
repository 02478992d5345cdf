"""The search where the model lives (TensorPlan.device_codes, device_decoded, the rounding's
device_uniform and device_stochastic_codes, hf_dynaquant.search.measures, the planner's sketches
on an accelerator): the torch ops give the compiled kernels' codes, protected values, decoded
values and sizes bit for bit, and the search the same choices. Run on the CPU here, and on a GPU
when one is present (CI has none; on a GPU machine ``pytest tests/test_device_search.py tests/test_cuda.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dynaquant.core.quantizer import (
    QuantConfig,
    TensorPlan,
    decoded_values,
    device_decoded,
    plan_quantization,
    quantize,
)
from hf_dynaquant.core.rounding import device_uniform, uniform
from hf_dynaquant.search.configuration import _code_totals, _evaluate
from hf_dynaquant.search.measures import DeviceTensors
from hf_dynaquant.search.quality import QualityMetric

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_numbers_equal_splitmix(device: str) -> None:
    for seed, offset in [(0, 0), (7, 123_456), ((1 << 64) - 1, (1 << 40) + 3), (0x9E3779B97F4A7C15, 5)]:
        on_device = device_uniform(seed, offset, 5000, torch.device(device)).cpu().numpy()
        np.testing.assert_array_equal(on_device, uniform(seed, offset, 5000))


def _random_plan(rng: np.random.Generator, w: np.ndarray, sens: np.ndarray | None) -> TensorPlan:
    """A plan with random thresholds, some of them exactly a value of ``w`` (ties), some not
    float32 numbers; random pruning criterion and rounding."""
    magnitudes = np.abs(w)
    k = int(rng.integers(1, 40))
    centres = np.sort(rng.standard_normal(k).astype(np.float32) * float(magnitudes.max() or 1))

    def threshold(q: float, values: np.ndarray) -> float:
        if rng.random() < 0.3:
            return float(values[int(rng.integers(values.size))])  # a tie
        return float(np.quantile(values, q)) * (1 + 1e-9)  # between two float32 numbers

    return TensorPlan(
        "linear",
        centres,
        threshold(rng.uniform(0.5, 1.0), magnitudes),
        threshold(0.9, sens) if sens is not None and rng.random() < 0.7 else None,
        threshold(rng.uniform(0.0, 0.5), magnitudes) if rng.random() < 0.7 else None,
        "sensitivity" if sens is not None and rng.random() < 0.5 else "magnitude",
        sensitivity=None if sens is None else (lambda: torch.from_numpy(sens)),
        dither_seed=int(rng.integers(0, 2**63)) if rng.random() < 0.5 else None,
        dither_offset=int(rng.integers(0, 10**6)),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_codes_and_decoded_values_equal_the_kernels(device: str) -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 5000))
        w = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 100.0])).astype(np.float32)
        sens = np.abs(rng.standard_normal(n)).astype(np.float32) if rng.random() < 0.5 else None
        if sens is not None:
            sens[:5] = 0
        plan = _random_plan(rng, w, sens)
        mids = (plan.centres[1:] + plan.centres[:-1]) / 2
        ties = np.concatenate([mids, plan.centres, [0.0, -0.0]]).astype(np.float32)
        w[: min(n, 20)] = rng.choice(ties, min(n, 20))  # values exactly on a midpoint, a centre, zero
        codes, protected = quantize(torch.from_numpy(w), plan)
        on = torch.device(device)
        d_codes, d_protected = plan.device_codes(
            torch.from_numpy(w).to(on), None if sens is None else torch.from_numpy(sens).to(on)
        )
        np.testing.assert_array_equal(d_codes.cpu().numpy(), codes, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(d_protected.cpu().view(torch.int16).numpy().view(np.uint16), protected)
        reference = rng.standard_normal(n).astype(np.float32) if trial % 2 else None
        values = decoded_values(codes, plan.centres, protected, reference)
        d_values = device_decoded(
            d_codes, plan.centres, d_protected, None if reference is None else torch.from_numpy(reference).to(on)
        )
        np.testing.assert_array_equal(d_values.cpu().numpy().view(np.uint32), values.view(np.uint32))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual", ["none", "previous"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_candidates_measure_alike_on_the_device_and_the_host(device: str, residual: str, rounding: str) -> None:
    """A candidate's size (with the base entry's codes) and evaluation (decoded values written
    into the model, their error) are the same measured on the device as on the host pool, and
    the model's weights are its own again after."""
    model = _model().to(device)
    snapshot = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    sensitivity = {n: (t * torch.randn(t.shape, generator=g)).abs() for n, t in snapshot.items()}
    previous = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in snapshot.items()}
    config = QuantConfig(
        bins=8, prune=0.2, protect=0.01, prune_by="sensitivity", min_numel=256, residual=residual, rounding=rounding
    )
    plan = plan_quantization(snapshot, config, sensitivity=sensitivity, reference=previous)
    assert plan.tensors and all(tp.residual == residual for tp in plan.tensors.values())
    base_plan = plan_quantization(previous, QuantConfig(bins=8, min_numel=256))
    base = {n: quantize(snapshot[n], tp)[0] for n, tp in base_plan.tensors.items()}
    on_device = DeviceTensors({n: p for n, p in model.named_parameters()}, base)
    assert DeviceTensors.takes(plan)
    np.testing.assert_array_equal(_code_totals(snapshot, plan, base, on_device), _code_totals(snapshot, plan, base))
    written: list[dict[str, torch.Tensor]] = []

    def weights(m: torch.nn.Module) -> float:
        written.append({n: p.detach().cpu().clone() for n, p in m.named_parameters()})
        return 0.0

    metric = QualityMetric(weights)
    host = _evaluate(model, snapshot, plan, metric, False, base)[1]
    there = _evaluate(model, snapshot, plan, metric, False, base, on_device)[1]
    np.testing.assert_array_equal(host[:2], there[:2])
    np.testing.assert_allclose(host[2:], there[2:], rtol=1e-12)  # float64 sums, summed in another order
    for n in snapshot:
        assert torch.equal(written[0][n], written[1][n]), n
        assert torch.equal(model.get_parameter(n).cpu(), snapshot[n]), n
    assert any(not torch.equal(written[0][n], snapshot[n]) for n in plan.tensors)


@pytest.fixture
def cpu_as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path run with CPU tensors (CI has no GPU): ``on_accelerator`` answers the
    CPU too, so the planner sketches in the calling thread with the torch partition, and the
    search measures with :class:`DeviceTensors`."""
    from hf_dynaquant.core import quantizer
    from hf_dynaquant.search import measures

    def one_device(tensors):
        devices = {t.device for t in tensors}
        return devices.pop() if len(devices) == 1 else None

    monkeypatch.setattr(quantizer, "on_accelerator", one_device)
    monkeypatch.setattr(measures, "on_accelerator", one_device)


@pytest.mark.parametrize("room", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_search_on_the_accelerator_path_chooses_as_on_the_host(
    cpu_as_accelerator, monkeypatch: pytest.MonkeyPatch, rounding: str, room: bool
) -> None:
    """The whole search through the accelerator path (plans sketched in the calling thread,
    candidates measured by DeviceTensors; here on the CPU) plans, sizes, judges and chooses
    exactly as the host path, residuals against the last checkpoint and its codes included.
    Without room on the device for the sensitivities (and references, base codes), the tensors
    that need them are sketched and measured on the host instead, with the same result."""
    from hf_dynaquant.core import quantizer
    from hf_dynaquant.search import measures

    if not room:
        monkeypatch.setattr(quantizer, "cached_on_device", lambda *args: None)
        monkeypatch.setattr(measures, "cached_on_device", lambda *args: None)
    from hf_dynaquant.search import ConfigurationSearch, SearchSpace
    from hf_dynaquant.search.space import Reference

    model = _model()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    metric = QualityMetric(lambda m: float(torch.nn.functional.mse_loss(m(x), x)))
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    sensitivity = {n: (t * torch.randn(t.shape, generator=g)).abs() for n, t in snapshot.items()}
    previous = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in snapshot.items()}
    references = {"previous": Reference(previous, {n: (s * 0.5) for n, s in sensitivity.items()})}
    base_plan = plan_quantization(previous, QuantConfig(bins=8, min_numel=256))
    base = {n: quantize(snapshot[n], tp)[0] for n, tp in base_plan.tensors.items()}
    space = SearchSpace(bins=(4, 8, 16), prune=(0.3, 0.0), protect=(0.005, 0.0), residuals=("previous", "none"))
    config = QuantConfig(min_numel=256, rounding=rounding, rounding_seed=3)
    calls: list[str] = []
    real = TensorPlan.device_codes

    def counted(plan: TensorPlan, *args, **kwargs):  # the planner's sketches probe without centres
        calls.append("candidate" if plan.centres.size else "planner")
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(TensorPlan, "device_codes", counted)
    results = []
    for accelerated in (True, False):
        if not accelerated:  # the host path: no accelerator anywhere
            assert set(calls) == ({"candidate", "planner"} if room else set())  # every tensor has a sensitivity
            calls.clear()
            monkeypatch.setattr(quantizer, "on_accelerator", lambda tensors: None)
            monkeypatch.setattr(measures, "on_accelerator", lambda tensors: None)
        search = ConfigurationSearch(metric, 0.05, search_space=space, config=config)
        results.append(search.search(model, snapshot, sensitivity=sensitivity, references=references, base_codes=base))
    assert not calls
    device, host = results
    assert device.config == host.config and device.evaluations == host.evaluations >= 2 and device.sized == host.sized
    for a, b in zip(device.candidates, host.candidates):
        assert (a.config, a.bits, a.degradation, a.weight_error) == (b.config, b.bits, b.degradation, b.weight_error)
    for n, tp in host.plan.tensors.items():
        np.testing.assert_array_equal(device.plan.tensors[n].centres, tp.centres)
