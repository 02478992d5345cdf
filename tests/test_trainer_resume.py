"""DynaQuantTrainer held to the Trainer's own resume behaviours (transformers'
``tests/trainer/test_trainer_checkpointing.py``): a resumed run ends where an uninterrupted run
ends (weights, trainer state, log history), from a given or the last checkpoint, with gradient
accumulation, frozen parameters, another or an automatic batch size, ``load_best_model_at_end``,
``save_total_limit`` keeping the best, and JIT (SIGTERM) checkpoints; with models that return a
``ModelOutput``, a tuple or a dict. The threshold search is on (the default callback).

What "equal" means: the models here are small enough that every tensor is stored losslessly
(below ``QuantConfig.min_numel``), so a resumed run must equal the uninterrupted run bit for bit,
as with the stock Trainer. With lossy tensors a resume cannot equal the uninterrupted run (the
run goes on from the decoded weights); there the bar is the stock Trainer resumed from the same
decoded checkpoint (``materialize``), which the DynaQuantTrainer resume must equal exactly."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_args import args_for as shared_args_for  # tests/ is on sys.path (rootdir conftest)
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

import hf_dynaquant
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.errors import IncompleteCheckpointError, InvalidSettingError, NoValidCheckpointError
from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.search import mean_loss
from hf_dynaquant.training.checkpoint_dir import checkpoint_store, read_marker
from hf_dynaquant.training.compressor import read_checkpoint

KINDS = ("model_output", "tuple", "dict")
# keys whose values are wall-clock figures (transformers' check_trainer_state_are_the_same skips them too)
TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")


class Net(nn.Module):
    """A small regression model whose forward returns its loss as a ``ModelOutput``, a tuple
    (loss first, as Trainer.compute_loss reads it) or a dict."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.hidden = nn.Linear(4, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        y = self.head(torch.tanh(self.hidden(x))).squeeze(-1)
        loss = None if labels is None else nn.functional.mse_loss(y, labels)
        if self.kind == "tuple":
            return (y,) if loss is None else (loss, y)
        if self.kind == "dict":
            return {"logits": y} if loss is None else {"loss": loss, "logits": y}
        return SequenceClassifierOutput(loss=loss, logits=y)


def dataset(n: int = 96, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


TRAIN, EVAL = dataset(), dataset(32, seed=2)


def args_for(out: Path, **kw) -> TrainingArguments:
    """The shared arguments at a learning rate that moves the tiny model visibly."""
    return shared_args_for(out, **{"learning_rate": 0.05, **kw})


def trainer_for(
    out: Path, kind: str = "model_output", *, callbacks=(), model=None, busy_saves: str = "wait", **kw
) -> DynaQuantTrainer:
    """A DynaQuantTrainer with the default callback (threshold search on, ema over 2 steps);
    every save compressed (``busy_saves="wait"``) unless a test looks at saves the encoder is
    too busy for."""
    return DynaQuantTrainer(
        model=model or Net(kind),
        args=args_for(out, **kw),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        callbacks=[DynaQuantCallback(ema_steps=2, busy_saves=busy_saves), *callbacks],
    )


class StopAt(TrainerCallback):
    """Interrupt training after the save of step ``step`` (a kill, as far as the next run sees)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def assert_same_run(whole: Trainer, resumed: Trainer) -> None:
    """Weights, trainer state and log history of a resumed run equal an uninterrupted run's, as
    transformers' ``check_trainer_state_are_the_same`` compares them (timings aside)."""
    for name, t in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], t), name
    state, state1 = dataclasses.asdict(whole.state), dataclasses.asdict(resumed.state)
    history, history1 = state.pop("log_history"), state1.pop("log_history")
    assert state == state1
    strip = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]
    strip1 = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history1]
    assert strip == strip1


def test_resume_from_given_and_last_checkpoint(tmp_path) -> None:
    whole = trainer_for(tmp_path / "a")
    whole.train()
    assert all(read_marker(tmp_path / "a" / f"checkpoint-{s}") for s in (4, 8, 12))  # compressed
    assert not any("dynaquant/ratio" in h for h in whole.state.log_history)  # figures kept out of it
    assert [r["step"] for r in whole.dynaquant.reports] == [4, 8, 12]
    given = trainer_for(tmp_path / "a")
    given.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert_same_run(whole, given)

    trainer_for(tmp_path / "b", callbacks=[StopAt(8)]).train()
    last = trainer_for(tmp_path / "b")
    last.train(resume_from_checkpoint=True)  # the newest complete checkpoint: checkpoint-8
    assert [r["step"] for r in last.dynaquant.reports] == [12]
    assert_same_run(whole, last)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_models_returning_tuples_and_dicts_resume(tmp_path, kind) -> None:
    """The default metric reads the loss as the Trainer does, for every output type."""
    whole = trainer_for(tmp_path / "a", kind)
    whole.train()
    assert all(r["config"] is not None or r["dynaquant/search_evaluations"] >= 0 for r in whole.dynaquant.reports)
    resumed = trainer_for(tmp_path / "a", kind)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-8"))
    assert_same_run(whole, resumed)


def test_mean_loss_reads_every_output_type_without_a_trainer() -> None:
    """Without a trainer the default metric reads a ModelOutput's, a dict's or a tuple's loss;
    a model that returns none raises a clear error."""
    batches = [{"x": torch.stack([b["x"] for b in EVAL]), "labels": torch.stack([b["labels"] for b in EVAL])}]
    values = {kind: mean_loss(batches)(Net(kind)) for kind in KINDS}
    assert len(set(values.values())) == 1 and values["tuple"] > 0
    with pytest.raises(InvalidSettingError, match="returned no loss"):
        mean_loss([{"x": batches[0]["x"]}])(Net("dict"))


def test_search_uses_the_trainers_own_compute_loss(tmp_path) -> None:
    """A custom ``compute_loss`` is the loss the search measures, on the search's model copy."""
    seen = []

    class Custom(DynaQuantTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not model.training:  # the search evaluates in eval mode
                seen.append(model is self.model)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Custom(
        model=Net("tuple"),
        args=args_for(tmp_path, max_steps=4),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        callbacks=[DynaQuantCallback(ema_steps=2, busy_saves="wait")],
    )
    trainer.train()
    assert seen and not any(seen)  # called, on the detached CPU copy, never on the live model


def test_resume_with_gradient_accumulation(tmp_path) -> None:
    kw = dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)
    whole = trainer_for(tmp_path, "dict", **kw)
    whole.train()
    resumed = trainer_for(tmp_path, "dict", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert_same_run(whole, resumed)


def test_resume_with_frozen_params(tmp_path) -> None:
    whole = trainer_for(tmp_path, "tuple")
    whole.model.hidden.weight.requires_grad_(False)
    whole.train()
    resumed = trainer_for(tmp_path, "tuple")
    resumed.model.hidden.weight.requires_grad_(False)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert not resumed.model.hidden.weight.requires_grad
    assert torch.equal(resumed.model.hidden.weight, Net("tuple").hidden.weight)  # never trained
    assert_same_run(whole, resumed)


def test_resume_with_a_different_batch_size(tmp_path) -> None:
    trainer_for(tmp_path, max_steps=2, save_steps=1, per_device_train_batch_size=2).train()
    again = trainer_for(tmp_path, max_steps=4, save_steps=1, per_device_train_batch_size=4)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert again._train_batch_size == 4 and again.state.global_step == 4
    assert read_marker(tmp_path / "checkpoint-4") is not None


class OutOfMemoryAt(TrainerCallback):
    """Raise the error ``auto_find_batch_size`` halves the batch size on, while it is >= ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= self.limit:
            raise RuntimeError("CUDA out of memory.")


def test_resume_with_automatic_batch_size(tmp_path) -> None:
    kw = dict(max_steps=2, save_steps=1, per_device_train_batch_size=16, auto_find_batch_size=True)
    found = trainer_for(tmp_path, callbacks=[OutOfMemoryAt(16)], **kw)
    found.train()
    assert found._train_batch_size < 16
    again = trainer_for(tmp_path, **kw)
    again.train(resume_from_checkpoint=True)
    assert again._train_batch_size == found._train_batch_size  # taken from the checkpoint


def test_no_checkpoint_raises_the_trainers_error(tmp_path) -> None:
    trainer = trainer_for(tmp_path)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory") as caught:
        trainer.train(resume_from_checkpoint=True)
    assert isinstance(caught.value, NoValidCheckpointError) and isinstance(caught.value, IncompleteCheckpointError)


def best_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    best = Path(trainer.state.best_model_checkpoint)
    weights, _, _ = read_checkpoint(checkpoint_store(best.parent), best.name)
    return weights


@pytest.mark.parametrize("limit", [None, 1])
def test_load_best_model_at_end_and_save_total_limit_keeps_the_best(tmp_path, limit) -> None:
    kw = dict(eval_strategy="steps", eval_steps=4, load_best_model_at_end=True, save_total_limit=limit)
    trainer = trainer_for(tmp_path, "dict", **kw)
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert best.is_dir() and read_marker(best) is not None
    for name, t in best_weights(trainer).items():
        assert torch.equal(trainer.model.state_dict()[name], t), name
    assert trainer.evaluate()["eval_loss"] == trainer.state.best_metric
    if limit == 1:  # the best and the last folder are kept, both resumable
        kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
        assert best.name in kept and "checkpoint-12" in kept
        resumed = trainer_for(tmp_path, "dict", **kw)
        resumed.train(resume_from_checkpoint=str(best))
        assert resumed.state.global_step == 12


class RequestJitAt(TrainerCallback):
    """What SIGTERM does once JIT's kill wait is over: set the request flag (after ``step``)."""

    def __init__(self, step: int) -> None:
        self.step, self.trainer = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            jit = next(c for c in self.trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback))
            jit.jit_manager.is_checkpoint_requested = True


@pytest.mark.filterwarnings("ignore:no gradients were recorded")  # a JIT save comes outside the EMA window
def test_jit_checkpoint_is_compressed_and_resumes(tmp_path) -> None:
    """A SIGTERM checkpoint (the Trainer sends no on_save for it) is compressed like any other
    and the run resumed from it ends as the uninterrupted run."""
    whole = trainer_for(tmp_path / "a")
    whole.train()
    request = RequestJitAt(6)
    killed = trainer_for(tmp_path / "b", callbacks=[request], enable_jit_checkpoint=True)
    request.trainer = killed
    killed.train()
    jit = tmp_path / "b" / "checkpoint-6"  # taken as step 7 begins; the Trainer stops after step 7
    assert killed.state.global_step < 8 and read_marker(jit) is not None
    assert not (jit / "model.safetensors").exists() and not (jit / "checkpoint-is-incomplete.txt").exists()
    resumed = trainer_for(tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)
    for name, t in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], t), name


@pytest.mark.slow
def test_lossy_resume_equals_the_trainer_resumed_from_the_decoded_checkpoint(tmp_path) -> None:
    """With tensors that are quantized, the resumed run equals the stock Trainer resumed from the
    same checkpoint decoded to plain files (weights, optimizer state, trainer state, logs)."""
    kw = dict(model=Net("model_output", width=64))
    lossy = DynaQuantCallback(ema_steps=2, config=QuantConfig(min_numel=256), busy_saves="wait")
    whole = DynaQuantTrainer(
        model=kw["model"], args=args_for(tmp_path / "a"), train_dataset=TRAIN, eval_dataset=EVAL, callbacks=[lossy]
    )
    whole.train()
    assert whole.dynaquant.reports[0]["config"] is not None  # the search chose a lossy configuration
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    ours = DynaQuantTrainer(
        model=Net("model_output", width=64),
        args=args_for(tmp_path / "a", save_strategy="no"),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        callbacks=[DynaQuantCallback(ema_steps=2, config=QuantConfig(min_numel=256), busy_saves="wait")],
    )
    ours.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    plain = hf_dynaquant.materialize(tmp_path / "b" / "checkpoint-4")
    stock = Trainer(
        model=Net("model_output", width=64),
        args=args_for(tmp_path / "b", save_strategy="no"),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
    )
    stock.train(resume_from_checkpoint=str(plain))
    assert_same_run(stock, ours)
    assert not torch.equal(ours.model.hidden.weight, whole.model.hidden.weight)  # the resume was lossy


class HoldEncoder(TrainerCallback):
    """Holds the background encoder on its first checkpoint until the save of step ``release``
    (and lets it finish before every later save), so saves in between arrive while it is busy, as with saves every
    step on a model whose encoding takes longer than a step. The gate is a wrapper on our own
    compressor's ``write``: nothing of transformers or torch is replaced."""

    def __init__(self, trainer: DynaQuantTrainer, release: int) -> None:
        self.trainer, self.release, self.gate = trainer, release, __import__("threading").Event()
        self.averages: dict[int, int] = {}  # step -> gradient averages still held after its save

    def on_train_begin(self, args, state, control, **kwargs):
        compressor = self.trainer.dynaquant.manager.compressor
        write = compressor.write

        def held(*a, **kw):
            self.gate.wait(timeout=60)
            return write(*a, **kw)

        compressor.write = held

    def on_save(self, args, state, control, **kwargs):
        self.averages[state.global_step] = len(self.trainer.dynaquant.manager.compressor.ema.ema)
        if state.global_step == self.release:
            self.gate.set()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.release:  # later saves find the encoder idle
            self.trainer.dynaquant.wait()


def test_saves_faster_than_the_encoder_are_plain_and_resumable(tmp_path) -> None:
    """A save that arrives while the previous checkpoint is still encoding is the Trainer's own
    plain save (no wait for the encoder, no second snapshot), recorded; the run resumes from it."""
    trainer = trainer_for(tmp_path, max_steps=5, save_steps=1, busy_saves="plain")  # (the default)
    trainer.add_callback(hold := HoldEncoder(trainer, release=3))
    trainer.train()
    manager = trainer.dynaquant.manager
    assert manager.plain_steps == [2, 3]
    # every save, plain ones too, lets its window's gradient average go (on a GPU it is device memory)
    assert hold.averages == {step: 0 for step in range(1, 6)}
    for step in (1, 4, 5):  # compressed: a marker, no weights of the Trainer's
        folder = tmp_path / f"checkpoint-{step}"
        assert read_marker(folder) is not None and not (folder / "model.safetensors").exists(), step
    for step in (2, 3):  # the Trainer's own checkpoint, complete
        folder = tmp_path / f"checkpoint-{step}"
        assert read_marker(folder) is None and (folder / "model.safetensors").exists(), step
        assert (folder / "optimizer.pt").exists() and (folder / "trainer_state.json").exists()
    assert [r["step"] for r in trainer.dynaquant.reports] == [1, 4, 5]
    keyframes = [r["dynaquant/keyframe"] for r in trainer.dynaquant.reports]
    assert keyframes == [1.0, 0.0, 0.0]  # the chain goes on from checkpoint-1 across the plain saves

    resumed = trainer_for(tmp_path, max_steps=5, save_steps=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))  # a plain one
    for name, t in trainer.model.state_dict().items():  # the tiny model is stored losslessly: exact
        assert torch.equal(resumed.model.state_dict()[name], t), name
    assert resumed.state.global_step == 5 and read_marker(tmp_path / "checkpoint-5") is not None


def test_a_plain_save_killed_half_way_is_not_resumed_from(tmp_path) -> None:
    """A Trainer's own save (one made while the encoder was busy) that a kill cut off before its
    trainer_state.json, the file the Trainer writes last, is skipped for the checkpoint before it."""
    from hf_dynaquant.training.checkpoint_dir import last_complete_checkpoint

    trainer_for(tmp_path, max_steps=4, save_steps=2).train()  # checkpoint-2, checkpoint-4 (compressed)
    cut = tmp_path / "checkpoint-6"
    shutil.copytree(tmp_path / "checkpoint-4", cut)
    (cut / "dynaquant.json").unlink()
    torch.save({}, cut / "pytorch_model.bin")  # weights written, the trainer state not yet
    (cut / "trainer_state.json").unlink()
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    (cut / "trainer_state.json").write_text((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert last_complete_checkpoint(tmp_path) == cut  # finished: a plain checkpoint like any other
