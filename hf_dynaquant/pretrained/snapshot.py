"""DynaQuant snapshots (Hub-ready compressed model folders) decoded back into plain model folders.

A snapshot is a model folder whose weights live in a DynaQuant store (``dynaquant/``, FORMAT.md)
and whose ``config.json`` names ``quantization_config.quant_method: dynaquant``;
:func:`hf_dynaquant.compress_pretrained` writes them. Decoding one gives a plain model folder
(float safetensors, ``config.json`` without the quantization entries) that any transformers loads.

Decoded copies are kept in a cache (``$HF_DYNAQUANT_CACHE`` or ``~/.cache/hf_dynaquant/decoded``)
keyed by everything the copy is made of (:func:`snapshot_key`), so a snapshot is decoded once,
and an edited one afresh. Two callers use it: :func:`hf_dynaquant.from_pretrained` (after
downloading the snapshot, :func:`hf_dynaquant.integrations.hub.materialize_snapshot`) and
:class:`~hf_dynaquant.pretrained.weights.PretrainedWeights`, whose reference values for a model
loaded from a local snapshot are the decoded copy's. This module is the part of that which needs
no Hub client, so the pre-trained layer does not import the Hub integration above it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, DynaQuantError
from ..store.atomic import atomic_write_json, publish_folder, staging_folder
from .folder import MODEL_REF, STORE_DIR, decompress_folder, find_store

__all__ = [
    "QUANT_METHOD",
    "CONFIG",
    "read_config",
    "is_snapshot",
    "decode_cache",
    "snapshot_key",
    "decode_snapshot",
    "cached_decode",
    "materialize_local_snapshot",
]

QUANT_METHOD = "dynaquant"  # config.json quantization_config.quant_method of a snapshot
CONFIG = "config.json"


def read_config(folder: Path) -> dict[str, Any]:
    """The ``config.json`` of a model folder; a missing one is a :class:`DynaQuantError` (not a
    model folder), an unreadable one a :class:`CorruptCheckpointError`."""
    path = folder / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DynaQuantError(f"{folder}: no {CONFIG}; not a Hugging Face model folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({exc})") from None


def is_snapshot(folder: Path) -> bool:
    """Whether ``folder``'s ``config.json`` names the DynaQuant quantization method (False for a
    missing or unreadable one)."""
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD


def decode_cache(cache_dir: str | Path | None) -> Path:
    """Where decoded copies are kept: ``cache_dir``, else ``$HF_DYNAQUANT_CACHE``, else
    ``~/.cache/hf_dynaquant/decoded`` (read at call time)."""
    root = cache_dir or os.environ.get("HF_DYNAQUANT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hf_dynaquant" / "decoded"


def snapshot_key(folder: Path) -> str:
    """What a decoded copy of the snapshot ``folder`` is made of, as one hex key: its entry id
    (a hash of the manifest, which lists every payload blob's SHA-256) and the path and SHA-256
    of every other file that decoding copies (config, tokenizer, ...)."""
    key = hashlib.sha256(find_store(folder).resolve(MODEL_REF).encode())
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if rel.parts[0] != STORE_DIR and path.is_file():
            with open(path, "rb") as fh:
                digest = hashlib.file_digest(fh, "sha256").digest()
            key.update(rel.as_posix().encode() + b"\0" + digest)
    return key.hexdigest()[:32]


def decode_snapshot(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write a snapshot folder back as a plain model folder (float safetensors; config.json
    without ``quantization_config`` and ``transformers_weights``) that any transformers loads."""
    dst = Path(dst)
    with staging_folder(dst) as staging:
        decompress_folder(src, staging / "plain", progress=False)
        config = read_config(staging / "plain")
        config.pop("quantization_config", None)
        config.pop("transformers_weights", None)
        atomic_write_json(staging / "plain" / CONFIG, config, sort_keys=True)
        publish_folder(staging / "plain", dst, overwrite)
    return dst


def cached_decode(src: Path, label: Path, cache_dir: str | Path | None = None) -> Path:
    """The decoded copy of the (already checked) snapshot folder ``src`` in the decode cache,
    at ``<cache>/<label>/<snapshot key>``; decoded now when it is not there yet. Another process
    decoding the same snapshot at the same time is harmless: the first to publish wins."""
    target = decode_cache(cache_dir) / label / snapshot_key(src)
    if not target.is_dir():
        try:
            decode_snapshot(src, target)
        except DynaQuantError:
            if not target.is_dir():  # not merely decoded meanwhile by another process
                raise
    return target


def materialize_local_snapshot(folder: Path, *, cache_dir: str | Path | None = None) -> Path:
    """The plain model folder of the local snapshot ``folder``, decoded once into the cache
    (:func:`cached_decode`, under ``local/``). The snapshot is checked where it is on every call
    (every blob checksum), so a damaged payload is a :class:`CorruptCheckpointError`, never an
    earlier decode; a folder that is not a DynaQuant snapshot is a :class:`DynaQuantError`."""
    config = read_config(folder)  # a missing or unreadable config.json is named as such
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != QUANT_METHOD:
        raise DynaQuantError(f"{folder}: not a DynaQuant snapshot (config.json names no quant_method dynaquant)")
    # damage only: a dead writer's files harm no read, and a decode names missing pre-trained weights itself
    problems = find_store(folder).verify(leftovers=False, pretrained=False)
    if problems:
        raise CorruptCheckpointError(f"{folder}: the snapshot is damaged: " + "; ".join(problems))
    return cached_decode(folder, Path("local"), cache_dir)
