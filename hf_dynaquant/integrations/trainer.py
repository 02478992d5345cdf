"""``transformers.Trainer`` integration: every checkpoint compressed, training resumes from it.

Two pieces, one line each::

    trainer = DynaQuantTrainer(model=..., args=..., train_dataset=..., eval_dataset=...)
    trainer.train()                              # every checkpoint-N is DynaQuant-compressed
    trainer.train(resume_from_checkpoint=True)   # weights, optimizer, scheduler, RNG, step

* :class:`DynaQuantCallback` does the work: it records the gradient EMA in the window before
  each scheduled save (``on_pre_optimizer_step`` / ``on_optimizer_step``), and at ``on_save``
  snapshots weights and optimizer state to the CPU and hands them to a background worker, which
  searches the configuration (on a CPU copy of the model), encodes, writes the entry into
  ``<output_dir>/dynaquant/`` (outside the rotated ``checkpoint-*`` folders), marks the folder
  and removes the uncompressed files. It works with a plain ``Trainer`` too.
* :class:`DynaQuantTrainer` (a ``Trainer`` subclass, with the callback built in) does what a
  callback cannot: it never writes the uncompressed weights and optimizer file in the first
  place (so a save stalls training less than a plain save), it resumes from compressed folders
  (``resume_from_checkpoint=True`` takes the newest *complete* one), loads the best model at
  the end from the store, compresses JIT (SIGTERM) checkpoints too (the Trainer sends no
  ``on_save`` for them), and hands the compression figures to the reporting integrations
  (TensorBoard, W&B, ... through ``on_log``).

The figures stay out of ``trainer_state.json``'s ``log_history``: they depend on timing and on
where a run was resumed (its first checkpoint after a resume is a keyframe), and the log history
of a resumed run must equal an uninterrupted run's, as the Trainer's own resume tests require.
Every checkpoint's figures are in :attr:`DynaQuantCallback.reports` and the Python logger.

The default quality test of the configuration search measures what the user measures: the
``metric_for_best_model`` of the Trainer's ``compute_metrics`` and the Trainer's own loss
(``Trainer.compute_loss``, so a custom ``compute_loss``, ``compute_loss_func`` or label
smoothing counts, and a model may return a ``ModelOutput``, a dict or a tuple), on up to 512
examples of the eval dataset, evaluated on the search's model (a CPU copy when one process
trains); a candidate passes when each degradation plus 1.645 standard errors is within the
threshold (see :func:`trainer_metric`).

With a plain ``Trainer`` and the callback, resume with
``trainer.train(resume_from_checkpoint=hf_dynaquant.materialize(output_dir))``: it writes the
newest complete checkpoint back as ``model.safetensors`` + ``optimizer.pt``. The figures then go
to :attr:`DynaQuantCallback.reports` and the Python logger.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback
from transformers.trainer_pt_utils import EvalLoopContainer, find_batch_size, nested_detach
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalPrediction

from ..core.rng import preserved_rng
from ..errors import CheckpointError, IncompleteCheckpointError, InvalidSettingError, NoValidCheckpointError
from ..search import Measurement, QualityMetric, device_of, mean_loss, move_to, paired_standard_error
from ..training.checkpoint_dir import (
    RESUME_FILES,
    checkpoint_store,
    last_complete_checkpoint,
    marker_store,
    read_marker,
    restore_optimizer,
)
from ..training.compressor import CheckpointReport, Compressor, load_weights, read_optimizer_state
from ..training.manager import CheckpointManager
from ..training.settings import DEFAULT_EVAL_EXAMPLES, CheckpointSettings, SettingsView

__all__ = ["DynaQuantCallback", "DynaQuantTrainer", "trainer_metric", "DEFAULT_EVAL_EXAMPLES"]

logger = logging.getLogger("hf_dynaquant")

_SAFE_HUB_STRATEGIES = ("end",)
_UNSET = object()  # DynaQuantCallback's threshold when not given (the settings' default applies)
_BOOTSTRAP = 200  # resamples for the standard error of a compute_metrics metric (its own s.e. ~5%)
_SEED = 20240515  # the private generator that draws the examples and the bootstrap resamples


class DynaQuantCallback(SettingsView, TrainerCallback):
    """Compress every checkpoint a ``Trainer`` writes (see the module docstring).

    Args:
        threshold: how much worse (relative, 0.01 = 1%) your metric may be on any decoded
            checkpoint, which is what training resumed from it starts with, than on the
            uncompressed weights, with 95% confidence given the evaluation examples (see
            :func:`trainer_metric`); ``None`` uses ``config`` as it is.
        settings: a :class:`~hf_dynaquant.training.settings.CheckpointSettings` with every
            setting (documented there); or give its fields as keyword arguments (``config``,
            ``metric``, ``eval_data``, ``eval_examples``, ``search_space``, ``optimizer_state``,
            ``moment_quant``, ``keyframe_every``, ``restore_depth``, ``ema_steps``, ``background``,
            ``delta_coding``, ``progress``, ``pretrained``, ...). With the Trainer the defaults
            are: the metric :func:`trainer_metric` (the Trainer's ``metric_for_best_model`` from
            its ``compute_metrics`` and the loss as its ``compute_loss`` computes it, both within
            the threshold; without ``compute_metrics`` the loss alone; with a plain ``Trainer``
            the mean loss), on up to ``eval_examples`` examples of the Trainer's eval dataset
            (drawn with a private seeded generator, all of them when fewer; else the last
            ``eval_examples`` training examples, collated by the training loader, the training
            order untouched), and the save interval of ``TrainingArguments`` as
            ``checkpoint_every``.
        eval_batches: deprecated: the first ``eval_batches`` batches instead of ``eval_examples``
            (the old default, 4: too few examples for a 1% threshold to mean much).
    """

    def __init__(
        self,
        threshold: float | None | object = _UNSET,
        *,
        settings: CheckpointSettings | None = None,
        eval_batches: int | None = None,
        **shortcuts: Any,
    ) -> None:
        if settings is None:
            given = {} if threshold is _UNSET else {"threshold": threshold}
            settings = CheckpointSettings(**given, **shortcuts)
        elif threshold is not _UNSET or shortcuts:
            raise InvalidSettingError("pass either settings= or the settings as arguments, not both")
        if settings.store_dir is not None:
            raise InvalidSettingError(
                f"store_dir={settings.store_dir!r} is Accelerate's: the Trainer's store is <output_dir>/dynaquant, "
                "beside the checkpoint folders it rotates"
            )
        if eval_batches is not None:
            if eval_batches < 1:
                raise InvalidSettingError(f"eval_batches must be at least 1, got {eval_batches}")
            warnings.warn(
                "DynaQuantCallback(eval_batches=) is deprecated: the default test evaluates up to eval_examples "
                f"(default {DEFAULT_EVAL_EXAMPLES}) examples, enough for its standard error to resolve the threshold",
                DeprecationWarning,
                stacklevel=2,
            )
        self.settings, self.eval_batches = settings, eval_batches
        self.trainer: DynaQuantTrainer | None = None  # set by DynaQuantTrainer
        self.manager: CheckpointManager | None = None  # made at each on_train_begin
        self.reports: list[dict[str, Any]] = []  # one per checkpoint written (this process)
        self._chosen: list[tuple[int, dict | None]] = []  # of the runs before the current one
        self._submitted_step: int | None = None  # the checkpoint last handed to the compressor
        self._totals = {"raw": 0, "stored": 0, "weights_raw": 0, "weights_stored": 0}
        self._trainer_save_seconds = 0.0

    @property
    def compressor(self) -> Compressor | None:
        """The current run's compressor (``None`` before training begins)."""
        return self.manager.compressor if self.manager is not None else None

    @property
    def chosen(self) -> list[tuple[int, dict | None]]:
        """``(step, configuration)`` the search chose at each checkpoint, on every rank when distributed."""
        return self._chosen + (self.manager.chosen if self.manager is not None else [])

    # -- set-up ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        self._refuse_unsupported(args)
        if self.manager is not None:  # a previous train() that ended without on_train_end
            self.manager.close()
            self._chosen += self.manager.chosen
        store = checkpoint_store(args.output_dir) if args.should_save else None  # rank 0 writes
        settings = self.settings
        eval_data = settings.eval_data
        if eval_data is None and settings.metric is None and settings.threshold is not None:
            with preserved_rng():  # iterating a DataLoader (and collating) draws from the global RNG
                eval_data = self._default_eval_data(train_dataloader)
        settings = settings.replace(
            eval_data=eval_data,
            metric=settings.metric or self._default_metric(eval_data),
            checkpoint_every=settings.checkpoint_every or _save_interval(args, state),
        )
        compressor = Compressor(model, store, optimizer=optimizer, settings=settings)
        compressor.step = state.global_step
        self.manager = CheckpointManager(
            compressor, background=settings.background, progress=settings.progress, on_report=self._collect
        )
        if state.global_step:  # resumed: the chain goes on, every rank rounds alike and searches on
            resumed = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            self.manager.resume(resumed, continue_chain=store is not None and resumed in store.refs())

    def _refuse_unsupported(self, args, with_trainer: bool = False) -> None:
        if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) not in _SAFE_HUB_STRATEGIES:
            raise CheckpointError(
                f"push_to_hub with hub_strategy={args.hub_strategy!r} uploads checkpoint folders, whose weights "
                "DynaQuantCallback keeps in <output_dir>/dynaquant: the Hub would get checkpoints without weights. "
                "Use hub_strategy='end' (the final model is saved uncompressed and pushed as usual), or publish "
                "compressed models with hf_dynaquant's Hub tools"
            )
        if args.load_best_model_at_end and self.trainer is None and not with_trainer:
            raise CheckpointError(
                "load_best_model_at_end needs the best checkpoint's weights, which DynaQuantCallback compresses "
                "into the store: use DynaQuantTrainer (it loads the best model from the store) instead of Trainer"
            )

    def _default_eval_data(self, train_dataloader) -> list[Any]:
        """The default test's batches (see ``eval_data``), collated as the Trainer collates
        evaluation batches. Call under :func:`preserved_rng`: iterating a DataLoader draws from
        the global RNG; the examples are drawn with a private generator."""
        trainer = self.trainer
        if trainer is None or trainer.eval_dataset is None:
            return _tail_batches(train_dataloader, self.settings.eval_examples, self.eval_batches)
        if self.eval_batches is not None:  # deprecated: the first batches
            return list(itertools.islice(trainer.get_eval_dataloader(), self.eval_batches))
        dataset = trainer.eval_dataset
        if isinstance(dataset, dict):  # several eval sets: the first (metric_for_best_model names one of them)
            dataset = next(iter(dataset.values()))
        cached = dict(getattr(trainer, "_eval_dataloaders", None) or {})
        try:
            loader = trainer.get_eval_dataloader(draw_examples(dataset, self.settings.eval_examples))
            batches, seen = [], 0
            for batch in loader:  # an iterable dataset: its first eval_examples examples
                batches.append(batch)
                seen += find_batch_size(batch) or 1
                if seen >= self.settings.eval_examples:
                    break
        finally:
            if hasattr(trainer, "_eval_dataloaders"):  # persistent workers: keep the Trainer's own loader
                trainer._eval_dataloaders = cached
        return batches

    def _default_metric(self, eval_data: Any) -> QualityMetric | None:
        """With a trainer, the default metric :func:`trainer_metric` on the evaluation batches.
        It only reads the trainer's settings, so the background thread may call it on the
        search's CPU copy of the model while training goes on."""
        if self.trainer is None or eval_data is None or self.settings.threshold is None:
            return None
        return trainer_metric(self.trainer, list(eval_data))

    # -- gradient window ------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.compressor.on_backward_pass_end()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.compressor.before_gradient_flush()

    # -- saving ---------------------------------------------------------------------------
    def on_step_end(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.check()

    def on_save(self, args, state, control, **kwargs):
        if self.manager is None or self._submitted_step == state.global_step:
            return  # (DynaQuantTrainer already handed this checkpoint over in _save_checkpoint)
        self._submitted_step = state.global_step
        if self.manager.save_plainly(state.global_step, keep_last=args.save_total_limit):
            return  # the encoder is still busy: the Trainer's own files stay (see CheckpointManager)
        pending = self.manager.take(state.global_step, writer=args.should_save)
        if not args.should_save:
            self._emit({"dynaquant/stall_seconds": time.perf_counter() - pending.started})
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self.manager.write(pending, folder, small_files=RESUME_FILES, remove_plain_files=True,
                           stall_before=self._trainer_save_seconds)

    def on_train_end(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.close()

    @property
    def plain_steps(self) -> list[int]:
        """Steps whose checkpoint the Trainer saved uncompressed because the encoder was still
        busy with the one before (``busy_saves="plain"``)."""
        return self.manager.plain_steps if self.manager is not None else []

    def wait(self, state: Any = None) -> None:
        """Block until the checkpoint in flight is on disk (raising its error, if any)."""
        if self.manager is not None:
            self.manager.wait()

    # -- figures --------------------------------------------------------------------------
    def _summary(self, report: CheckpointReport) -> dict[str, Any]:
        t = self._totals
        t["raw"] += report.raw
        t["stored"] += report.stored
        t["weights_raw"] += report.weights_raw
        t["weights_stored"] += report.weights_stored
        search = report.search or {}
        logs = {
            "dynaquant/ratio": report.raw / max(report.stored, 1),
            "dynaquant/weights_ratio": report.weights_raw / max(report.weights_stored, 1),
            "dynaquant/cumulative_ratio": t["raw"] / max(t["stored"], 1),
            "dynaquant/cumulative_weights_ratio": t["weights_raw"] / max(t["weights_stored"], 1),
            "dynaquant/bytes_saved": float(t["raw"] - t["stored"]),
            "dynaquant/stall_seconds": report.stall_seconds,
            "dynaquant/background_seconds": report.seconds,
            "dynaquant/keyframe": float(report.keyframe),
        }
        if report.optimizer_raw:
            logs["dynaquant/optimizer_ratio"] = report.optimizer_raw / max(report.optimizer_stored, 1)
        if search:
            logs["dynaquant/search_evaluations"] = float(search.get("evaluations", 0))
            if search.get("degradation") is not None:
                logs["dynaquant/degradation"] = float(search["degradation"])
            if search.get("standard_error") is not None:  # what the test could resolve
                logs["dynaquant/standard_error"] = float(search["standard_error"])
        record = {"step": report.step, "entry": report.entry, "raw": report.raw, "stored": report.stored, **logs}
        record["config"] = (search.get("config") if search else None) or None
        logger.info(
            "hf_dynaquant: checkpoint-%d %.1fx (weights %.1fx)",
            report.step,
            logs["dynaquant/ratio"],
            logs["dynaquant/weights_ratio"],
        )
        return record

    def _collect(self, report: CheckpointReport) -> None:
        """The manager's ``on_report`` (training thread): the figures to :attr:`reports` and the loggers."""
        record = self._summary(report)
        self.reports.append(record)
        self._emit({k: v for k, v in record.items() if k.startswith("dynaquant/")})

    def _emit(self, figures: dict[str, float]) -> None:
        """Hand figures to the reporting integrations through the Trainer's ``on_log`` event, in
        the training thread, without an entry in ``state.log_history`` (see the module
        docstring). Without a DynaQuantTrainer they are in :attr:`reports` and the logger only."""
        if self.trainer is not None:
            trainer = self.trainer
            should_log = trainer.control.should_log  # the handler clears it: the Trainer's own log is due
            trainer.control = trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, figures)
            trainer.control.should_log = should_log


class DynaQuantTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are DynaQuant-compressed end to end.

    Takes the Trainer's arguments; a :class:`DynaQuantCallback` in ``callbacks`` sets the
    options (one with defaults is added otherwise). See the module docstring for what it adds
    to the callback."""

    def __init__(self, *args: Any, callbacks: list | None = None, **kwargs: Any) -> None:
        callbacks = list(callbacks or [])
        ours = [c for c in callbacks if isinstance(c, DynaQuantCallback)]
        if len(ours) > 1:
            raise ValueError("DynaQuantTrainer takes at most one DynaQuantCallback")
        if not ours:
            ours = [DynaQuantCallback()]
            callbacks.append(ours[0])
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # before Trainer.__init__, which would already contact the Hub
            ours[0]._refuse_unsupported(training_args, with_trainer=True)
        super().__init__(*args, callbacks=callbacks, **kwargs)
        self.dynaquant: DynaQuantCallback = ours[0]
        self.dynaquant.trainer = self
        self._dq_saving = False

    # -- resume ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete*
        checkpoint (a folder whose compression a crash cut short is skipped)."""
        if resume_from_checkpoint is True:
            found = last_complete_checkpoint(self.args.output_dir)
            if found is None:  # the Trainer's error, type and words
                raise NoValidCheckpointError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): no checkpoint-* "
                    "folder there holds complete weights"
                )
            resume_from_checkpoint = str(found)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        marker = read_marker(resume_from_checkpoint)
        if marker is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = model if model is not None else self.model
        with marker_store(resume_from_checkpoint, marker).open(marker["entry"]) as entry:
            load_weights(model, entry, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        marker = read_marker(checkpoint) if checkpoint is not None else None
        if marker is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        with marker_store(checkpoint, marker).open(marker["entry"]) as entry:
            optimizer_state = read_optimizer_state(entry, f"{checkpoint} (optimizer state)")
            restore_optimizer(self.optimizer, optimizer_state, entry.metadata, checkpoint)
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if not os.path.isfile(scheduler):
            raise IncompleteCheckpointError(f"{checkpoint}: scheduler.pt is missing")
        # the Trainer's own file, read as the Trainer reads it
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        self.dynaquant.wait(self.state)  # the best checkpoint may be the one still being written
        best = self.state.best_model_checkpoint
        marker = read_marker(best) if best is not None else None
        if marker is None:
            return super()._load_best_model()
        with marker_store(best, marker).open(marker["entry"]) as entry:
            load_weights(self.model, entry, best)

    # -- saving ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's save, then the compression handed over at once: the Trainer sends no
        ``on_save`` for a JIT (SIGTERM) checkpoint or a direct call, whose folder would otherwise
        lack its weights (the callback's ``on_save`` then finds the checkpoint taken). With
        ``save_total_limit`` the checkpoint in flight is finished first: the Trainer's rotation
        (inside this save) may delete its folder, which must not happen while its marker is
        being written (the wait would come at ``on_save`` anyway)."""
        started = time.perf_counter()
        manager = self.dynaquant.manager
        if manager is not None and manager.save_plainly(self.state.global_step, keep_last=self.args.save_total_limit):
            # the encoder is still busy with the previous checkpoint: this one is the Trainer's own
            self.dynaquant._submitted_step = self.state.global_step
            return super()._save_checkpoint(model, trial)
        if self.args.save_total_limit:
            self.dynaquant.wait(self.state)
        self._dq_saving = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._dq_saving = False
            self.dynaquant._trainer_save_seconds = time.perf_counter() - started
        self.dynaquant.on_save(self.args, self.state, self.control)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._dq_saving or self._dq_unsupported():
            return super()._save(output_dir, state_dict)
        # a checkpoint: everything save_pretrained writes but the weights (they go to the store)
        if not self.args.should_save:
            return
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if getattr(unwrapped, "config", None) is not None and hasattr(unwrapped.config, "save_pretrained"):
            unwrapped.config.save_pretrained(output_dir)
        if getattr(unwrapped, "generation_config", None) is not None:
            unwrapped.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))  # as Trainer._save does

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._dq_saving or self._dq_unsupported():
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:  # the optimizer goes to the store; the scheduler stays as the Trainer writes it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _dq_unsupported(self) -> bool:
        """Sharded set-ups write their own formats; they keep the Trainer's files."""
        return bool(self.is_deepspeed_enabled or self.is_fsdp_enabled)


def _save_interval(args, state) -> int | None:
    """The save interval in optimizer steps, when saves are regular."""
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "steps":
        return None
    steps = args.save_steps
    if steps < 1:  # a fraction of the run
        steps = math.ceil(state.max_steps * steps) if state.max_steps else None
    return int(steps) if steps else None


def _tail_batches(loader, examples: int, batches: int | None = None) -> list[Any]:
    """Batches of the last ``examples`` examples of the training set (or ``batches`` batches'
    worth), collated as training collates them; the training loader is not iterated, so the
    training order is untouched."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    size = getattr(loader, "total_batch_size", None) or getattr(loader, "batch_size", None) or 8
    if dataset is None or collate is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise CheckpointError(
            "the configuration search needs evaluation batches and the training dataset cannot be indexed: "
            "pass eval_data= (or metric=) to DynaQuantCallback, or an eval_dataset to DynaQuantTrainer"
        )
    total = len(dataset)
    start = max(total - (batches * size if batches is not None else examples), 0)
    rows = [dataset[i] for i in range(start, total)]
    return [collate(rows[i : i + size]) for i in range(0, len(rows), size)]


def draw_examples(dataset: Any, n: int) -> Any:
    """Up to ``n`` examples of ``dataset``, drawn without replacement by a private seeded
    generator (the process-wide RNGs are not touched), in dataset order: a ``datasets.Dataset``
    selects them, another indexable dataset is wrapped in a ``Subset``; a dataset without a
    length is returned as it is (its first examples are taken)."""
    if not hasattr(dataset, "__len__") or len(dataset) <= n:
        return dataset
    chosen = np.sort(np.random.default_rng(_SEED).choice(len(dataset), size=n, replace=False)).tolist()
    if hasattr(dataset, "select"):
        return dataset.select(chosen)
    return torch.utils.data.Subset(dataset, chosen)


def trainer_metric(trainer: Trainer, batches: Sequence[Any]) -> QualityMetric:
    """The default test of :class:`DynaQuantTrainer`: the user's own metric on ``batches``.

    With ``compute_metrics`` and ``args.metric_for_best_model`` (its direction from
    ``args.greater_is_better``) the batches go through the Trainer's prediction path as
    ``Trainer.evaluation_loop`` takes it (``compute_loss(..., return_outputs=True)``, the logits
    without the loss and the model's ``keys_to_ignore_at_inference``, labels read before the loss,
    ``preprocess_logits_for_metrics``, predictions and labels concatenated with -100 padding,
    ``include_for_metrics``) and ``compute_metrics`` is called on an ``EvalPrediction``: a
    candidate must keep both that metric and the loss within the threshold (one forward pass
    gives both). Otherwise (or when the metric is the loss) the loss alone, :func:`mean_loss`
    with ``Trainer.compute_loss``. The Trainer's ``prediction_step`` itself is not called: it
    moves batches to the training device, and the search evaluates a CPU copy off the training
    thread (a subclass that overrides it is warned).

    Standard errors (the baseline and a candidate see the same examples, so the degradation is
    a paired difference): the loss's from the per-batch loss differences (``compute_loss``
    returns one mean per batch); the metric's from a bootstrap over examples of
    ``compute_metrics`` on the cached predictions (200 resamples, the same for the baseline and
    every candidate, drawn by a private seeded generator)."""
    args = trainer.args
    key = args.metric_for_best_model
    key = key[len("eval_") :] if key and key.startswith("eval_") else key
    if trainer.compute_metrics is None or key in (None, "loss"):
        return mean_loss(batches, compute_loss=trainer.compute_loss)
    if args.batch_eval_metrics:
        warnings.warn(
            "batch_eval_metrics=True: compute_metrics accumulates over batches, which the bootstrap cannot "
            "resample; the configuration search tests the loss only",
            stacklevel=3,
        )
        return mean_loss(batches, compute_loss=trainer.compute_loss)
    step = type(trainer).prediction_step
    # Seq2SeqTrainer's own is Trainer's unless it generates
    same = step is Trainer.prediction_step or (
        step is Seq2SeqTrainer.prediction_step and not getattr(args, "predict_with_generate", False)
    )
    if not same:
        warnings.warn(
            f"{type(trainer).__name__} overrides prediction_step, which the configuration search does not call "
            "(it evaluates a CPU copy of the model through compute_loss, as Trainer.prediction_step does): if "
            f"yours changes what compute_metrics sees, {key!r} as the search measures it differs from "
            "Trainer.evaluate's; pass metric= to DynaQuantCallback to test your own",
            stacklevel=3,
        )
    return _PredictionMetric(trainer, list(batches), key, bool(args.greater_is_better))


def _rows_of(x: Any, rows: np.ndarray | None) -> Any:
    """The examples ``rows`` of arrays nested in lists, tuples and dicts (all for ``None``).
    A module-level function: a nested one that recurses is a reference cycle."""
    if x is None or rows is None:
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_rows_of(v, rows) for v in x)
    if isinstance(x, dict):
        return {k: _rows_of(v, rows) for k, v in x.items()}
    return x[rows]


class _PredictionMetric(QualityMetric):
    """:func:`trainer_metric` with ``compute_metrics``: a measurement's evidence is the per-batch
    losses and the gathered predictions; :meth:`compare` gives the metric's and the loss's
    degradations with their standard errors."""

    def __init__(self, trainer: Trainer, batches: list[Any], key: str, higher_is_better: bool) -> None:
        super().__init__(lambda model: self.measure(model).value, higher_is_better=higher_is_better, name=key)
        self.measure_fn = self._measure
        self.trainer, self.batches, self.key = trainer, batches, key
        self._resamples: np.ndarray | None = None

    def _measure(self, model: torch.nn.Module) -> Measurement:
        trainer, dev = self.trainer, device_of(model)
        config = getattr(trainer.model, "config", None)
        ignore = list(getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else [])
        preds, labels_all, inputs_all = (EvalLoopContainer(True, padding_index=-100) for _ in range(3))
        losses, sizes = [], []
        main_input = getattr(trainer.model, "main_input_name", "input_ids")
        for batch in self.batches:
            inputs = move_to(dict(batch), dev)
            if not trainer.label_names or any(inputs.get(k) is None for k in trainer.label_names):
                raise InvalidSettingError(
                    f"an evaluation batch lacks the labels {trainer.label_names} that compute_metrics needs "
                    f"(it holds {sorted(inputs)}): give the eval dataset labels, or pass metric= to DynaQuantCallback"
                )
            labels = nested_detach(tuple(inputs.get(k) for k in trainer.label_names))  # before the loss may pop them
            labels = labels[0] if len(labels) == 1 else labels
            loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
            if isinstance(outputs, dict):
                logits = tuple(v for k, v in outputs.items() if k not in [*ignore, "loss"])
            else:
                logits = outputs[1:]
            logits = nested_detach(logits)
            logits = logits[0] if len(logits) == 1 else logits
            if trainer.preprocess_logits_for_metrics is not None:
                logits = trainer.preprocess_logits_for_metrics(logits, labels)
            preds.add(logits)
            labels_all.add(labels)
            if "inputs" in trainer.args.include_for_metrics:
                inputs_all.add(inputs[main_input])
            losses.append(float(loss.detach().mean()))
            sizes.append(find_batch_size(inputs) or 1)
        evidence = {
            "losses": np.array(losses, dtype=np.float64),
            "example_losses": np.repeat(np.array(losses, dtype=np.float32), sizes),
            "predictions": preds.get_arrays(),
            "label_ids": labels_all.get_arrays(),
            "inputs": inputs_all.get_arrays(),
        }
        return Measurement(self._score(evidence, None), evidence)

    def _score(self, evidence: dict[str, Any], rows: np.ndarray | None) -> float:
        """``compute_metrics`` on the examples ``rows`` (all of them for ``None``): the value under
        ``metric_for_best_model``."""
        include = self.trainer.args.include_for_metrics
        prediction = EvalPrediction(
            predictions=_rows_of(evidence["predictions"], rows),
            label_ids=_rows_of(evidence["label_ids"], rows),
            inputs=_rows_of(evidence["inputs"], rows) if "inputs" in include else None,
            losses=_rows_of(evidence["example_losses"], rows) if "loss" in include else None,
        )
        metrics = self.trainer.compute_metrics(prediction)
        for name in (self.key, f"eval_{self.key}"):
            if name in metrics:
                return float(metrics[name])
        raise InvalidSettingError(
            f"metric_for_best_model={self.trainer.args.metric_for_best_model!r} is not among the metrics "
            f"compute_metrics returns ({', '.join(map(repr, metrics)) or 'none'}): name one of them, or pass "
            "metric= to DynaQuantCallback"
        )

    def _replicates(self, m: Measurement) -> np.ndarray:
        """The metric on each bootstrap resample of ``m``'s examples (cached on the measurement:
        the baseline's serve every candidate of its checkpoint)."""
        if "replicates" not in m.evidence:
            n = len(m.evidence["example_losses"])
            if self._resamples is None or self._resamples.shape[1] != n:
                self._resamples = np.random.default_rng(_SEED).integers(0, n, size=(_BOOTSTRAP, n))
            m.evidence["replicates"] = np.array([self._score(m.evidence, rows) for rows in self._resamples])
        return m.evidence["replicates"]

    def compare(self, baseline: Measurement, value: Measurement) -> dict[str, tuple[float, float]]:
        deg = self.degradation(baseline.value, value.value)
        base, cand = self._replicates(baseline), self._replicates(value)
        worse = base - cand if self.higher_is_better else cand - base
        boot = worse / np.maximum(np.abs(base), 1e-12)
        boot = boot[np.isfinite(boot)]
        se = float(boot.std(ddof=1)) if boot.size > 1 else 0.0
        b_loss, c_loss = baseline.evidence["losses"], value.evidence["losses"]
        loss_scale = float(b_loss.mean())
        loss_deg = (float(c_loss.mean()) - loss_scale) / max(abs(loss_scale), 1e-12)
        return {self.key: (deg, se), "loss": (loss_deg, paired_standard_error(b_loss, c_loss, loss_scale))}
