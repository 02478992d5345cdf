"""Transparency: without a restore, training with hf_dynaquant is bit-for-bit training without it.

Every integration (``DynaQuantTrainer``, ``Trainer`` + ``DynaQuantCallback``, the Accelerate plugin
and the plain-PyTorch ``Compressor``) is run against the same job without the package: a GPT-2
with dropout on (so every step draws from the global RNG), deterministic algorithms, one
intra-op thread, a fixed seed, checkpoints every few steps, with the configuration search on
and off and the background worker on and off. The final weights and optimizer state must be
bit-identical. The search runs on the background thread while training goes on, so any RNG
state it saved and restored there would rewind the training loop's dropout draws.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_dynaquant import Compressor, DynaQuantCallback, DynaQuantPlugin, DynaQuantTrainer
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.search import SearchSpace

STEPS, EVERY = 24, 6
SPACE = SearchSpace(bins=(4, 8, 16), prune=(0.2, 0.0), protect=(0.005,))
CONFIG = QuantConfig(min_numel=256)


@pytest.fixture(autouse=True)
def deterministic():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data():
    return docstring_lm_datasets(block=32, eval_blocks=16, max_blocks=400)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=CharTokenizer().vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.2
    )
    return GPT2LMHeadModel(config)


def assert_same(ours: dict, plain: dict) -> None:
    """Bit-identical weights and optimizer state."""
    assert ours["model"].keys() == plain["model"].keys() and ours["optimizer"].keys() == plain["optimizer"].keys()
    for name, t in ours["model"].items():
        assert torch.equal(t, plain["model"][name]), f"weight {name} differs from the plain run"
    for pid, st in ours["optimizer"].items():
        for key, t in st.items():
            assert torch.equal(t, plain["optimizer"][pid][key]), f"optimizer state {pid}/{key} differs"


def final(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state_dict()["state"].items()},
    }


# -- transformers.Trainer -------------------------------------------------------------------------


def trainer_args(out: Path, **kw) -> TrainingArguments:
    base = dict(
        max_steps=STEPS,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_steps=EVERY,
        logging_steps=EVERY,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        full_determinism=True,
    )
    base.update(kw)
    return TrainingArguments(str(out), **base)


@pytest.fixture(scope="module")
def plain_trainer(data, tmp_path_factory) -> dict:
    train, held = data
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        trainer = Trainer(model=gpt2(), args=trainer_args(tmp_path_factory.mktemp("plain")), train_dataset=train)
        trainer.train()
        torch.use_deterministic_algorithms(False)
    return final(trainer.model, trainer.optimizer)


@pytest.mark.parametrize(
    "kind, settings, args",
    [
        ("trainer", {}, {}),  # the defaults: search on, background on, eval dataset for the search
        ("trainer", {"background": False}, {}),
        ("trainer", {"threshold": None, "config": CONFIG}, {}),
        ("trainer", {}, {"save_strategy": "no"}),
        ("callback", {}, {}),  # plain Trainer + callback: the search takes the last training examples
        ("callback", {"threshold": None, "config": CONFIG, "background": False}, {}),
    ],
)
def test_trainer_runs_without_restore_are_the_plain_run(tmp_path, data, plain_trainer, kind, settings, args) -> None:
    train, held = data
    settings = {"search_space": SPACE, "config": CONFIG, "ema_steps": 3, **settings}
    cb = DynaQuantCallback(**settings)
    cls = DynaQuantTrainer if kind == "trainer" else Trainer
    extra = {"eval_dataset": held} if kind == "trainer" else {}
    trainer = cls(model=gpt2(), args=trainer_args(tmp_path, **args), train_dataset=train, callbacks=[cb], **extra)
    trainer.train()
    if args.get("save_strategy") != "no":
        assert len(cb.reports) + len(cb.plain_steps) == STEPS // EVERY  # each save compressed, or plain when busy
        if settings.get("threshold", 0.01) is not None:
            assert all(r.get("dynaquant/search_evaluations", 0) >= 1 for r in cb.reports)
    assert_same(final(trainer.model, trainer.optimizer), plain_trainer)


# -- Accelerate --------------------------------------------------------------------------------------


def accelerate_run(project: Path, batches: list, eval_batches: list, plugin: dict | None) -> dict:
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True, project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True)
    )
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    dq = None
    if plugin is not None:
        settings = {"eval_data": eval_batches, "search_space": SPACE, "config": CONFIG, "ema_steps": 3, **plugin}
        dq = DynaQuantPlugin(checkpoint_every=EVERY, **settings).attach(accelerator, model, optimizer)
    torch.manual_seed(1)  # dropout draws from here on
    model.train()
    for step in range(1, STEPS + 1):
        accelerator.backward(model(**batches[step % len(batches)]).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % EVERY == 0:
            accelerator.save_state()
    if dq is not None:
        dq.wait()
        assert len(dq.reports) + len(dq.plain_steps) == STEPS // EVERY
    return final(accelerator.unwrap_model(model), optimizer)


@pytest.mark.parametrize(
    "plugin", [{}, {"background": False}, {"threshold": None}], ids=["search-background", "search-fg", "fixed"]
)
def test_accelerate_runs_without_restore_are_the_plain_run(tmp_path, data, plugin) -> None:
    train, held = data
    batches = [train[i : i + 8] for i in range(0, 96, 8)]
    eval_batches = [held[0:8], held[8:16]]
    plain = accelerate_run(tmp_path / "plain", batches, eval_batches, None)
    assert_same(accelerate_run(tmp_path / "ours", batches, eval_batches, plugin), plain)


# -- plain PyTorch -------------------------------------------------------------------------------------


def compressor_run(store: Path | None, batches: list, eval_batches: list, search: bool) -> dict:
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compressor = None
    if store is not None:
        settings = {"threshold": 0.01, "eval_data": eval_batches, "search_space": SPACE} if search else {}
        compressor = Compressor(
            model, store, CONFIG, optimizer=optimizer, checkpoint_every=EVERY, ema_steps=3, **settings
        )
    torch.manual_seed(1)
    model.train()
    for step in range(1, STEPS + 1):
        model(**batches[step % len(batches)]).loss.backward()
        if compressor is not None:
            compressor.on_backward_pass_end()
        optimizer.step()
        if compressor is not None:
            compressor.before_gradient_flush()
        optimizer.zero_grad()
        if compressor is not None and step % EVERY == 0:
            compressor.compress(step)
    return final(model, optimizer)


@pytest.mark.parametrize("search", [True, False], ids=["search", "fixed"])
def test_compressor_runs_without_restore_are_the_plain_run(tmp_path, data, search) -> None:
    train, held = data
    batches = [train[i : i + 8] for i in range(0, 96, 8)]
    eval_batches = [held[0:8], held[8:16]]
    plain = compressor_run(None, batches, eval_batches, search)
    assert_same(compressor_run(tmp_path / "store", batches, eval_batches, search), plain)


def test_model_skeleton_is_filled_for_the_search_only(tiny_net) -> None:
    """The structure a background search evaluates is copied in the training thread once; it
    holds a snapshot's values only inside ``filled`` (ties kept), and is made again when the
    model's tensors change shape."""
    from hf_dynaquant.training.compressor import ModelSkeleton

    tiny_net.register_buffer("scratch", torch.arange(4.0), persistent=False)
    compressor = Compressor(tiny_net, None, CONFIG, threshold=0.5, metric=lambda m: 0.0)
    snap = compressor.snapshot(1, detach_model=True)
    skeleton = snap.model
    assert isinstance(skeleton, ModelSkeleton) and skeleton.module is not tiny_net
    assert all(p.numel() == 0 for p in skeleton.module.parameters())  # no copy held between searches
    with snap.search_model() as model:
        for name, t in model.state_dict().items():
            assert torch.equal(t, snap.state[name]) and t.data_ptr() != snap.state[name].data_ptr()
        assert model.out.weight is model.emb.weight and torch.equal(model.scratch, torch.arange(4.0))
    assert all(p.numel() == 0 for p in skeleton.module.parameters())
    assert snap.staged is None and snap.stream is None and snap.search_device is None  # a CPU model
    own = {"lin.weight": snap.state["lin.weight"].clone()}  # a staged copy the search may change
    with skeleton.filled(snap.state, own=own) as model:
        assert model.lin.weight.data_ptr() == own["lin.weight"].data_ptr()
        assert model.emb.weight.data_ptr() != snap.state["emb.weight"].data_ptr()
    assert compressor.snapshot(2, detach_model=True).model is skeleton  # reused
    tiny_net.lin = torch.nn.Linear(16, 32, bias=False)
    assert compressor.snapshot(3, detach_model=True).model is not skeleton  # the model changed
