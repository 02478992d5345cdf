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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a GPU")


def test_gradient_ema_cuda_matches_cpu() -> None:
    lin_gpu = torch.nn.Linear(64, 64).cuda()
    lin_cpu = torch.nn.Linear(64, 64)
    ema_gpu, ema_cpu = GradientEMA(lin_gpu.named_parameters()), GradientEMA(lin_cpu.named_parameters())
    for _ in range(3):
        g = torch.randn(64, 64)
        lin_gpu.weight.grad, lin_cpu.weight.grad = g.cuda(), g.clone()
        lin_gpu.bias.grad, lin_cpu.bias.grad = g[0].cuda(), g[0].clone()
        for e in (ema_gpu, ema_cpu):
            e.start()
            e.finish()
    torch.testing.assert_close(ema_gpu.get("weight"), ema_cpu.get("weight"))
    torch.testing.assert_close(ema_gpu.get("bias"), ema_cpu.get("bias"))


def test_gradient_ema_larger_than_staging_buffer() -> None:
    """Tensors bigger than the pinned staging buffer are copied in pieces, in order."""
    from hf_dynaquant.core import ranking

    p_gpu = torch.nn.Parameter(torch.zeros(3 * ranking._STAGING // 2 + 5, device="cuda"))
    ema = GradientEMA([("p", p_gpu)])
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
    """DynaQuantTrainer with a model on the GPU: gradients copied off the device, the search on
    a CPU copy in the background, resume onto the GPU with the decoded weights."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
    from hf_dynaquant.training.checkpoint_dir import checkpoint_store
    from hf_dynaquant.training.compressor import read_checkpoint

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
