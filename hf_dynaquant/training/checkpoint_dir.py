"""Compressed training-checkpoint folders: the marker, resuming, materialising, rotation.

A framework (the Trainer, Accelerate) writes ``checkpoint-N`` folders and rotates them. Our
weights and optimizer state live in one :class:`~hf_dynaquant.store.CheckpointStore` *outside*
those folders (``<output_dir>/dynaquant/``), because rotation deletes whole folders and a delta
chain must survive the deletion of the folder its base belonged to. Each compressed folder
holds a small marker, ``dynaquant.json``:

.. code-block:: json

    {"format": "hf_dynaquant.checkpoint", "version": 1, "store": "../dynaquant",
     "ref": "checkpoint-500", "entry": "<sha256 of the manifest>", "step": 500}

written atomically *after* the entry is durable, so a folder with a marker is always complete.
The store names each checkpoint by a reference equal to the folder name; when a folder is gone,
:func:`release_rotated` drops its reference and :meth:`CheckpointStore.gc` deletes what no
reference reaches any more (bases of live deltas stay). The framework's own small files
(trainer state, scheduler, RNG) stay in the folder as they are, and a copy goes into the entry's
extras (zstd-compressed), so the store alone can rebuild a folder that a crash or an early
rotation lost.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import zstandard

from ..errors import FormatError, IncompleteCheckpointError, MissingOptimizerStateError
from ..store import STORE_DIR, CheckpointStore
from ..store.atomic import atomic_write_bytes, atomic_write_json
from .compressor import read_checkpoint

__all__ = [
    "MARKER",
    "UNCOMPRESSED_FILES",
    "RESUME_FILES",
    "checkpoint_store",
    "read_marker",
    "write_marker",
    "is_complete",
    "last_complete_checkpoint",
    "numbered_checkpoints",
    "remove_uncompressed",
    "release_rotated",
    "collect_small_files",
    "materialize_checkpoint",
    "rebuild_folder",
    "restore_optimizer",
]

MARKER = "dynaquant.json"
MARKER_FORMAT = "hf_dynaquant.checkpoint"
MARKER_VERSION = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint[-_](\d+)$")  # the Trainer's checkpoint-N, Accelerate's checkpoint_N
# what the compressed form replaces (removed from a folder once the entry is durable)
UNCOMPRESSED_FILES = ("model.safetensors", "pytorch_model.bin", "optimizer.pt", "optimizer.bin")
_UNCOMPRESSED_PATTERNS = ("model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin*")
_SMALL_FILE_LIMIT = 16 << 20  # framework files copied into the entry's extras
RESUME_FILES = ("trainer_state.json", "scheduler.pt", "scaler.pt", "rng_state*.pth")


def checkpoint_store(run_dir: str | Path, *, create: bool = True) -> CheckpointStore:
    """The store of a run's compressed checkpoints (``<run_dir>/dynaquant``)."""
    return CheckpointStore(Path(run_dir) / STORE_DIR, create=create)


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The marker of a compressed checkpoint folder, or ``None`` for a folder without one."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: unreadable checkpoint marker ({exc})") from exc
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        raise FormatError(f"{path}: not an hf_dynaquant checkpoint marker")
    if marker.get("version", 0) > MARKER_VERSION:
        raise FormatError(f"{path}: marker version {marker.get('version')} is newer than this hf_dynaquant reads")
    return marker


def write_marker(folder: Path, store: CheckpointStore, ref: str, entry: str, step: int) -> None:
    """Atomically mark ``folder`` as the compressed checkpoint ``ref`` of ``store``."""
    marker = {
        "format": MARKER_FORMAT,
        "version": MARKER_VERSION,
        "store": Path(_relative(store.path, folder)).as_posix(),
        "ref": ref,
        "entry": entry,
        "step": step,
    }
    atomic_write_json(folder / MARKER, marker)


def _relative(target: Path, start: Path) -> str:
    return os.path.relpath(Path(target).resolve(), Path(start).resolve())


def marker_store(folder: str | Path, marker: dict[str, Any]) -> CheckpointStore:
    path = (Path(folder) / marker["store"]).resolve()
    if not CheckpointStore.is_store(path):
        raise IncompleteCheckpointError(f"{folder}: its store {path} is missing")
    return CheckpointStore(path, create=False)


def is_complete(folder: str | Path) -> bool:
    """Whether ``folder`` can be resumed: a marker whose entry exists, or the framework's own
    plain save, finished: weights, and the file the framework writes last (the Trainer's
    ``trainer_state.json`` in a ``checkpoint-N``, Accelerate's RNG states in a ``checkpoint_N``),
    so that a plain save killed half-way (one made while the encoder was busy) is not taken."""
    folder = Path(folder)
    marker = read_marker(folder)
    if marker is None:
        weights = any((folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")) or any(
            folder.glob("model-*-of-*.safetensors")
        )
        if folder.name.startswith("checkpoint-"):
            return weights and (folder / "trainer_state.json").is_file()
        if folder.name.startswith("checkpoint_"):
            return weights and any(folder.glob("random_states_*.pkl"))
        return weights
    try:
        store = marker_store(folder, marker)
        return marker["entry"] in store.entries()
    except IncompleteCheckpointError:
        return False


def numbered_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def last_complete_checkpoint(
    run_dir: str | Path, *, repair: bool = True, store: CheckpointStore | None = None
) -> Path | None:
    """The newest ``checkpoint-N`` (or ``checkpoint_N``) of ``run_dir`` that can be resumed.

    A folder whose compression was cut short (a crash after the framework's save) is skipped,
    unless its entry did reach the store (the crash came between the entry and the marker):
    then, with ``repair``, the marker is written and the folder used. ``store``: the run's
    store when it is not ``<run_dir>/dynaquant`` (Accelerate keeps it beside ``checkpoints/``)."""
    run_dir = Path(run_dir)
    if store is None and CheckpointStore.is_store(run_dir / STORE_DIR):
        store = checkpoint_store(run_dir, create=False)
    for _, folder in numbered_checkpoints(run_dir):
        if is_complete(folder):
            return folder
        if repair and store is not None and folder.name in store.refs():
            entry = store.refs()[folder.name]
            write_marker(folder, store, folder.name, entry, int(store.info(entry).metadata.get("step", 0)))
            return folder
    if repair and store is not None:  # every folder lost (crash right after an early rotation)
        refs = sorted((int(m.group(1)), ref) for ref in store.refs() if (m := _CHECKPOINT_RE.match(ref)))
        if refs:
            folder = run_dir / refs[-1][1]
            rebuild_folder(store, refs[-1][1], folder)
            return folder
    return None


def remove_uncompressed(folder: Path) -> list[str]:
    """Delete the weight and optimizer files that the compressed entry replaces."""
    removed = []
    for pattern in UNCOMPRESSED_FILES + _UNCOMPRESSED_PATTERNS:
        for path in folder.glob(pattern):
            if path.is_file():
                path.unlink()
                removed.append(path.name)
    return removed


def release_rotated(
    store: CheckpointStore, run_dir: Path, keep: set[str] = frozenset(), *, every_ref: bool = False
) -> list[str]:
    """Drop the references of ``checkpoint-*`` folders the framework deleted, then collect
    garbage; returns the entries removed. References named in ``keep`` stay. With
    ``every_ref`` any reference counts as the name of a folder in ``run_dir`` (a store that
    only one run directory uses, whatever its folders are called)."""
    for ref in list(store.refs()):
        if (every_ref or _CHECKPOINT_RE.match(ref)) and ref not in keep and not (run_dir / ref).is_dir():
            store.delete_ref(ref)
    return store.gc()


def collect_small_files(folder: Path, patterns: tuple[str, ...] = RESUME_FILES) -> dict[str, bytes]:
    """The framework's files a resume reads besides weights and optimizer (by default the
    Trainer's: trainer state, scheduler, scaler, RNG; ``patterns`` names another framework's),
    zstd-compressed, for the entry's extras."""
    out = {}
    compressor = zstandard.ZstdCompressor(level=10)
    for pattern in patterns:
        for path in sorted(folder.glob(pattern)) if folder.is_dir() else []:
            if path.is_file() and path.stat().st_size <= _SMALL_FILE_LIMIT:
                out[f"file:{path.name}"] = compressor.compress(path.read_bytes())
    return out


def materialize_checkpoint(folder: str | Path, *, allow_missing_optimizer: bool = False) -> Path:
    """Write a compressed checkpoint back as the plain files a framework reads
    (``model.safetensors`` and ``optimizer.pt``), so an unmodified ``Trainer`` can resume from it;
    ``hf_dynaquant.materialize`` is this function (the name the README's resume recipe uses).

    ``folder`` may also be a run directory: its newest complete checkpoint is used. A folder
    lost to a crash or an early rotation is rebuilt from the store's copy of its small files.
    A checkpoint saved with ``optimizer_state="drop"`` raises :class:`CheckpointError` (a plain
    ``Trainer`` would silently start a fresh optimizer) unless ``allow_missing_optimizer``.
    Returns the checkpoint folder."""
    folder = Path(folder)
    if read_marker(folder) is None and not _CHECKPOINT_RE.match(folder.name):
        found = last_complete_checkpoint(folder)
        if found is None:
            raise IncompleteCheckpointError(f"{folder}: no complete checkpoint-* folder to resume from")
        folder = found
    marker = read_marker(folder)
    if marker is None:
        if is_complete(folder):
            return folder  # a plain checkpoint already
        raise IncompleteCheckpointError(f"{folder}: neither weights nor an hf_dynaquant marker (incomplete save?)")
    store = marker_store(folder, marker)
    state, optimizer, meta = read_checkpoint(store, marker["entry"])
    if optimizer is None:
        message = (
            f"{folder}: the checkpoint holds no optimizer state "
            f"(optimizer_state={meta.get('optimizer_state', {}).get('mode', 'absent')!r}); "
            "a plain Trainer would silently start a fresh optimizer"
        )
        if not allow_missing_optimizer:
            raise MissingOptimizerStateError(
                message + ": resume with DynaQuantTrainer (which says so and goes on), pass "
                "allow_missing_optimizer=True, or save with optimizer_state='compress' or 'lossless'"
            )
        warnings.warn(message + ": training resumes with a FRESH optimizer", stacklevel=2)
        (folder / "optimizer.pt").unlink(missing_ok=True)
    unique, seen = {}, set()
    for name, t in state.items():  # tied weights once, as save_pretrained does
        key = (t.data_ptr(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = t.contiguous()
    atomic_write_bytes(folder / "model.safetensors", safetensors.torch.save(unique, metadata={"format": "pt"}))
    if optimizer is not None:
        buffer = io.BytesIO()
        torch.save(optimizer, buffer)  # read back by the Trainer with torch.load(weights_only=True)
        atomic_write_bytes(folder / "optimizer.pt", buffer.getvalue())
    return folder


def rebuild_folder(store: CheckpointStore, ref: str, folder: Path) -> None:
    """Recreate a checkpoint folder's small files and marker from the store (disaster recovery)."""
    with store.open(ref) as entry:
        folder.mkdir(parents=True, exist_ok=True)
        for name in entry.extras:
            if name.startswith("file:"):
                atomic_write_bytes(folder / name[5:], zstandard.ZstdDecompressor().decompress(entry.extra(name)))
        step = int(entry.metadata.get("step", 0))
        write_marker(folder, store, ref, entry.id, step)


def restore_optimizer(optimizer: Any, state: dict[str, Any] | None, meta: dict[str, Any], where: str) -> None:
    """Load a decoded optimizer state into ``optimizer``, or say loudly why there is none: a
    checkpoint saved with ``optimizer_state="drop"`` warns (training goes on with a fresh
    optimizer, as its author chose), any other missing state raises."""
    if state is not None:
        optimizer.load_state_dict(state)
        return
    mode = meta.get("optimizer_state", {}).get("mode", "absent")
    if mode != "drop":
        raise MissingOptimizerStateError(f"{where}: no optimizer state in its entry (mode {mode!r})")
    message = (
        f"{where} was saved with optimizer_state='drop': training resumes with a FRESH optimizer "
        "(moments reset), which changes the run"
    )
    warnings.warn(message, stacklevel=3)
    logging.getLogger("hf_dynaquant").warning(message)
