"""One run's checkpoints, from the framework's save to the rotated folder, and the resume.

A framework (the Trainer, Accelerate) decides *when* a checkpoint is saved, writes its own small
files into a ``checkpoint-N`` folder and rotates old folders. :class:`CheckpointManager` does
everything else, the same way for every framework:

1. :meth:`~CheckpointManager.take` (training thread, every rank): wait for the checkpoint in
   flight (at most one), snapshot weights, optimizer state and the gradient EMA to the CPU; with
   several processes run the configuration search right there on every rank (its collectives
   would interleave with DDP's from a background thread; one process searches later, on a CPU
   copy of the model, in the background).
2. :meth:`~CheckpointManager.write` (the writing process, once the framework's files are on
   disk): copy those small files into the entry's extras, then, on the background thread,
   encode into the store, mark the folder complete (``dynaquant.json``), remove the uncompressed
   files a plain framework save left there, release the references of folders the framework
   rotated away, and report.
3. :meth:`~CheckpointManager.resume` (every rank, after the decoded state was loaded): the next
   checkpoint goes on with the loaded entry's delta chain, every rank rounds stochastically with
   the same seed, and the search goes on from rank 0's stored configuration.

Saves that come faster than the encoder: when a save arrives while the checkpoint before it is
still being encoded, :meth:`~CheckpointManager.save_plainly` says so (with the default
``CheckpointSettings.busy_saves="plain"``) (and records the step in
:attr:`CheckpointManager.plain_steps`, with a log line): the framework then writes that
checkpoint its own way, uncompressed and resumable, which costs training exactly a plain save,
instead of waiting for the encoder or holding a second snapshot in memory. The next save
after the encoder is done is compressed again (a delta on the last compressed checkpoint). With
several processes every rank must take each checkpoint together (the search is collective), so
they wait as before; and a framework whose rotation keeps a single folder would delete the one
in flight, so it waits too.

Reports reach :attr:`CheckpointManager.reports` and the ``on_report`` callback in the training
thread (a finished background job is collected at the next :meth:`check`, :meth:`take` or
:meth:`wait`), so an integration can hand them to its loggers safely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.collectives import is_distributed, new_group, on_group, rank_world
from ..errors import CheckpointError
from ..search import SearchResult
from .background import BackgroundWorker
from .checkpoint_dir import collect_small_files, release_rotated, remove_uncompressed, write_marker
from .compressor import CheckpointReport, Compressor, Snapshot

__all__ = ["CheckpointManager", "PendingCheckpoint", "PROGRESS_BYTES"]

PROGRESS_BYTES = 256 << 20  # checkpoints larger than this show a progress bar by default
logger = logging.getLogger("hf_dynaquant")


@dataclass
class PendingCheckpoint:
    """A checkpoint taken but not yet handed to the writer."""

    step: int
    snapshot: Snapshot | None  # None on a process that does not write
    searched: SearchResult | None  # the search's result when it ran in the training thread
    started: float  # time.perf_counter() when the save began (for the stall figure)


class CheckpointManager:
    """The checkpoints of one run (see the module docstring).

    Args:
        compressor: does the numerics (snapshot, search, encode, restore).
        background: encode and write on a background thread.
        progress: show a progress bar while writing (``None``: for checkpoints over
            :data:`PROGRESS_BYTES`).
        on_report: called with each :class:`~hf_dynaquant.training.compressor.CheckpointReport`,
            in the training thread.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        background: bool = True,
        progress: bool | None = None,
        on_report: Callable[[CheckpointReport], None] | None = None,
    ) -> None:
        self.compressor = compressor
        self.progress = progress
        self.on_report = on_report
        self.worker = BackgroundWorker() if background else None
        # a collective write on the background thread needs collectives of its own (see
        # hf_dynaquant.core.collectives): made here, so every rank makes it together
        self.group = new_group() if background and compressor.collective_write and is_distributed() else None
        self.reports: list[CheckpointReport] = []  # one per checkpoint this process wrote
        self.chosen: list[tuple[int, dict | None]] = []  # (step, searched configuration), on every searching rank
        self.plain_steps: list[int] = []  # checkpoints left to the framework's plain save (encoder busy)

    # -- saving -------------------------------------------------------------------------------
    def take(self, step: int, *, writer: bool, metadata: Mapping[str, Any] | None = None) -> PendingCheckpoint:
        """Snapshot checkpoint ``step`` (training thread, every rank; ``writer``: this process
        writes it). Blocks until the previous checkpoint is written."""
        started = time.perf_counter()
        self.wait()  # at most one checkpoint in flight
        distributed = is_distributed()
        searching_here = distributed and self.compressor.search is not None
        if not (writer or searching_here):
            self.compressor.ema.reset()  # (the window's average, which only a writer or a search reads)
            return PendingCheckpoint(step, None, None, started)
        # a foreground write finishes before training goes on: it reads the live CPU tensors
        background = self.worker is not None
        snap = self.compressor.snapshot(step, detach_model=not distributed, copy=background, metadata=metadata)
        searched = None
        if searching_here:
            searched = self.compressor.search_snapshot(snap)
            self.chosen.append((step, searched.config.to_dict() if searched.config else None))
        return PendingCheckpoint(step, snap if writer else None, searched, started)

    def write(
        self,
        pending: PendingCheckpoint,
        folder: Path,
        *,
        small_files: tuple[str, ...],
        remove_plain_files: bool,
        every_ref: bool = False,
        stall_before: float = 0.0,
    ) -> None:
        """Hand a taken checkpoint to the writer (the writing process, once the framework's own
        files are in ``folder``): ``small_files`` (glob patterns) are copied into the entry;
        ``remove_plain_files`` deletes the weight and optimizer files a plain framework save
        wrote there once the entry is durable; ``every_ref``: any reference in the store names a
        folder beside ``folder`` (see :func:`~hf_dynaquant.training.checkpoint_dir.release_rotated`).
        ``stall_before``: seconds the framework's save took before :meth:`take` (for the report)."""
        snap = pending.snapshot
        if snap is None:
            raise CheckpointError(f"checkpoint {folder.name} was taken on a process that does not write it")
        store = self.compressor.store
        if store is None:
            raise CheckpointError(f"checkpoint {folder.name}: the compressor has no store to write into")
        snap.extras = collect_small_files(folder, small_files)
        stall = time.perf_counter() - pending.started + stall_before
        name, run_dir, searched = folder.name, folder.parent, pending.searched

        def mark(report: CheckpointReport) -> None:
            if folder.is_dir():  # a rotation keeping one folder may already have removed it
                write_marker(folder, store, name, report.entry, snap.step)
                if remove_plain_files:
                    remove_uncompressed(folder)
            release_rotated(store, run_dir, keep={name}, every_ref=every_ref)

        self._submit(name, snap, searched, stall, after=mark)

    def save(self, step: int, *, ref: str | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``step`` of a loop without a framework (reference ``ref``, default
        ``step-<step>``): snapshot it now, encode and write it on the background thread (or now,
        without one). A save while the previous checkpoint is still being encoded waits for it.
        With a collective compressor (:class:`~hf_dynaquant.training.sharded.ShardedCompressor`)
        every rank calls it and writes its own shard; otherwise rank 0 writes. The report reaches
        :attr:`reports` once the write is collected (:meth:`check`, :meth:`wait`, the next save)."""
        writer = self.compressor.collective_write or rank_world()[0] == 0
        pending = self.take(step, writer=writer, metadata=metadata)
        snap = pending.snapshot
        if snap is None:
            return
        stall = time.perf_counter() - pending.started
        self._submit(ref or f"step-{step}", snap, pending.searched, stall)

    def _submit(
        self,
        name: str,
        snap: Snapshot,
        searched: SearchResult | None,
        stall: float,
        after: Callable[[CheckpointReport], None] | None = None,
    ) -> None:
        """Encode and write ``snap`` as ``name`` on the background thread (its collectives on
        :attr:`group`), or now; ``after`` then runs with the report (markers, rotation)."""

        def job() -> CheckpointReport:
            progress = self.progress if self.progress is not None else snap.nbytes() > PROGRESS_BYTES
            try:
                report = self.compressor.write(snap, ref=name, progress=progress, searched=searched)
            finally:
                snap.release()
            if searched is None and report.search is not None:
                self.chosen.append((snap.step, report.search.get("config")))
            if after is not None:
                after(report)
            return replace(report, stall_seconds=stall)

        if self.worker is None:
            self._collect(job())
            return

        def on_own_group() -> CheckpointReport:
            with on_group(self.group):
                return job()

        self.worker.submit(name, on_own_group if self.group is not None else job)

    def save_plainly(self, step: int, *, keep_last: int | None = None) -> bool:
        """Whether checkpoint ``step`` is to be saved plainly by the framework because the one
        before it is still being encoded (see the module docstring); if so, it is recorded in
        :attr:`plain_steps` and logged. ``keep_last``: how many checkpoint folders the
        framework's rotation keeps (``None``: all). Raises the finished job's error, if any."""
        self.check()
        busy = self.worker is not None and self.worker.busy()
        rotated_away = keep_last is not None and keep_last < 2  # the folder in flight would be deleted
        if not busy or self.compressor.settings.busy_saves == "wait" or is_distributed() or rotated_away:
            return False
        self.plain_steps.append(step)
        self.compressor.ema.reset()  # (its window's average, which a plain save does not read)
        logger.info(
            "hf_dynaquant: checkpoint %d saved uncompressed: the previous checkpoint is still being encoded "
            "(saves come faster than the encoder; %d so far)",
            step,
            len(self.plain_steps),
        )
        return True

    def check(self) -> None:
        """Collect the checkpoint in flight if it has finished (raising its error, if any)."""
        if self.worker is not None:
            self._collect(self.worker.check())

    def wait(self) -> None:
        """Block until the checkpoint in flight is written (raising its error, if any)."""
        if self.worker is not None:
            self._collect(self.worker.wait())

    def close(self) -> None:
        """Wait for the checkpoint in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            if self.worker is not None:
                self.worker.close()
                self.worker = None

    # -- resuming -----------------------------------------------------------------------------
    def resume(self, entry: str, *, continue_chain: bool) -> None:
        """Training goes on from stored ``entry`` (an id or a reference, the same on every rank),
        whose decoded weights and optimizer state are loaded: with ``continue_chain`` (the
        writing process, which has the store) the next checkpoint is a delta on it; every rank
        rounds stochastically with the same seed and searches on from rank 0's configuration."""
        if continue_chain:
            self.compressor.continue_chain(entry)
        self.compressor.resumed_from(entry)
        if self.compressor.search is not None:
            self.compressor.search.agree()

    def _collect(self, report: CheckpointReport | None) -> None:
        if report is None:
            return
        self.reports.append(report)
        if self.on_report is not None:
            self.on_report(report)
