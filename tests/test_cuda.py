"""The accelerator path: gradient EMA copies, sketches computed on the device, planning,
compressing and searching a model that lives on a GPU. Skipped without CUDA (CI has none);
run on a GPU machine with ``pytest tests/test_cuda.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_dynaquant import Compressor, QuantConfig
from hf_dynaquant.core.quantizer import plan_quantization
from hf_dynaquant.core.ranking import GradientEMA
from hf_dynaquant.core.sketch import LogSketch
from hf_dynaquant.search import ConfigurationSearch, QualityMetric, SearchSpace, mean_loss
from hf_dynaquant.store import CheckpointStore
from hf_dynaquant.training.compressor import read_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a GPU")


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_ema_cuda_matches_cpu(on_device: bool, dtype: torch.dtype) -> None:
    """Folded on the device (the default, with room) or copied to the host and folded there, the
    EMA of CUDA gradients is the CPU's, float32 whatever the gradients' dtype."""
    lin_gpu = torch.nn.Linear(64, 64).cuda().to(dtype)
    lin_cpu = torch.nn.Linear(64, 64).to(dtype)
    ema_gpu = GradientEMA(lin_gpu.named_parameters(), on_device=on_device)
    ema_cpu = GradientEMA(lin_cpu.named_parameters())
    for _ in range(3):
        g = torch.randn(64, 64).to(dtype)
        lin_gpu.weight.grad, lin_cpu.weight.grad = g.cuda(), g.clone()
        lin_gpu.bias.grad, lin_cpu.bias.grad = g[0].cuda(), g[0].clone()
        for e in (ema_gpu, ema_cpu):
            e.start()
            e.finish()
    for name in ("weight", "bias"):
        kept = ema_gpu.get(name)
        assert kept.is_cuda == on_device and kept.dtype == torch.float32
        torch.testing.assert_close(kept.cpu(), ema_cpu.get(name), rtol=1e-6, atol=1e-7)


def test_gradient_ema_without_room_on_the_device_goes_to_the_host(monkeypatch) -> None:
    """No room for the average on the device (here: a reserve of all its memory): the window's
    gradients are copied to the host and folded there; the next window decides again."""
    from hf_dynaquant.core import memory

    lin = torch.nn.Linear(16, 16).cuda()
    ema = GradientEMA(lin.named_parameters())
    monkeypatch.setattr(memory, "RESERVE", 1.0)
    lin.weight.grad, lin.bias.grad = torch.ones(16, 16, device="cuda"), torch.ones(16, device="cuda")
    ema.start()
    ema.finish()
    assert not ema.get("weight").is_cuda
    taken = ema.take()
    assert set(taken) == {"weight", "bias"} and not any(t.is_cuda for t in taken.values())
    monkeypatch.undo()
    ema.start()
    ema.finish()
    assert ema.get("weight").is_cuda


def test_gradient_ema_late_gradient_without_room_moves_the_window_to_the_host(monkeypatch) -> None:
    """A gradient that first arrives late in a window is given room like the first ones: without
    it, the averages already on the device move to the host, where the window goes on."""
    from hf_dynaquant.core import memory

    lin = torch.nn.Linear(16, 16).cuda()
    ema = GradientEMA(lin.named_parameters())
    lin.weight.grad = torch.ones(16, 16, device="cuda")
    ema.start()
    ema.finish()
    assert ema.get("weight").is_cuda and ema.get("bias") is None
    monkeypatch.setattr(memory, "RESERVE", 1.0)
    lin.weight.grad, lin.bias.grad = 3 * torch.ones(16, 16, device="cuda"), torch.ones(16, device="cuda")
    ema.start()
    ema.finish()
    assert not ema.get("weight").is_cuda and not ema.get("bias").is_cuda
    torch.testing.assert_close(ema.get("weight"), torch.full((256,), 0.1 + 0.9 * 3))


def test_gradient_ema_out_of_memory_on_the_device_goes_to_the_host() -> None:
    """Room checked, then taken by other work before the average is made (here: this process
    allowed almost none of the device): the fold falls back to the host for the window and
    training goes on, where an error would have ended a run that needs no memory of ours.
    The layer is large (a 64 MB weight) so that its average cannot come from memory torch's
    allocator already holds: a 4 MB one fitted in the free part of the weight's 20 MB block,
    where the fraction is never checked (session 44, H200)."""
    lin = torch.nn.Linear(4096, 4096).cuda()
    for p in lin.parameters():
        p.grad = torch.ones_like(p)
    ema = GradientEMA(lin.named_parameters())
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1e-6)
    try:
        ema.start()
        ema.finish()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert set(ema.ema) == {"weight", "bias"} and not any(t.is_cuda for t in ema.ema.values())
    torch.testing.assert_close(ema.get("bias"), torch.ones(4096))


def test_gradient_ema_larger_than_staging_buffer() -> None:
    """Tensors bigger than the pinned staging buffer are copied in pieces, in order."""
    from hf_dynaquant.core import ranking

    p_gpu = torch.nn.Parameter(torch.zeros(3 * ranking._STAGING // 2 + 5, device="cuda"))
    ema = GradientEMA([("p", p_gpu)], on_device=False)
    grads = [torch.randn(p_gpu.numel()) for _ in range(2)]
    for g in grads:
        p_gpu.grad = g.cuda()
        ema.start()
        ema.finish()
    torch.testing.assert_close(ema.get("p"), 0.9 * grads[1] + 0.1 * grads[0])


def test_sketch_on_cuda_matches_cpu() -> None:
    x = torch.randn(200_000) * torch.logspace(-6, 2, 200_000)
    x[::97] = 0
    cpu, gpu = LogSketch(0.01).add(x), LogSketch(0.01).add(x.cuda())
    assert cpu.count == gpu.count and cpu.zeros == gpu.zeros
    for a, b in zip(cpu.buckets(), gpu.buckets()):
        np.testing.assert_array_equal(a, b)
    qs = [0.001, 0.1, 0.5, 0.9, 0.999]
    np.testing.assert_array_equal(cpu.quantiles(qs), gpu.quantiles(qs))


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def test_plan_of_cuda_tensors_matches_cpu() -> None:
    model = _mlp()
    cfg = QuantConfig(bins=12, prune=0.2, protect=0.01, min_numel=256)
    state_cpu = dict(model.state_dict())
    state_gpu = {n: t.cuda() for n, t in state_cpu.items()}
    p_cpu, p_gpu = plan_quantization(state_cpu, cfg), plan_quantization(state_gpu, cfg)
    assert p_cpu.tensors.keys() == p_gpu.tensors.keys()
    for n, tp in p_cpu.tensors.items():
        np.testing.assert_array_equal(tp.centres, p_gpu.tensors[n].centres)
        assert tp.protect_magnitude == p_gpu.tensors[n].protect_magnitude
        assert tp.prune_threshold == p_gpu.tensors[n].prune_threshold


def test_compressor_on_cuda_model_round_trips_like_cpu(tmp_path) -> None:
    """A GPU model, its gradients and optimizer state compress to the same checkpoint values as
    the same job on the CPU, and restore onto the GPU."""
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    decoded = {}
    for dev in ("cpu", "cuda"):
        model = _mlp().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        comp = Compressor(
            model, tmp_path / dev, QuantConfig(bins=8, prune=0.1, prune_by="sensitivity", min_numel=256), optimizer=opt
        )
        for _ in range(3):
            torch.nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
            comp.on_backward_pass_end()
            opt.step()
            comp.before_gradient_flush()
            opt.zero_grad()
        comp.compress(3)
        fresh = _mlp(seed=1).to(dev)
        comp.restore(3, model=fresh)
        assert all(p.device.type == dev for p in fresh.parameters())
        decoded[dev] = {n: t.cpu() for n, t in fresh.state_dict().items()}
    for n, t in decoded["cpu"].items():
        # the training steps themselves differ in the last bits between devices; the codec
        # must not add more than one quantization level of difference
        assert torch.allclose(t, decoded["cuda"][n], atol=5e-2), n


def test_search_on_cuda_model_leaves_weights_bit_identical() -> None:
    model = _mlp().cuda()
    data = [(torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")) for _ in range(2)]

    def loss(m: torch.nn.Module) -> float:
        return float(sum(torch.nn.functional.cross_entropy(m(xb), yb) for xb, yb in data))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    snapshot = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    search = ConfigurationSearch(
        QualityMetric(loss),
        0.01,
        search_space=SearchSpace(bins=(4, 8, 16), prune=(0.3, 0.0), protect=(0.005,), prune_by=("magnitude",)),
        config=QuantConfig(min_numel=256),
    )
    result = search.search(model, snapshot)
    assert result.evaluations >= 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert mean_loss(data).fn(model) == pytest.approx(loss(model) / 2, rel=1e-5)


def test_search_measures_on_the_device_as_on_the_host(monkeypatch) -> None:
    """The search of a GPU model sizes and decodes its candidates on the device (with
    sensitivities and stochastic rounding); it chooses, sizes and judges exactly as when every
    candidate is measured on the host."""
    from hf_dynaquant.search.measures import DeviceTensors

    model = _mlp().cuda()
    data = [(torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")) for _ in range(2)]
    metric = QualityMetric(lambda m: float(sum(torch.nn.functional.cross_entropy(m(x), y) for x, y in data)))
    snapshot = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    sensitivity = {n: (t * torch.randn(t.shape, generator=g)).abs() for n, t in snapshot.items()}
    space = SearchSpace(bins=(4, 8, 16), prune=(0.3, 0.0), protect=(0.005,))
    results, made = [], []
    real_of = DeviceTensors.of.__func__

    def of(cls, *args):  # records whether the device measured
        made.append(real_of(cls, *args))
        return made[-1]

    monkeypatch.setattr(DeviceTensors, "of", classmethod(of))
    for _ in range(2):
        search = ConfigurationSearch(
            metric, 0.01, search_space=space, config=QuantConfig(min_numel=256, rounding="stochastic", rounding_seed=3)
        )
        results.append(search.search(model, snapshot, sensitivity=sensitivity))
        monkeypatch.setattr(DeviceTensors, "of", classmethod(lambda cls, *args: None))
    assert made and made[0] is not None
    device, host = results
    assert device.config == host.config and device.evaluations == host.evaluations >= 1
    for a, b in zip(device.candidates, host.candidates):
        assert (a.config, a.bits, a.degradation) == (b.config, b.bits, b.degradation)


def _trained(dev: str = "cuda") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP on ``dev`` after two AdamW steps (so it has moments to snapshot)."""
    model = _mlp().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 64, device=dev), torch.randint(0, 10, (64,), device=dev)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_background_snapshot_is_staged_on_the_device_and_settles_to_the_host_copy(tmp_path) -> None:
    """A detached snapshot of a GPU model is a copy on the device (training goes on changing the
    live weights meanwhile); settled, it is bit for bit the host snapshot taken at the same
    moment, and writes the same stored bytes."""
    model, opt = _trained()
    config = QuantConfig(bins=8, prune=0.1, min_numel=256)
    staged = Compressor(model, tmp_path / "staged", config, optimizer=opt)
    host = Compressor(model, tmp_path / "host", config, optimizer=opt, use_accelerator=False)
    for comp in (staged, host):  # a window of gradients: kept on the device by the staged one alone
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        comp.on_backward_pass_end()
        comp.before_gradient_flush()
    assert all(t.is_cuda for t in staged.ema.ema.values()) and not any(t.is_cuda for t in host.ema.ema.values())
    snap, plain = staged.snapshot(1, detach_model=True), host.snapshot(1, detach_model=True)
    assert snap.staged is not None and plain.staged is None
    assert all(t.is_cuda for t in snap.state.values()) and not any(t.is_cuda for t in plain.state.values())
    assert all(t.is_cuda for t in snap.gradient_ema.values())
    assert not any(t.is_cuda for t in plain.gradient_ema.values())
    with torch.no_grad():  # training goes on before the background settles the snapshot
        for p in model.parameters():
            p.add_(1.0)
            p.grad.add_(1.0)
    snap.settle()
    assert snap.staged is None and snap.device_state is None  # no search: nothing kept on the device
    for name, t in plain.state.items():
        assert not snap.state[name].is_cuda and torch.equal(snap.state[name], t), name
    assert snap.gradient_ema.keys() == plain.gradient_ema.keys()
    for name, t in plain.gradient_ema.items():
        assert not snap.gradient_ema[name].is_cuda and torch.equal(snap.gradient_ema[name], t), name
    assert snap.state["0.weight"] is not plain.state["0.weight"]
    for pid, moments in plain.optimizer["state"].items():
        for key, t in moments.items():
            assert torch.equal(snap.optimizer["state"][pid][key], t), (pid, key)
    staged.write(snap)
    host.write(plain)
    weights = [read_checkpoint(CheckpointStore(tmp_path / d), "step-1")[0] for d in ("staged", "host")]
    for name, t in weights[1].items():
        assert torch.equal(weights[0][name], t), name


def test_background_search_evaluates_on_the_device_and_releases_it() -> None:
    """The search of a detached snapshot of a GPU model evaluates a copy on the device (not the
    live model, not the CPU), leaves the live weights alone and gives the device memory back."""
    model, _ = _trained()
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(2)]
    seen: list[torch.device] = []

    def loss(m: torch.nn.Module) -> float:
        seen.append(next(m.parameters()).device)
        assert m is not model
        dev = seen[-1]
        return float(sum(torch.nn.functional.cross_entropy(m(x.to(dev)), y.to(dev)) for x, y in data))

    space = SearchSpace(bins=(4, 8, 16), prune=(0.3, 0.0), protect=(0.005,), prune_by=("magnitude",))
    comp = Compressor(model, None, QuantConfig(min_numel=256), threshold=0.01, metric=loss, search_space=space)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    allocated = []
    for step in (1, 2):  # the first search also makes its stream's cuBLAS workspace (kept)
        snap = comp.snapshot(step, detach_model=True)
        assert snap.search_device == next(model.parameters()).device and snap.state["0.weight"].is_cuda
        result = comp.search_snapshot(snap)
        assert result.evaluations >= 1 and seen and all(d.type == "cuda" for d in seen)
        assert snap.device_state is None and not snap.state["0.weight"].is_cuda
        del snap
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[0]  # the staged copy and the search's copy are gone
    assert all(p.numel() == 0 for p in comp._skeleton.module.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    off = Compressor(
        model, None, QuantConfig(min_numel=256), threshold=0.01, metric=loss, search_space=space, use_accelerator=False
    )
    seen.clear()
    off.search_snapshot(off.snapshot(1, detach_model=True))
    assert seen and all(d.type == "cpu" for d in seen)


def test_device_without_room_snapshots_to_the_host(monkeypatch) -> None:
    """Without room on the device (here: a reserve of all its memory) the snapshot is copied to
    the host and the search evaluates a CPU copy, as with use_accelerator=False."""
    from hf_dynaquant.core import memory

    monkeypatch.setattr(memory, "RESERVE", 1.0)
    model, opt = _trained()
    comp = Compressor(model, None, QuantConfig(min_numel=256), optimizer=opt, threshold=0.01, metric=lambda m: 0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    comp.on_backward_pass_end()
    comp.before_gradient_flush()
    snap = comp.snapshot(1, detach_model=True)
    assert snap.staged is None and snap.search_device is None
    assert not any(t.is_cuda for t in snap.state.values())
    assert snap.gradient_ema and not any(t.is_cuda for t in snap.gradient_ema.values())


class _Blocks(torch.utils.data.Dataset):
    """Character blocks of random text as Trainer batches (no ``datasets`` needed on a GPU box)."""

    def __init__(self, n: int = 256, block: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 97, (n, block), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_on_cuda_saves_in_background_and_resumes(tmp_path) -> None:
    """DynaQuantTrainer with a model on the GPU: gradients copied off the device, the snapshot
    staged on the device and the search evaluated there in the background, resume onto the GPU
    with the decoded weights."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
    from hf_dynaquant.training.checkpoint_dir import checkpoint_store

    def model() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=2))

    def args(steps: int) -> TrainingArguments:
        return TrainingArguments(
            str(tmp_path), max_steps=steps, per_device_train_batch_size=8, save_steps=4, report_to=[], seed=0
        )

    space = SearchSpace(bins=(4, 8, 16), prune=(0.2, 0.0), protect=(0.005,), prune_by=("magnitude", "sensitivity"))
    # "wait": on a GPU four steps take milliseconds, and the default ("plain") would save step 8
    # uncompressed while step 4 is still being encoded; this test is about the compressed path
    cb = DynaQuantCallback(
        0.02, search_space=space, config=QuantConfig(min_numel=1024), ema_steps=2, busy_saves="wait"
    )
    trainer = DynaQuantTrainer(
        model=model(), args=args(8), train_dataset=_Blocks(), eval_dataset=_Blocks(32), callbacks=[cb]
    )
    trainer.train()
    assert next(trainer.model.parameters()).is_cuda and [r["step"] for r in cb.reports] == [4, 8]
    weights, opt_state, meta = read_checkpoint(checkpoint_store(tmp_path), "checkpoint-8")
    assert meta["search"]["evaluations"] >= 1 and opt_state is not None
    resumed = DynaQuantTrainer(
        model=model(), args=args(8), train_dataset=_Blocks(), callbacks=[DynaQuantCallback(None)]
    )
    resumed._load_from_checkpoint(str(tmp_path / "checkpoint-8"))
    for name, t in resumed.model.state_dict().items():
        assert torch.equal(t.cpu(), weights[name]), name
