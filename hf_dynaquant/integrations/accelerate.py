"""Accelerate integration: ``accelerator.save_state`` / ``load_state`` write and read DynaQuant checkpoints.

One call after ``accelerator.prepare``::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    dq = DynaQuantPlugin(threshold=0.01, eval_data=eval_batches).attach(accelerator, model, optimizer)
    ...                           # the loop is unchanged: gradients are recorded by optimizer hooks
    accelerator.save_state()      # weights and optimizer state go compressed into the store
    accelerator.load_state()      # the newest *complete* checkpoint, restored on every rank
    dq.wait()                     # at the end: the checkpoint in flight is on disk

How it fits Accelerate (1.15, see DESIGN.md section 5):

* :class:`DynaQuantPlugin` is shaped like Accelerate's own plugins: a dataclass whose fields
  default to ``ACCELERATE_DYNAQUANT_*`` environment variables (so ``accelerate launch`` users
  can set them in the environment). Accelerate has no registry for third-party plugins, hence
  :meth:`DynaQuantPlugin.attach`.
* ``register_save_state_pre_hook``: the hook takes our model's state out of the list Accelerate
  would write (no ``model.safetensors`` for it) and snapshots weights, optimizer state and the
  gradient EMA to the CPU. With several processes the configuration search runs right there on
  every rank, in the training thread (its collectives would interleave with DDP's from a
  background thread); one process searches on a CPU copy in the background.
* The optimizer is not passed to the hooks, so ``attach`` wraps the accelerator's ``save_state``
  and ``load_state`` (instance attributes; :meth:`DynaQuantCheckpointing.detach` undoes it).
  The wrappers withhold our optimizer from ``accelerator._optimizers`` for the duration of the
  call (no ``optimizer.bin`` is written or looked for; the one private attribute touched, checked
  at attach), wait for the checkpoint in flight before Accelerate's rotation can delete folders,
  and, once Accelerate's own small files (scheduler, RNG states, sampler) are on disk on every
  rank, hand the snapshot to the writer: the main process encodes it into the store, writes the
  folder's ``dynaquant.json`` marker and releases the references of rotated folders.
* ``register_load_state_pre_hook``: for a folder with a marker, the hook loads the decoded
  weights into the unwrapped model and the decoded optimizer state on every rank, and the chain
  goes on from that entry. Folders without a marker load as Accelerate loads them.
* The store lives outside the rotated folders (``<project_dir>/dynaquant``, or ``dynaquant``
  beside the checkpoint folders without a project directory): Accelerate's
  ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`` deletes whole
  folders and breaks on foreign entries inside ``checkpoints/``; bases of live deltas stay.
* Weights are stored under the unwrapped model's names, so a checkpoint saved by N data-parallel
  processes restores onto any number. Sharded set-ups (Accelerate's FSDP, DeepSpeed, Megatron-LM,
  and FSDP2 models with DTensor parameters) are refused at attach: FSDP2 models are checkpointed
  with :class:`hf_dynaquant.sharded.ShardedCompressor` (see the README).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, str_to_bool

from ..background import BackgroundWorker
from ..checkpoint_dir import (
    STORE_DIRNAME,
    _numbered,
    collect_small_files,
    last_complete_checkpoint,
    marker_store,
    read_marker,
    release_rotated,
    restore_optimizer,
    write_marker,
)
from ..codecs.dynaquant import DEFAULT_DELTA_CODING
from ..compressor import CheckpointReport, Compressor, Snapshot, read_checkpoint
from ..core.quantizer import QuantConfig
from ..errors import (
    CheckpointError,
    IncompleteCheckpointError,
    InvalidSettingError,
    UnsupportedSetupError,
)
from ..optimizer_state import MomentQuant
from ..search import QualityMetric, SearchResult, SearchSpace
from ..store import CheckpointStore

__all__ = ["DynaQuantPlugin", "DynaQuantCheckpointing", "ENV_PREFIX"]

logger = logging.getLogger("hf_dynaquant")

ENV_PREFIX = "ACCELERATE_DYNAQUANT_"
# Accelerate's small files a resume reads (copied into each entry, so the store can rebuild a folder)
_ACCELERATE_FILES = (
    "scheduler*.bin",
    "sampler*.bin",
    "dl_state_dict*.bin",
    "scaler.pt",
    "random_states_*.pkl",
    "custom_checkpoint_*.pkl",
)
_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def _env(name: str, parse: Callable[[str], Any], default: Any) -> Any:
    """``ACCELERATE_DYNAQUANT_<name>`` parsed, or ``default`` when unset or empty."""
    raw = os.environ.get(ENV_PREFIX + name, "")
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise InvalidSettingError(f"{ENV_PREFIX}{name}={raw!r} cannot be used: {exc}") from None


def _optional_float(raw: str) -> float | None:
    return None if raw.strip().lower() in ("none", "off") else float(raw)


def _optional_int(raw: str) -> int | None:
    return None if raw.strip().lower() in ("none", "off") else int(raw)


def _optional_str(raw: str) -> str | None:
    return None if raw.strip().lower() in ("none", "off") else raw


@dataclass
class DynaQuantPlugin:
    """Settings of DynaQuant checkpoints in an Accelerate loop (see the module docstring).

    Each field with an environment variable takes it as its default when the variable is set
    (``none`` or ``off`` for "no value"); an argument always wins.
    """

    threshold: float | None = field(
        default_factory=lambda: _env("THRESHOLD", _optional_float, 0.01),
        metadata={
            "help": "How much worse (relative) the quality metric may be on a decoded checkpoint, and so after a "
            "resume from it, with one-sided 95% confidence where the metric gives a standard error (the default "
            "mean loss does, from its batches); the most compressive configuration within it is searched at every "
            "save. None: use `config` as it is. "
            "Env: ACCELERATE_DYNAQUANT_THRESHOLD (default 0.01)."
        },
    )
    optimizer_state: str = field(
        default_factory=lambda: _env("OPTIMIZER_STATE", str, "compress"),
        metadata={
            "help": "'compress' (Adam moments quantized, fidelity checked), 'lossless' or 'drop' (no optimizer "
            "state; a load warns loudly). Env: ACCELERATE_DYNAQUANT_OPTIMIZER_STATE."
        },
    )
    keyframe_every: int = field(
        default_factory=lambda: _env("KEYFRAME_EVERY", int, 10),
        metadata={
            "help": "Longest delta chain: every keyframe_every-th save is self-contained, which bounds restore "
            "time. Env: ACCELERATE_DYNAQUANT_KEYFRAME_EVERY."
        },
    )
    checkpoint_every: int | None = field(
        default_factory=lambda: _env("CHECKPOINT_EVERY", _optional_int, None),
        metadata={
            "help": "Optimizer steps between save_state calls, if regular: gradients are then recorded only in "
            "the ema_steps steps before each save (else at every step). Env: ACCELERATE_DYNAQUANT_CHECKPOINT_EVERY."
        },
    )
    ema_steps: int = field(
        default_factory=lambda: _env("EMA_STEPS", int, 50),
        metadata={
            "help": "Optimizer steps before a save over which the gradient EMA (sensitivity ranking) is taken. "
            "Env: ACCELERATE_DYNAQUANT_EMA_STEPS."
        },
    )
    background: bool = field(
        default_factory=lambda: _env("BACKGROUND", lambda raw: bool(str_to_bool(raw)), True),
        metadata={
            "help": "Encode and write on a background thread (at most one checkpoint in flight; its error is "
            "raised at the next optimizer step or save). Env: ACCELERATE_DYNAQUANT_BACKGROUND."
        },
    )
    delta_coding: str = field(
        default_factory=lambda: _env("DELTA_CODING", str, DEFAULT_DELTA_CODING),
        metadata={
            "help": "'ans' (regrouped, rANS-coded; default), 'regroup' (the paper's), 'rle' or 'entropy'. "
            "Env: ACCELERATE_DYNAQUANT_DELTA_CODING."
        },
    )
    store_dir: str | None = field(
        default_factory=lambda: _env("STORE_DIR", str, None),
        metadata={
            "help": "Where the compressed entries go (outside the rotated folders). Default: <project_dir>/"
            "dynaquant, or dynaquant beside the checkpoint folders. Env: ACCELERATE_DYNAQUANT_STORE_DIR."
        },
    )
    pretrained: Any = field(
        default_factory=lambda: _env("PRETRAINED", _optional_str, "auto"),
        metadata={
            "help": "The pre-trained weights a fine-tune's checkpoints may be coded as residuals against "
            "(hf_dynaquant.pretrained): 'auto' (default) takes the folder, or the Hub repo in the local Hugging "
            "Face cache, that from_pretrained loaded the model from (safetensors only, never downloaded; nothing "
            "for a model built from a config); a folder path or cached repo id names them; None turns residuals "
            "against them off. They must stay available, unchanged, to restore. Env: ACCELERATE_DYNAQUANT_PRETRAINED."
        },
    )
    config: QuantConfig | None = field(
        default=None,
        metadata={"help": "The fixed quantization knobs (and the configuration itself when threshold is None)."},
    )
    metric: QualityMetric | Callable[[torch.nn.Module], float] | None = field(
        default=None,
        metadata={"help": "The search's quality metric (a callable model -> float); default: mean loss on eval_data."},
    )
    higher_is_better: bool = field(default=False, metadata={"help": "Direction of a callable metric."})
    eval_data: Any = field(
        default=None,
        metadata={
            "help": "Model-ready evaluation batches for the default metric (the same on every rank, so every rank "
            "judges a candidate alike); the batches are the units of the standard error, so give 16 or more "
            "(e.g. 512 examples in batches of 16 or 32) for a threshold of 1% to be resolved."
        },
    )
    search_space: SearchSpace | None = field(
        default=None, metadata={"help": "The configuration cube (the paper's Table 7 plus 3 bins by default)."}
    )
    moment_quant: MomentQuant | None = field(default=None, metadata={"help": "Settings of optimizer_state='compress'."})

    def __post_init__(self) -> None:
        try:
            Compressor._validate(self.optimizer_state, self.keyframe_every)
        except ValueError as exc:
            raise InvalidSettingError(str(exc)) from None
        if self.threshold is not None and self.metric is None and self.eval_data is None:
            raise InvalidSettingError(
                f"threshold={self.threshold} needs eval_data= (a few batches) or metric= to judge configurations; "
                f"or fix the configuration with threshold=None ({ENV_PREFIX}THRESHOLD=none) and config=QuantConfig(...)"
            )
        for name in ("ema_steps", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidSettingError(f"{name} must be at least 1, got {value}")

    def attach(
        self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> DynaQuantCheckpointing:
        """Make ``accelerator.save_state`` / ``load_state`` compress ``model`` (and ``optimizer``):
        pass the objects ``accelerator.prepare`` returned. Returns the handle that holds the
        run's state (reports, :meth:`~DynaQuantCheckpointing.wait`, ``detach``)."""
        return DynaQuantCheckpointing(self, accelerator, model, optimizer)


class DynaQuantCheckpointing:
    """A :class:`DynaQuantPlugin` attached to one accelerator, model and optimizer (made by
    :meth:`DynaQuantPlugin.attach`).

    Attributes:
        compressor: the :class:`~hf_dynaquant.compressor.Compressor` doing the work.
        reports: one :class:`~hf_dynaquant.compressor.CheckpointReport` per checkpoint written
            (main process only).
        chosen: ``(step, configuration)`` searched at each save, on every rank when distributed.
    """

    def __init__(
        self,
        plugin: DynaQuantPlugin,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        if accelerator.distributed_type in _SHARDED:
            raise UnsupportedSetupError(
                f"DynaQuantPlugin does not support {accelerator.distributed_type.value}: each rank holds a shard "
                "and Accelerate writes it in that framework's own format; this integration compresses data-parallel "
                "(DDP) or single-process runs (see the README's Accelerate section)"
            )
        sharded = next((n for n, p in model.named_parameters() if hasattr(p, "placements")), None)
        if sharded is not None:
            raise UnsupportedSetupError(
                f"parameter {sharded!r} is a DTensor (an FSDP2 / fully_shard model): accelerator.prepare wraps such a "
                "model in DDP on CPUs, which breaks it, so the plugin does not take it; checkpoint it with "
                "hf_dynaquant.sharded.ShardedCompressor, where each rank compresses its own shard (see the README)"
            )
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world != accelerator.num_processes:
            raise UnsupportedSetupError(
                f"torch.distributed runs {world} processes but the Accelerator sees {accelerator.num_processes} "
                "(each would write the same checkpoint): on CPUs pass Accelerator(cpu=True) or launch with "
                "ACCELERATE_USE_CPU=1"
            )
        if not isinstance(getattr(accelerator, "_optimizers", None), list):
            raise UnsupportedSetupError(
                "this accelerate version keeps no Accelerator._optimizers list, which DynaQuantPlugin withholds "
                "during save_state/load_state; hf_dynaquant is tested with accelerate 1.15"
            )
        if "save_state" in vars(accelerator):
            raise UnsupportedSetupError(
                "this accelerator already has a DynaQuantPlugin (or another save_state wrapper)"
            )
        self.plugin, self.accelerator = plugin, accelerator
        self.model = accelerator.unwrap_model(model)
        self.optimizer = optimizer
        self.compressor = Compressor.from_settings(
            self.model,
            None,  # the store is known at the first save or load (main process only)
            plugin,
            optimizer=optimizer,
            checkpoint_every=plugin.checkpoint_every,
            eval_data=plugin.eval_data,
        )
        self.reports: list[CheckpointReport] = []
        self.chosen: list[tuple[int, dict[str, Any] | None]] = []
        self.worker = BackgroundWorker() if plugin.background else None
        self.run_dir: Path | None = None  # the folder the checkpoint folders are in (fixed at the first save/load)
        self._pending: tuple[Snapshot | None, SearchResult | None, Path] | None = None
        self._save_state, self._load_state = accelerator.save_state, accelerator.load_state
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one
            self._handles += [
                inner.register_step_pre_hook(lambda *_: self.compressor.on_backward_pass_end()),
                inner.register_step_post_hook(lambda *_: self._after_step()),
            ]
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state

    # -- the wrappers -----------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.save_state`` with our model and optimizer compressed into the store."""
        self.wait()  # before Accelerate's rotation can delete folders
        with self._optimizer_withheld():
            location = self._save_state(output_dir, *args, **kwargs)
        pending, self._pending = self._pending, None
        if pending is None:
            raise UnsupportedSetupError(
                f"the model given to attach() is not among the accelerator's models: pass the object "
                f"accelerator.prepare returned (nothing was compressed into {location})"
            )
        self._write(*pending)
        return location

    def load_state(self, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.load_state``; without ``input_dir`` under automatic checkpoint naming,
        the newest *complete* checkpoint (a folder whose save a crash cut short is skipped), and
        the save iteration moves past every existing folder."""
        self.wait()
        self.accelerator.wait_for_everyone()  # the main process's last write is on disk before anyone looks
        project = self.accelerator.project_configuration
        if input_dir is None and project.automatic_checkpoint_naming:
            with self.accelerator.main_process_first():  # it repairs a marker a crash lost; the others see it
                input_dir = str(self._newest_complete(Path(self.accelerator.project_dir) / "checkpoints"))
        if input_dir is None or read_marker(input_dir) is None:
            return self._load_state(input_dir, *args, **kwargs)  # a plain Accelerate folder
        with self._optimizer_withheld():
            result = self._load_state(input_dir, *args, **kwargs)
        if project.automatic_checkpoint_naming:
            numbered = _numbered(Path(self.accelerator.project_dir) / "checkpoints")
            project.iteration = max(project.iteration, numbered[0][0] + 1 if numbered else 0)
        return result

    def wait(self) -> None:
        """Block until the checkpoint in flight is written (raising its error, if any); call it
        at the end of training."""
        if self.worker is not None:
            self._collect(self.worker.wait())

    def detach(self) -> None:
        """Wait for the checkpoint in flight, remove the hooks and give the accelerator back its
        own ``save_state`` / ``load_state``."""
        try:
            self.wait()
            if self.worker is not None:
                self.worker.close()
        finally:
            for handle in self._handles:
                handle.remove()
            for name in ("save_state", "load_state"):
                vars(self.accelerator).pop(name, None)

    # -- hooks ------------------------------------------------------------------------------
    def _after_step(self) -> None:
        self.compressor.before_gradient_flush()
        if self.worker is not None:
            self._collect(self.worker.check())

    def _index_of_model(self, models: list[torch.nn.Module]) -> int | None:
        for i, m in enumerate(models):
            if m is self.model or self.accelerator.unwrap_model(m) is self.model:
                return i
        return None

    def _save_hook(self, models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        index = self._index_of_model(models)
        if index is None:
            return
        weights.pop(index)  # Accelerate writes no model file for it (`models` is the accelerator's own list)
        distributed = self.accelerator.num_processes > 1
        searching_here = distributed and self.compressor.search is not None
        if not (self.accelerator.is_main_process or searching_here):
            self._pending = (None, None, Path(output_dir))  # this rank only waits for the others
            return
        snap = self.compressor.snapshot(
            self.compressor.step,
            detach_model=not distributed,
            metadata={"framework": "accelerate", "num_processes": self.accelerator.num_processes},
        )
        searched = None
        if searching_here:
            searched = self.compressor.search_snapshot(snap)  # every rank, in the training thread
            self.chosen.append((snap.step, searched.config.to_dict() if searched.config else None))
        self._pending = (snap, searched, Path(output_dir))

    def _load_hook(self, models: list[torch.nn.Module], input_dir: str) -> None:
        marker = read_marker(input_dir)
        index = self._index_of_model(models)
        if marker is None or index is None:
            return
        models.pop(index)  # a list of load_state's own: Accelerate loads the other models
        store = marker_store(input_dir, marker)
        state, optimizer_state, meta = read_checkpoint(store, marker["entry"])
        try:
            self.model.load_state_dict(state)
        except RuntimeError as exc:
            raise CheckpointError(f"{input_dir}: the stored weights do not fit the model: {exc}") from exc
        if self.optimizer is not None:
            self._load_optimizer(optimizer_state, meta, input_dir)
        self.compressor.step = int(meta.get("step", 0))
        if self.accelerator.is_main_process:
            self._use_store(store, Path(input_dir))
            self.compressor.continue_chain(marker["entry"])  # the next save is a delta on this entry
        self.compressor.resumed_from(marker["entry"])  # every rank rounds stochastically, with the same seed
        if self.compressor.search is not None:
            self.compressor.search.agree()  # and searches on from where rank 0's chain stopped

    def _load_optimizer(self, state: dict[str, Any] | None, meta: dict[str, Any], where: str) -> None:
        restore_optimizer(self.optimizer, state, meta, where)

    # -- writing ------------------------------------------------------------------------------
    def _write(self, snap: Snapshot | None, searched: SearchResult | None, folder: Path) -> None:
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()  # every rank's RNG file is on disk before it is copied
        if snap is None or not self.accelerator.is_main_process:
            return
        store = self._use_store(self._default_store(folder), folder)
        snap.extras = collect_small_files(folder, _ACCELERATE_FILES)
        name, run_dir = folder.name, self.run_dir

        def job() -> CheckpointReport:
            report = self.compressor.write(snap, ref=name, searched=searched)
            if searched is None and report.search is not None:
                self.chosen.append((snap.step, report.search.get("config")))
            if folder.is_dir():
                write_marker(folder, store, name, report.entry, snap.step)
            release_rotated(store, run_dir, keep={name}, every_ref=True)
            return report

        if self.worker is not None:
            self.worker.submit(name, job)
        else:
            self._collect(job())

    def _default_store(self, folder: Path) -> CheckpointStore:
        if self.compressor.store is not None:
            return self.compressor.store
        if self.plugin.store_dir is not None:
            return CheckpointStore(self.plugin.store_dir)
        project_dir = self.accelerator.project_dir
        return CheckpointStore(Path(project_dir) / STORE_DIRNAME if project_dir else folder.parent / STORE_DIRNAME)

    def _use_store(self, store: CheckpointStore, folder: Path) -> CheckpointStore:
        """Fix the run's store and folder directory (main process); they may not change."""
        run_dir = folder.resolve().parent
        if self.run_dir is None:
            self.run_dir = run_dir
        elif run_dir != self.run_dir:
            raise UnsupportedSetupError(
                f"checkpoint folder {folder} is not in {self.run_dir}, where this run's other checkpoints are: "
                "a run keeps its checkpoint folders in one directory (its store tracks them by name)"
            )
        self.compressor.store = store
        return store

    def _newest_complete(self, checkpoints: Path) -> Path:
        store_path = Path(self.plugin.store_dir or Path(self.accelerator.project_dir) / STORE_DIRNAME)
        store = CheckpointStore(store_path, create=False) if CheckpointStore.is_store(store_path) else None
        found = last_complete_checkpoint(checkpoints, store=store)
        if found is None:
            raise IncompleteCheckpointError(f"no complete checkpoint to load in {checkpoints}")
        return found

    def _collect(self, report: CheckpointReport | None) -> None:
        if report is None:
            return
        self.reports.append(report)
        logger.info(
            "hf_dynaquant: %s step %d: %.1fx (weights %.1fx)",
            report.entry[:12],
            report.step,
            report.raw / max(report.stored, 1),
            report.weights_raw / max(report.weights_stored, 1),
        )

    @contextmanager
    def _optimizer_withheld(self) -> Iterator[None]:
        """Accelerate neither writes nor reads ``optimizer.bin`` for our optimizer meanwhile."""
        kept = self.accelerator._optimizers
        ours = self.optimizer
        self.accelerator._optimizers = [o for o in kept if o is not ours and getattr(o, "optimizer", None) is not ours]
        try:
            yield
        finally:
            self.accelerator._optimizers = kept
