"""Accelerate integration: ``accelerator.save_state`` / ``load_state`` write and read DynaQuant checkpoints.

One call after ``accelerator.prepare``::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    dq = DynaQuantPlugin(threshold=0.01, eval_data=eval_batches).attach(accelerator, model, optimizer)
    ...                           # the loop is unchanged: gradients are recorded by optimizer hooks
    accelerator.save_state()      # weights and optimizer state go compressed into the store
    accelerator.load_state()      # the newest *complete* checkpoint, restored on every rank
    dq.wait()                     # at the end: the checkpoint in flight is on disk

How it fits Accelerate (1.15, see DESIGN.md section 5):

* :class:`DynaQuantPlugin` takes its settings like Accelerate's own plugins: the fields of
  :class:`~hf_dynaquant.training.settings.CheckpointSettings` default to
  ``ACCELERATE_DYNAQUANT_*`` environment variables (so ``accelerate launch`` users can set them
  in the environment). Accelerate has no registry for third-party plugins, hence
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
  with :class:`hf_dynaquant.training.sharded.ShardedCompressor` (see the README).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ..errors import IncompleteCheckpointError, InvalidSettingError, UnsupportedSetupError
from ..store import STORE_DIR, CheckpointStore
from ..training.checkpoint_dir import (
    last_complete_checkpoint,
    marker_store,
    numbered_checkpoints,
    read_marker,
    restore_optimizer,
)
from ..training.compressor import CheckpointReport, Compressor, load_weights, read_optimizer_state
from ..training.manager import CheckpointManager, PendingCheckpoint
from ..training.settings import ENV_PREFIX, CheckpointSettings, SettingsView

__all__ = ["DynaQuantPlugin", "DynaQuantCheckpointing", "ENV_PREFIX"]

logger = logging.getLogger("hf_dynaquant")

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


class DynaQuantPlugin(SettingsView):
    """DynaQuant checkpoints in an Accelerate loop (see the module docstring): a
    :class:`~hf_dynaquant.training.settings.CheckpointSettings` whose defaults come from the
    ``ACCELERATE_DYNAQUANT_*`` environment variables, the way Accelerate's own plugins take
    theirs (``ACCELERATE_DYNAQUANT_THRESHOLD=none``, ``..._KEYFRAME_EVERY=5``, ...; an argument
    always wins).

    Args:
        settings: the settings, used as they are (the environment is not read).
        **shortcuts: instead, the settings' fields as keyword arguments (``threshold``,
            ``eval_data``, ``metric``, ``config``, ``optimizer_state``, ``keyframe_every``,
            ``restore_depth``, ``checkpoint_every``, ``background``, ``store_dir``, ...).

    A threshold (default 0.01) needs ``eval_data`` (the same batches on every rank; 16 or more
    for a 1% threshold to be resolved) or ``metric``: without either the plugin refuses at once.
    The settings' fields read through: ``plugin.threshold`` is ``plugin.settings.threshold``.
    """

    def __init__(self, settings: CheckpointSettings | None = None, **shortcuts: Any) -> None:
        if settings is not None and shortcuts:
            raise InvalidSettingError("pass either settings= or the settings as keyword arguments, not both")
        self.settings = settings if settings is not None else CheckpointSettings.from_env(**shortcuts)
        self.settings.quality_metric()  # a threshold with nothing to judge by is refused now, not at a save

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

    It adapts Accelerate's save and load to a
    :class:`~hf_dynaquant.training.manager.CheckpointManager`, which does the work.
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
                "hf_dynaquant.ShardedCompressor, where each rank compresses its own shard (see the README)"
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
        compressor = Compressor(
            self.model,
            None,  # the store is known at the first save or load (main process only)
            optimizer=optimizer,
            settings=plugin.settings,
        )
        self.manager = CheckpointManager(
            compressor, background=plugin.settings.background, progress=plugin.settings.progress, on_report=self._log
        )
        self.run_dir: Path | None = None  # the folder the checkpoint folders are in (fixed at the first save/load)
        self._pending: tuple[PendingCheckpoint, Path] | None = None
        self._plain_save = False  # this save_state is Accelerate's own (the encoder was busy)
        self._save_state, self._load_state = accelerator.save_state, accelerator.load_state
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one
            self._handles += [
                inner.register_step_pre_hook(lambda *_: compressor.on_backward_pass_end()),
                inner.register_step_post_hook(lambda *_: self._after_step()),
            ]
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state

    @property
    def compressor(self) -> Compressor:
        """The :class:`~hf_dynaquant.training.compressor.Compressor` doing the numerics."""
        return self.manager.compressor

    @property
    def reports(self) -> list[CheckpointReport]:
        """One report per checkpoint written (main process only)."""
        return self.manager.reports

    @property
    def plain_steps(self) -> list[int]:
        """Steps whose checkpoint Accelerate saved uncompressed because the encoder was still
        busy with the one before (``busy_saves="plain"``)."""
        return self.manager.plain_steps

    @property
    def chosen(self) -> list[tuple[int, dict[str, Any] | None]]:
        """``(step, configuration)`` searched at each save, on every rank when distributed."""
        return self.manager.chosen

    # -- the wrappers -----------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.save_state`` with our model and optimizer compressed into the store (or,
        while the previous checkpoint is still being encoded, Accelerate's own uncompressed save:
        see :meth:`CheckpointManager.save_plainly <hf_dynaquant.training.manager.CheckpointManager.save_plainly>`)."""
        limit = self.accelerator.project_configuration.total_limit
        if self.manager.save_plainly(self.compressor.step, keep_last=limit):
            self._plain_save = True
            try:
                return self._save_state(output_dir, *args, **kwargs)
            finally:
                self._plain_save = False
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
            numbered = numbered_checkpoints(Path(self.accelerator.project_dir) / "checkpoints")
            project.iteration = max(project.iteration, numbered[0][0] + 1 if numbered else 0)
        return result

    def wait(self) -> None:
        """Block until the checkpoint in flight is written (raising its error, if any); call it
        at the end of training."""
        self.manager.wait()

    def detach(self) -> None:
        """Wait for the checkpoint in flight, remove the hooks and give the accelerator back its
        own ``save_state`` / ``load_state``."""
        try:
            self.manager.close()
        finally:
            for handle in self._handles:
                handle.remove()
            for name in ("save_state", "load_state"):
                vars(self.accelerator).pop(name, None)

    # -- hooks ------------------------------------------------------------------------------
    def _after_step(self) -> None:
        self.compressor.before_gradient_flush()
        self.manager.check()

    def _index_of_model(self, models: list[torch.nn.Module]) -> int | None:
        for i, m in enumerate(models):
            if m is self.model or self.accelerator.unwrap_model(m) is self.model:
                return i
        return None

    def _save_hook(self, models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        index = self._index_of_model(models)
        if index is None or self._plain_save:
            return
        weights.pop(index)  # Accelerate writes no model file for it (`models` is the accelerator's own list)
        pending = self.manager.take(
            self.compressor.step,
            writer=self.accelerator.is_main_process,
            metadata={"framework": "accelerate", "num_processes": self.accelerator.num_processes},
        )
        self._pending = (pending, Path(output_dir))

    def _load_hook(self, models: list[torch.nn.Module], input_dir: str) -> None:
        marker = read_marker(input_dir)
        index = self._index_of_model(models)
        if marker is None or index is None:
            return
        models.pop(index)  # a list of load_state's own: Accelerate loads the other models
        store = marker_store(input_dir, marker)
        with store.open(marker["entry"]) as entry:
            meta = dict(entry.metadata)
            load_weights(self.model, entry, input_dir)
            if self.optimizer is not None:
                optimizer_state = read_optimizer_state(entry, f"{input_dir} (optimizer state)")
                restore_optimizer(self.optimizer, optimizer_state, meta, input_dir)
        self.compressor.step = int(meta.get("step", 0))
        if self.accelerator.is_main_process:
            self._use_store(store, Path(input_dir))
        self.manager.resume(marker["entry"], continue_chain=self.accelerator.is_main_process)

    # -- writing ------------------------------------------------------------------------------
    def _write(self, pending: PendingCheckpoint, folder: Path) -> None:
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()  # every rank's RNG file is on disk before it is copied
        if pending.snapshot is None or not self.accelerator.is_main_process:
            return
        self._use_store(self._default_store(folder), folder)
        self.manager.write(pending, folder, small_files=_ACCELERATE_FILES, remove_plain_files=False, every_ref=True)

    def _default_store(self, folder: Path) -> CheckpointStore:
        if self.compressor.store is not None:
            return self.compressor.store
        if self.plugin.settings.store_dir is not None:
            return CheckpointStore(self.plugin.settings.store_dir)
        project_dir = self.accelerator.project_dir
        return CheckpointStore(Path(project_dir) / STORE_DIR if project_dir else folder.parent / STORE_DIR)

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
        store_path = Path(self.plugin.settings.store_dir or Path(self.accelerator.project_dir) / STORE_DIR)
        store = CheckpointStore(store_path, create=False) if CheckpointStore.is_store(store_path) else None
        found = last_complete_checkpoint(checkpoints, store=store)
        if found is None:
            raise IncompleteCheckpointError(f"no complete checkpoint to load in {checkpoints}")
        return found

    @staticmethod
    def _log(report: CheckpointReport) -> None:
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
