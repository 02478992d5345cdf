"""The pre-trained weights a fine-tune started from, as a reference a decoder can find again.

A fine-tune barely moves its weights away from the pre-trained values, so its checkpoints are
far smaller coded as *residuals* against those values (BitDelta, DeltaZip). That only works if
the decoder has the very same pre-trained values when it restores a checkpoint, maybe in another
process, weeks later. :class:`PretrainedWeights` is that reference:

- where it comes from: a local folder, or a Hub repo already in the local Hugging Face cache
  (``HF_HUB_CACHE``; nothing is ever downloaded), at a recorded revision;
- what it is made of: the safetensors files used, each with its size and SHA-256, and which file
  key holds the value of each model state-dict name (:attr:`PretrainedWeights.descriptor`, small
  JSON stored in an entry's metadata under ``"pretrained"``);
- its values, loaded lazily tensor by tensor as CPU float32 (:meth:`PretrainedWeights.tensor`).

:func:`resolve_pretrained` turns a descriptor back into the weights, checking every file's size
and SHA-256; anything missing or different is a :class:`MissingPretrainedError` that names the
source, the file and the entry. It is registered with the store when this module is imported
(:func:`~hf_dynaquant.store.set_pretrained_resolver`), so entry readers decode residuals with it
without the store importing this layer. Only safetensors files are read: ``pytorch_model.bin``
(pickle) is never loaded.

Names are matched as transformers matches them when it loads a checkpoint: the same name, or the
name with or without the model's ``base_model_prefix`` (a head model such as
``AutoModelForSequenceClassification`` loaded from a base checkpoint whose keys have no ``bert.``
prefix, or the reverse), and only where the shapes agree. Tensors with no pre-trained value (a
new classification head) are simply absent from :meth:`PretrainedWeights.names`; integer
buffers (``position_ids``) are never references.

A model loaded with :func:`hf_dynaquant.from_pretrained` from a DynaQuant snapshot is a plain
model loaded from the decoded folder in the decode cache, so that folder (the decoded snapshot
weights, which the model starts from) is its reference. A model loaded with
``AutoModel.from_pretrained(<snapshot>)`` after ``import hf_dynaquant`` names the snapshot itself:
it is decoded once into the same cache
(:func:`~hf_dynaquant.pretrained.snapshot.materialize_local_snapshot`, local files only) and that
decoded folder is the reference.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import FormatError, MissingPretrainedError
from ..store import set_pretrained_resolver
from .snapshot import is_snapshot, materialize_local_snapshot

__all__ = ["PretrainedWeights", "resolve_pretrained", "describe_pretrained", "file_sha256", "DESCRIPTOR_VERSION"]

logger = logging.getLogger(__name__)

DESCRIPTOR_VERSION = 1
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors dtype names
_CHUNK = 1 << 22

_lock = threading.Lock()
_HASHES: dict[tuple[str, int, int], str] = {}  # (real path, size, mtime_ns) -> sha256 hex
_RESOLVED: dict[str, PretrainedWeights] = {}  # canonical descriptor JSON -> weights


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file, read in chunks; computed once per process for a given real path,
    size and modification time (pre-trained files are large and hashed on every resolve)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    with _lock:
        cached = _HASHES.get(key)
    if cached is None:
        digest = hashlib.sha256()
        with open(real, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
        cached = digest.hexdigest()
        with _lock:
            _HASHES[key] = cached
    return cached


def _stat(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


class PretrainedWeights:
    """Read-only pre-trained weights, mapped onto a model's state-dict names.

    Build one with :meth:`from_model` (what ``from_pretrained`` loaded) or :meth:`from_source`
    (an explicit folder or cached repo id), or get one back from a stored descriptor with
    :func:`resolve_pretrained`. Tensors returned by :meth:`tensor` are shared and cached: never
    modify them in place."""

    def __init__(
        self,
        folder: Path,
        source: str,
        revision: str | None,
        tensors: Mapping[str, tuple[str, str]],
        *,
        origin: str | None = None,
        hashes: Mapping[str, str] | None = None,
    ) -> None:
        """Use the class methods; ``tensors`` maps model names to ``(file, key)`` in ``folder``,
        ``hashes`` (file -> SHA-256) are the already verified ones, ``origin`` the DynaQuant
        snapshot ``folder`` was decoded from, if any."""
        self._folder = folder
        self._source, self._revision, self._origin = source, revision, origin
        self._tensors = {name: (str(file), str(key)) for name, (file, key) in tensors.items()}
        files = sorted({file for file, _ in self._tensors.values()})
        self._stats = {file: _stat(folder / file) for file in files}
        self._hashes = dict(hashes or {})
        self._descriptor: dict[str, Any] | None = None
        self._handles: dict[str, Any] = {}
        self._values: dict[tuple[str, str], torch.Tensor] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        at = f"@{self._revision}" if self._revision else ""
        return f"PretrainedWeights({self._source}{at}, {len(self._tensors)} tensors)"

    @property
    def source(self) -> str:
        """The folder path (absolute) or Hub repo id the weights come from."""
        return self._source

    @property
    def revision(self) -> str | None:
        """The Hub commit of a cached repo (None for a folder)."""
        return self._revision

    @property
    def folder(self) -> Path:
        """The local folder the files are read from (a snapshot folder for a cached repo)."""
        return self._folder

    @property
    def descriptor(self) -> dict[str, Any]:
        """JSON for an entry's metadata: version, source, revision, each file's size and SHA-256,
        and ``tensors``: model name -> ``[file, key]``. Hashing is done on first access (once per
        process per file), not when the object is made."""
        with self._lock:
            if self._descriptor is None:
                files = {}
                for file, (size, _) in self._stats.items():
                    if file not in self._hashes:
                        self._hashes[file] = file_sha256(self._folder / file)
                    files[file] = {"sha256": self._hashes[file], "size": size}
                self._descriptor = {
                    "version": DESCRIPTOR_VERSION,
                    "source": self._source,
                    "revision": self._revision,
                    "files": files,
                    "tensors": {name: list(self._tensors[name]) for name in sorted(self._tensors)},
                }
                if self._origin:
                    self._descriptor["decoded_from"] = self._origin
                with _lock:
                    _RESOLVED.setdefault(_descriptor_key(self._descriptor, None), self)
            return self._descriptor

    def names(self) -> list[str]:
        """The model state-dict names that have a pre-trained value, sorted."""
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The pre-trained value of model tensor ``name``: CPU float32 in the model tensor's
        shape (bf16/fp16 files are cast), loaded on first use and cached. A file that changed
        on disk since it was found is a :class:`MissingPretrainedError`."""
        try:
            file, key = self._tensors[name]
        except KeyError:
            raise KeyError(f"{self!r} has no pre-trained value for {name!r}") from None
        with self._lock:
            value = self._values.get((file, key))
            if value is None:
                path = self._folder / file
                try:
                    changed = _stat(path) != self._stats[file]
                except OSError:
                    changed = True
                if changed:
                    raise MissingPretrainedError(
                        f"tensor {name!r}", self._source, "changed or vanished on disk since it was checked",
                        file=file, revision=self._revision,
                    )
                handle = self._handles.get(file)
                if handle is None:
                    handle = self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
                value = handle.get_tensor(key).to(torch.float32)
                self._values[(file, key)] = value
        return value

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: Any) -> PretrainedWeights | None:
        """The weights ``model`` was loaded from by ``from_pretrained``: ``model.name_or_path``
        (or ``config._name_or_path``) as a local folder, else as a Hub repo in the local cache
        at ``config._commit_hash`` where transformers set it (4.x; 5.x records no commit, so the
        cache's ``main`` is used and its commit recorded). A config copied from a pre-trained
        model names that model too: harmless, the residual is then merely not smaller. None,
        with the reason logged, when the model names no
        source (built from a config), the source is not here, holds only pickle files, or no
        tensor matches."""
        config = getattr(model, "config", None)
        source = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
        if not source:
            logger.info("no pre-trained weights: the model names no source (it was not loaded with from_pretrained)")
            return None
        state = model.state_dict()
        names = {name: tuple(t.shape) for name, t in state.items() if t.is_floating_point()}
        prefix = getattr(model, "base_model_prefix", None) or None
        try:
            weights = cls._open(str(source), getattr(config, "_commit_hash", None), names, prefix, "the model")
        except MissingPretrainedError as exc:
            logger.warning("no pre-trained weights for residual coding: %s", exc)
            return None
        if not weights._tensors:
            logger.warning("no pre-trained weights: no tensor of %s matches the model's names and shapes", source)
            return None
        weights._add_tied(state)
        return weights

    @classmethod
    def from_source(
        cls,
        source: str | os.PathLike,
        model_names: Mapping[str, tuple[int, ...]],
        *,
        revision: str | None = None,
        base_model_prefix: str | None = None,
    ) -> PretrainedWeights:
        """Pre-trained weights from an explicit folder or Hub repo id (in the local cache, at
        ``revision`` or its ``main``), mapped onto ``model_names`` (name -> shape). Without
        ``base_model_prefix`` the prefix that matches most names is used (see the module
        docstring). :class:`MissingPretrainedError` when the source is not here or holds no
        safetensors weights."""
        return cls._open(str(source), revision, dict(model_names), base_model_prefix, f"pretrained={str(source)!r}")

    @classmethod
    def _open(
        cls, source: str, revision: str | None, names: Mapping[str, tuple[int, ...]], prefix: str | None, where: str
    ) -> PretrainedWeights:
        folder, source, revision = _locate(source, revision, where)
        origin = None
        if is_snapshot(folder):
            origin = f"{source}@{revision}" if revision else source
            folder = materialize_local_snapshot(folder)
            source, revision = str(folder.resolve()), None
        available = _float_keys(folder, _weight_files(folder, source, revision, where))
        tensors = _match(names, available, prefix)
        return cls(folder, source, revision, tensors, origin=origin)

    def _add_tied(self, state: Mapping[str, torch.Tensor]) -> None:
        """Names that share storage with a matched name (tied weights) get its reference too."""
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for name, t in state.items():
            if t.is_floating_point() and t.numel():
                groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
        for group in groups.values():
            hit = next((self._tensors[name] for name in group if name in self._tensors), None)
            if hit is not None:
                for name in group:
                    self._tensors.setdefault(name, hit)


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE  # read at call time: HF_HUB_CACHE, or as tests set it


def _cached_repo(repo_id: str, revision: str | None) -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` (a commit, a branch, or main) in the
    local Hugging Face cache when it holds weights (or only pickle ones, or a config: a DynaQuant
    snapshot, or to say what is missing), else None. Never touches the network."""
    from huggingface_hub import try_to_load_from_cache

    for name in (SINGLE_FILE, INDEX_FILE, *PICKLE_FILES, "config.json"):
        try:
            found = try_to_load_from_cache(repo_id, name, cache_dir=_hub_cache(), revision=revision)
        except ValueError:  # HFValidationError: not a repo id
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def _locate(source: str, revision: str | None, where: str) -> tuple[Path, str, str | None]:
    """``(folder, source, revision)``: a local folder (source made absolute, no revision), else
    the cached repo's snapshot folder (revision: its commit)."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path.resolve()
        return path, str(path), None
    snapshot = _cached_repo(source, revision)
    if snapshot is None:
        raise MissingPretrainedError(
            where, source, f"are neither a local folder nor a repo in the local Hugging Face cache ({_hub_cache()})",
            revision=revision,
        )
    return snapshot, source, snapshot.name  # snapshots/<commit>


def _weight_files(folder: Path, source: str, revision: str | None, where: str) -> list[str]:
    """The safetensors files of the weights: ``model.safetensors``, else the shards its index
    names. Pickle-only weights are refused (never unpickled)."""
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"have an unreadable {INDEX_FILE} ({exc})"
            raise MissingPretrainedError(where, source, problem, file=INDEX_FILE, revision=revision) from exc
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            problem = "lack a shard their index names"
            raise MissingPretrainedError(where, source, problem, file=missing[0], revision=revision)
        return files
    pickled = any((folder / name).exists() for name in PICKLE_FILES)
    problem = (
        "hold only pickle weights (pytorch_model.bin), which are never loaded"
        if pickled
        else "hold no model.safetensors"
    )
    raise MissingPretrainedError(where, source, problem, revision=revision)


def _float_keys(folder: Path, files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Floating-point keys of the files (headers only): key -> (file, shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                if sl.get_dtype() in _FLOAT_DTYPES:
                    out[key] = (file, tuple(sl.get_shape()))
    return out


def _toggle_prefix(name: str, prefix: str) -> str:
    """``name`` with ``prefix.`` removed when it has it, else added."""
    head = prefix + "."
    return name[len(head):] if name.startswith(head) else head + name


def _match(
    names: Mapping[str, tuple[int, ...]], available: Mapping[str, tuple[str, tuple[int, ...]]], prefix: str | None
) -> dict[str, tuple[str, str]]:
    """Model name -> (file, key): the same name, else with/without ``prefix`` (inferred when
    None: the first name component, of model names or file keys, that matches most names);
    only where the shapes agree."""

    def lookup(name: str, key: str) -> tuple[str, str] | None:
        hit = available.get(key)
        return (hit[0], key) if hit is not None and hit[1] == tuple(names[name]) else None

    if prefix is None:
        firsts = {k.split(".", 1)[0] for k in (*names, *available) if "." in k}
        scores = {p: sum(lookup(n, _toggle_prefix(n, p)) is not None for n in names) for p in sorted(firsts)}
        prefix = max(scores, key=scores.__getitem__) if scores and max(scores.values()) else None
    out = {}
    for name in names:
        hit = lookup(name, name) or (lookup(name, _toggle_prefix(name, prefix)) if prefix else None)
        if hit is not None:
            out[name] = hit
    return out


def describe_pretrained(descriptor: Any) -> str:
    """One line for people (``hf-dynaquant inspect``): source, revision, files, tensor count."""
    try:
        at = f" @ {descriptor['revision']}" if descriptor.get("revision") else ""
        origin = f", decoded from {descriptor['decoded_from']}" if descriptor.get("decoded_from") else ""
        files = ", ".join(sorted(descriptor["files"]))
        return f"{descriptor['source']}{at} ({files}; {len(descriptor['tensors'])} tensors{origin})"
    except (KeyError, TypeError, AttributeError):
        return f"malformed descriptor {str(descriptor)[:80]!r}"


# -- finding them again ------------------------------------------------------------------------


def _descriptor_key(descriptor: Mapping[str, Any], override: str | None) -> str:
    return json.dumps([descriptor, override], sort_keys=True)


def resolve_pretrained(
    descriptor: Mapping[str, Any], where: str, *, source: str | os.PathLike | None = None
) -> PretrainedWeights:
    """The pre-trained weights an entry's ``metadata["pretrained"]`` descriptor names, found
    again: the recorded folder, else the cached Hub repo at the recorded revision (or the
    folder/repo ``source`` when given, e.g. after the files moved). Every file's size and
    SHA-256 is checked (hashes cached per process); the object is cached per descriptor.
    ``where`` (the entry or checkpoint) is named in every error: a missing or different file is
    a :class:`MissingPretrainedError`, a malformed descriptor a :class:`FormatError`."""
    try:
        version = descriptor["version"]
        recorded, revision = str(descriptor["source"]), descriptor.get("revision")
        files = {str(f): (str(v["sha256"]), int(v["size"])) for f, v in descriptor["files"].items()}
        tensors = {str(n): (str(f), str(k)) for n, (f, k) in descriptor["tensors"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{where}: malformed pre-trained weights descriptor ({exc!r})") from exc
    if version != DESCRIPTOR_VERSION:
        raise FormatError(f"{where}: pre-trained weights descriptor version {version!r} is not supported")
    override = None if source is None else str(source)
    key = _descriptor_key(descriptor, override)
    if override is not None:
        folder, _, _ = _locate(override, revision, where)
    else:
        try:
            folder, _, _ = _locate(recorded, revision, where)
        except MissingPretrainedError:
            origin = descriptor.get("decoded_from")
            hint = (
                f" (decoded from the DynaQuant snapshot {origin}: load it again with hf_dynaquant.from_pretrained)"
                if origin
                else ""
            )
            raise MissingPretrainedError(where, recorded, "are not here" + hint, revision=revision) from None
    shown = override or recorded
    for file, (sha, size) in files.items():
        path = folder / file
        if not path.is_file():
            raise MissingPretrainedError(where, shown, "is missing", file=file, revision=revision)
        if os.path.getsize(path) != size:
            raise MissingPretrainedError(
                where,
                shown,
                f"has {os.path.getsize(path)} bytes, not the {size} recorded",
                file=file,
                revision=revision,
            )
        if file_sha256(path) != sha:
            problem = "differs from the recorded one (SHA-256)"
            raise MissingPretrainedError(where, shown, problem, file=file, revision=revision)
    with _lock:
        cached = _RESOLVED.get(key)
        if cached is not None and cached.folder == folder and all(
            cached._stats.get(f) == _stat(folder / f) for f in files
        ):
            return cached
    weights = PretrainedWeights(
        folder, recorded, revision, tensors, origin=descriptor.get("decoded_from"),
        hashes={f: sha for f, (sha, _) in files.items()},
    )
    weights._descriptor = dict(descriptor)
    with _lock:
        _RESOLVED[key] = weights
    return weights


set_pretrained_resolver(resolve_pretrained)  # how store entries find their pre-trained weights (see the store's hook)
