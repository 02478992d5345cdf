"""The checkpoint store: immutable, content-addressed entries, delta chains, named references.

Layout (FORMAT.md is the specification)::

    <store>/store.json                       format marker and version
    <store>/entries/<id>/manifest.json.zst   canonical JSON, zstd'd; <id> = sha256 of the JSON bytes
    <store>/entries/<id>/payload.safetensors uint8 blobs, one or more per tensor
    <store>/refs/<name>.json                 {"entry": "<id>"}: a name for an entry

An entry is written in a temporary directory and renamed into place in one step, so a reader
never sees half an entry and a crash leaves every earlier entry intact. A *delta* entry names
its base by content id; restoring it replays the chain. Entries no reference reaches (directly
or as a base) are garbage; :meth:`CheckpointStore.gc` removes them, and
:meth:`CheckpointStore.compact` turns a delta into a self-contained keyframe.

Concurrency: one writer at a time per store; any number of readers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .._version import __version__
from ..codecs.base import Codec, Encoded, get_codec
from ..core.dtypes import RawTensor, ValuesInParts, dtype_name, from_raw, itemsize, storage_key, to_raw
from ..core.entropy import decode_stream, encode_stream
from ..core.memory import ReleaseFreed
from ..core.pool import VALUES_IN_FLIGHT, ForkSafePool, completed_map, ordered_map, tensor_weight
from ..core.quantizer import Coded
from ..errors import (
    CodecError,
    CorruptCheckpointError,
    DynaQuantError,
    EntryNotFoundError,
    MissingBaseError,
    MissingPretrainedError,
    StoreWriteError,
    UnsupportedTensorError,
)
from .atomic import (
    TempDir,
    atomic_write_bytes,
    dead_leftovers,
    fsync_dir,
    fsync_file,
    remove_dead_leftovers,
    size_on_disk,
)
from .manifest import (
    ENTRY_FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    canonical_json,
    check_store_marker,
    content_id,
    manifest_file,
    pack_manifest,
    parse_manifest,
    read_manifest_bytes,
    store_marker,
)
from .safetensors_io import PayloadFile, StreamingWriter, header_size_estimate, read_checked_blob
from .tree import DeferredTensor, flatten_tree, unflatten_tree

__all__ = ["CheckpointStore", "EntryReader", "EntryInfo", "PretrainedResolver", "set_pretrained_resolver"]

PAYLOAD = "payload.safetensors"
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_ID = re.compile(r"^[0-9a-f]{64}$")
# Tensors are encoded (and decoded) on a pool, one per core, each in full: the numeric kernels,
# torch, zstd and hashing release the GIL, so the cores overlap; a few tensors at a time bound
# the memory held by encodings waiting for their turn in the payload (which stays in order).
_TENSOR_POOL = ForkSafePool("dq-tensors")


PretrainedResolver = Callable[[Mapping[str, Any], str], Any]
"""``resolver(descriptor, where)``: the pre-trained weights an entry's ``metadata["pretrained"]``
descriptor names (an object whose ``tensor(name)`` is a model tensor's pre-trained value), found
again and checked; ``where`` names the entry in errors."""

_pretrained_resolver: PretrainedResolver | None = None


def set_pretrained_resolver(resolver: PretrainedResolver) -> None:
    """Name the function :meth:`EntryReader.pretrained` finds an entry's pre-trained weights with.

    Why a hook: a residual entry is decoded against the pre-trained weights its fine-tune started
    from, and finding those (a local folder, the Hugging Face cache, a decoded DynaQuant snapshot,
    each file's SHA-256 checked) is the job of the pre-trained layer above the store, which the
    store must not import. :mod:`hf_dynaquant.pretrained.weights` registers
    :func:`~hf_dynaquant.pretrained.weights.resolve_pretrained` when it is imported, and importing
    ``hf_dynaquant`` or any module of it (``hf_dynaquant.store`` included) imports it, so every
    reader finds it. Registering again replaces it (a test double, say)."""
    global _pretrained_resolver
    _pretrained_resolver = resolver


@dataclass(frozen=True)
class EntryInfo:
    """Summary of one entry, as listed by :meth:`CheckpointStore.info`."""

    id: str
    base: str | None
    nbytes: int  # bytes on disk (manifest + payload)
    raw_nbytes: int  # bytes of the tensors and extras it holds, uncompressed
    metadata: dict[str, Any]
    sections: dict[str, tuple[int, int]]  # section -> (raw bytes, stored blob bytes)

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.nbytes if self.nbytes else float("inf")


class _EntryWriter:
    """Builds one entry in a temporary directory; :meth:`finish` publishes it atomically."""

    def __init__(self, store: CheckpointStore, blob_keys_estimate: list[str]) -> None:
        self.store = store
        store.entries_dir.mkdir(parents=True, exist_ok=True)
        remove_dead_leftovers(store.entries_dir)  # a killed earlier write's; never a live writer's
        self.dir = TempDir(store.entries_dir)
        self.tmp = self.dir.path
        try:
            self.payload = StreamingWriter(self.tmp / PAYLOAD, header_size_estimate(blob_keys_estimate))
        except BaseException:
            self.dir.discard()
            raise
        self.sections: dict[str, dict[str, Any]] = {}
        self.extras: dict[str, Any] = {}
        self.uses_base = False

    def _blob(self, key: str, data: bytes | np.ndarray, digest: str | None = None) -> dict[str, Any]:
        view = _bytes_view(data)
        self.payload.add(key, "U8", (view.nbytes,), view)
        return {"file": 0, "key": key, "nbytes": view.nbytes, "sha256": digest or hashlib.sha256(view).hexdigest()}

    def add_encoded(
        self,
        section: str,
        name: str,
        raw: RawTensor | _RawSize,
        codec: Codec,
        enc: Encoded,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        """Add an encoded tensor's blobs and record; ``digests``: their SHA-256s where the
        encoder's thread took them already (:func:`blob_digests`)."""
        digests = digests or {}
        blobs = {b: self._blob(f"{section}/{name}/{b}", data, digests.get(b)) for b, data in enc.blobs.items()}
        self.uses_base |= enc.uses_base
        self.sections.setdefault(section, {})[name] = {
            "dtype": raw.dtype,
            "shape": list(raw.shape),
            "codec": codec.name,
            "codec_version": codec.version,
            "params": enc.params,
            "uses_base": enc.uses_base,
            "blobs": blobs,
            "raw_nbytes": raw.nbytes,
        }

    def copy_record(self, section: str, name: str, record: dict[str, Any], blobs: Mapping[str, np.ndarray]) -> None:
        """Carry a self-contained tensor over unchanged (compaction)."""
        new = dict(record)
        new["blobs"] = {b: self._blob(f"{section}/{name}/{b}", blobs[b]) for b in record["blobs"]}
        self.sections.setdefault(section, {})[name] = new

    def add_alias(self, section: str, name: str, target: str, raw_like: dict[str, Any]) -> None:
        self.sections.setdefault(section, {})[name] = {"alias_of": target, **raw_like}

    def add_extra(self, name: str, data: bytes) -> None:
        coding, payload = encode_stream(data)
        self.extras[name] = {"coding": coding, "size": len(data), **self._blob(f"extras/{name}", payload)}

    def finish(self, base: str | None, trees: dict[str, Any], metadata: dict[str, Any]) -> str:
        self.payload.close()
        manifest = {
            "format": ENTRY_FORMAT,
            "format_version": FORMAT_VERSION,
            "library": {"name": "hf_dynaquant", "version": __version__},
            "base": base if self.uses_base else None,
            "files": [PAYLOAD],
            "checksum": "sha256",
            "sections": self.sections,
            "trees": trees,
            "extras": self.extras,
            "metadata": metadata,
        }
        try:
            data = canonical_json(manifest)
        except ValueError as exc:
            raise DynaQuantError(f"metadata cannot be stored as JSON: {exc}") from None
        entry_id = content_id(data)
        (self.tmp / MANIFEST).write_bytes(pack_manifest(data))
        fsync_file(self.tmp / MANIFEST)
        fsync_dir(self.tmp)
        final = self.store.entries_dir / entry_id
        if final.exists():  # identical content already stored
            self.dir.discard()
        else:
            self.dir.publish(final)
            fsync_dir(self.store.entries_dir)
        return entry_id

    def abort(self) -> None:
        self.payload.abort()
        self.dir.discard()


class _Blobs:
    """The :class:`~hf_dynaquant.codecs.base.BlobSource` of one tensor of an open entry."""

    def __init__(self, reader: EntryReader, section: str, name: str, record: dict[str, Any]) -> None:
        self.reader, self.tensor, self.record = reader, f"{section}/{name}", record
        self.where = f"{reader.path / PAYLOAD} (tensor {self.tensor!r})"

    def __call__(self, blob: str) -> np.ndarray:
        try:
            info = self.record["blobs"][blob]
        except KeyError:
            raise CorruptCheckpointError(f"{self.where}: manifest lists no blob {blob!r}") from None
        return self.reader.read_checked(info, self.tensor, blob)


class EntryReader:
    """Read access to one entry; tensors are decoded one at a time, on demand."""

    def __init__(self, store: CheckpointStore, entry_id: str) -> None:
        self.store, self.id = store, entry_id
        self.path = store.entries_dir / entry_id
        found = manifest_file(self.path)
        if found is None:
            raise EntryNotFoundError(f"no entry {entry_id[:16]} in store {store.path}")
        self.manifest_path = found
        self.manifest = parse_manifest(read_manifest_bytes(found), found, entry_id)
        self._handles: dict[int, Any] = {}
        self._base: EntryReader | None = None
        self._pretrained: Any = None  # the PretrainedWeights of metadata["pretrained"], resolved once

    # -- structure -------------------------------------------------------------------------
    @property
    def base(self) -> str | None:
        return self.manifest["base"]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest["metadata"]

    @property
    def sections(self) -> list[str]:
        return list(self.manifest["sections"])

    @property
    def trees(self) -> list[str]:
        return list(self.manifest["trees"])

    @property
    def extras(self) -> list[str]:
        return list(self.manifest["extras"])

    def names(self, section: str) -> list[str]:
        return list(self._section(section))

    def record(self, section: str, name: str) -> dict[str, Any]:
        try:
            return self._section(section)[name]
        except KeyError:
            raise EntryNotFoundError(f"entry {self.id[:16]} has no tensor {name!r} in section {section!r}") from None

    def _section(self, section: str) -> dict[str, Any]:
        try:
            return self.manifest["sections"][section]
        except KeyError:
            raise EntryNotFoundError(
                f"entry {self.id[:16]} has no section {section!r} (has: {self.sections})"
            ) from None

    # -- blobs -----------------------------------------------------------------------------
    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            try:
                name = self.manifest["files"][index]
            except (IndexError, TypeError):
                raise CorruptCheckpointError(
                    f"{self.manifest_path}: blob refers to payload file #{index}, which the manifest does not list"
                ) from None
            self._handles[index] = PayloadFile(self.path / name)
        return self._handles[index]

    def read_checked(self, info: dict[str, Any], tensor: str, blob: str) -> np.ndarray:
        """Read one blob and check its SHA-256 against the manifest."""
        return read_checked_blob(self._handle(info["file"]), info, tensor, blob)

    # -- tensors ---------------------------------------------------------------------------
    def base_reader(self) -> EntryReader:
        """The entry this delta was coded against (opened once)."""
        if self.base is None:
            raise DynaQuantError(f"entry {self.id[:16]} is a keyframe; it has no base")
        if self._base is None:
            if manifest_file(self.store.entries_dir / self.base) is None:
                raise MissingBaseError(self.id, self.base, str(self.store.path))
            self._base = self.store.open(self.base)
        return self._base

    def pretrained(self) -> Any:
        """The :class:`~hf_dynaquant.pretrained.weights.PretrainedWeights` this entry's ``pretrained``
        residuals are coded against (resolved and checked once per entry);
        :class:`~hf_dynaquant.errors.MissingPretrainedError` when they cannot be found."""
        if self._pretrained is None:
            descriptor = self.metadata.get("pretrained")
            if descriptor is None:
                raise CorruptCheckpointError(
                    f"{self.manifest_path}: a tensor is a residual against pre-trained weights, but the entry's "
                    "metadata names none"
                )
            where = f"entry {self.id[:16]} in store {self.store.path}"
            if _pretrained_resolver is None:
                raise DynaQuantError(
                    f"{where}: its tensors are residuals against pre-trained weights, and nothing that finds "
                    "those weights is registered (import hf_dynaquant.pretrained, which registers it)"
                )
            self._pretrained = _pretrained_resolver(descriptor, where)
        return self._pretrained

    def state(self, section: str, name: str) -> Any:
        """The codec state of a tensor, replaying the chain back to its keyframe (and adding the
        reference values a residual is decoded with, see :meth:`Codec.reference_kind`)."""
        rec = self.record(section, name)
        if "alias_of" in rec:
            return self.state(section, rec["alias_of"])
        codec = get_codec(rec["codec"])
        base = self.base_reader().state(section, name) if rec["uses_base"] else None
        kind = codec.reference_kind(rec["params"])
        reference = None
        if kind == "previous":
            if base is None:
                raise CorruptCheckpointError(
                    f"{self.manifest_path}: tensor {name!r} is a residual against its base, but uses none"
                )
            reference = from_raw(self.base_reader()._codec(section, name).to_raw(base)).reshape(-1).float().numpy()
        elif kind == "pretrained":
            reference = self.pretrained().tensor(name).reshape(-1).to(torch.float32).numpy()
        elif kind is not None:
            raise CorruptCheckpointError(f"{self.manifest_path}: tensor {name!r} names an unknown reference {kind!r}")
        blobs = _Blobs(self, section, name, rec)
        return codec.decode(rec["dtype"], tuple(rec["shape"]), rec["params"], blobs, base, reference=reference)

    def raw(self, section: str, name: str) -> RawTensor:
        return self._codec(section, name).to_raw(self.state(section, name))

    def _codec(self, section: str, name: str) -> Codec:
        """The codec of a tensor (of its target, for an alias)."""
        rec = self.record(section, name)
        return get_codec(self.record(section, rec.get("alias_of", name))["codec"])

    def tensor(self, section: str, name: str) -> torch.Tensor:
        """One tensor, decoded (CPU)."""
        return from_raw(self.raw(section, name))

    def coded(self, section: str, name: str) -> Coded | torch.Tensor:
        """One tensor as its codes (:meth:`Codec.coded`) where it is stored quantized with
        nothing added, else decoded (:meth:`tensor`)."""
        state = self.state(section, name)
        codec = self._codec(section, name)
        codes = codec.coded(state)
        return codes if codes is not None else from_raw(codec.to_raw(state))

    def load_section(self, section: str, *, progress: bool = False) -> dict[str, torch.Tensor]:
        """All tensors of a section; aliases (tied weights) come back as the same tensor object."""
        records = self._section(section)
        out = dict(self.iter_section(section, progress=progress))
        return {name: out[name] for name in records}

    def iter_section(
        self, section: str, *, progress: bool = False, coded: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | Coded]]:
        """``(name, tensor)`` for every tensor of a section, decoded a few at a time on the
        pool (so a caller that consumes each tensor as it comes holds only those few), in the
        order they are done; an alias (a tied weight) comes right after its target, as the same
        tensor object. The names ``coded`` selects come as :meth:`coded` gives them (their
        codes, where they have plain ones), for a consumer that decodes them its own way. The
        tensors are decoded in stored order, except that those of a tree node
        (keys sharing their path up to the last ``/``: one optimizer parameter's state) holding a
        tensor over a quarter of the budget go first, still together. Last, a large tensor kept
        one thread busy while the others idled at the end (a 124M restore took 0.3 s longer);
        apart, a node's early tensors would wait for the rest, since its consumer converts a
        parameter once all of them are in."""
        records = self._section(section)
        targets = [n for n, rec in records.items() if "alias_of" not in rec]
        weight = {n: _weight(records[n]["dtype"], records[n]["shape"]) for n in targets}
        node = {n: n.rpartition("/")[0] or n for n in targets}
        heaviest: dict[str, int] = {}
        for n in targets:
            heaviest[node[n]] = max(heaviest.get(node[n], 0), weight[n])
        targets.sort(key=lambda n: heaviest[node[n]] <= VALUES_IN_FLIGHT // 4)  # (stable)
        aliases: dict[str, list[str]] = {}
        for name, rec in records.items():
            if "alias_of" in rec:
                aliases.setdefault(rec["alias_of"], []).append(name)
        self._prepare(section)
        with tqdm(total=len(records), desc=f"decoding {section}", unit="tensor", disable=not progress) as bar:
            tensors = completed_map(
                _TENSOR_POOL,
                lambda n: self.coded(section, n) if coded is not None and coded(n) else self.tensor(section, n),
                targets,
                weight=weight.__getitem__,
                budget=VALUES_IN_FLIGHT,
            )
            for name, tensor in tensors:
                for each in (name, *aliases.pop(name, [])):
                    yield each, tensor
                    bar.update()
            for names in aliases.values():  # aliases of no stored tensor: decoding raises what is wrong
                for name in names:
                    yield name, self.tensor(section, name)

    def _prepare(self, section: str) -> None:
        """Open the chain of bases, and resolve the pre-trained weights the section's residuals
        need, in this thread, once, before its tensors are decoded on several threads at once."""
        reader: EntryReader | None = self
        while reader is not None:
            records = reader.manifest["sections"].get(section, {}).values()
            if any(rec.get("params", {}).get("residual") == "pretrained" for rec in records):
                reader.pretrained()
            reader = reader.base_reader() if reader.base is not None else None

    def tree(self, name: str, *, leaf: Callable[[str], Any] | None = None) -> Any:
        """A nested structure stored with ``trees=`` (an optimizer state dict, say). ``leaf``:
        what stands for each tensor instead, given its key (the tensors are not decoded; a
        caller that takes them from :meth:`iter_section` itself holds only a few at a time)."""
        try:
            skeleton = self.manifest["trees"][name]
        except KeyError:
            raise EntryNotFoundError(f"entry {self.id[:16]} has no tree {name!r} (has: {self.trees})") from None
        if leaf is not None:
            return unflatten_tree(skeleton, leaf)
        tensors = dict(self.iter_section(name)) if name in self.manifest["sections"] else {}
        return unflatten_tree(skeleton, lambda key: tensors[key] if key in tensors else self.tensor(name, key))

    def extra(self, name: str) -> bytes:
        """Opaque bytes stored with ``extras=``."""
        try:
            info = self.manifest["extras"][name]
        except KeyError:
            raise EntryNotFoundError(f"entry {self.id[:16]} has no extra {name!r} (has: {self.extras})") from None
        payload = self.read_checked(info, f"extras/{name}", name)
        return decode_stream(
            info["coding"], payload, int(info["size"]), f"{self.path / PAYLOAD} (extra {name!r})"
        ).tobytes()

    def tensor_records(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """``(section, name, record)`` for every tensor."""
        for section, records in self.manifest["sections"].items():
            for name, rec in records.items():
                yield section, name, rec

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        if self._base is not None:
            self._base.close()

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointStore:
    """A directory of compressed checkpoints; see the module docstring for the layout.

    >>> store = CheckpointStore("ckpts")                               # doctest: +SKIP
    >>> eid = store.write({"model": model.state_dict()}, ref="step-100")
    >>> state = store.open("step-100").load_section("model")
    """

    def __init__(self, path: str | Path, *, create: bool = True, strict: bool = True) -> None:
        """Open the store at ``path`` (created when missing and ``create``). A damaged or newer
        ``store.json`` raises, unless ``strict=False`` (for :meth:`verify`, which reports it)."""
        self.path = Path(path)
        self.entries_dir = self.path / "entries"
        self.refs_dir = self.path / "refs"
        marker = self.path / "store.json"
        if marker.exists():
            if strict:
                check_store_marker(marker)
        elif create:
            self.entries_dir.mkdir(parents=True, exist_ok=True)
            self.refs_dir.mkdir(exist_ok=True)
            atomic_write_bytes(marker, store_marker())
        else:
            raise EntryNotFoundError(f"{self.path} is not an hf_dynaquant store (no store.json)")
        self.entries_dir.mkdir(exist_ok=True)
        self.refs_dir.mkdir(exist_ok=True)

    @staticmethod
    def is_store(path: str | Path) -> bool:
        return (Path(path) / "store.json").is_file()

    # -- references ------------------------------------------------------------------------
    def refs(self) -> dict[str, str]:
        """``{ref name: entry id}``. A damaged reference file raises :class:`CorruptCheckpointError`
        (:meth:`verify` reports it instead)."""
        refs, problems = self._read_refs()
        if problems:
            raise CorruptCheckpointError(problems[0])
        return refs

    def _read_refs(self) -> tuple[dict[str, str], list[str]]:
        """The readable references, and a problem line for each damaged one."""
        refs, problems = {}, []
        for p in sorted(self.refs_dir.glob("*.json")):
            if p.name.startswith(".tmp-"):
                continue
            data = b""
            try:
                data = p.read_bytes()
                entry = json.loads(data)["entry"]
                if not isinstance(entry, str) or not _ID.match(entry):
                    raise ValueError(f"entry id {entry!r} is not 64 hex digits")
                refs[p.stem] = entry
            except (OSError, ValueError, KeyError, TypeError) as exc:
                problems.append(f"{p}: damaged reference ({exc}); read {data[:200]!r}")
        return refs, problems

    def set_ref(self, name: str, entry_id: str) -> None:
        """Point reference ``name`` at an entry (atomically replacing any previous target)."""
        if not _REF.match(name):
            raise ValueError(f"invalid reference name {name!r}: use letters, digits, '.', '_' and '-'")
        if manifest_file(self.entries_dir / entry_id) is None:
            raise EntryNotFoundError(f"no entry {entry_id[:16]} in store {self.path}")
        try:
            atomic_write_bytes(self.refs_dir / f"{name}.json", canonical_json({"entry": entry_id}))
        except OSError as exc:
            raise StoreWriteError(f"store {self.path} (reference {name!r})", exc) from exc

    def delete_ref(self, name: str) -> None:
        """Remove a reference; the entries it kept alive become garbage for :meth:`gc`."""
        path = self.refs_dir / f"{name}.json"
        if not path.exists():
            raise EntryNotFoundError(f"no reference {name!r} in store {self.path}")
        path.unlink()
        fsync_dir(self.refs_dir)

    def resolve(self, ref_or_id: str) -> str:
        """Entry id for a reference name, a full id, or a unique id prefix (8+ hex digits)."""
        refs = self.refs()
        if ref_or_id in refs:
            return refs[ref_or_id]
        if _ID.match(ref_or_id) and (self.entries_dir / ref_or_id).is_dir():
            return ref_or_id
        if re.fullmatch(r"[0-9a-f]{8,63}", ref_or_id):
            hits = [e for e in self.entries() if e.startswith(ref_or_id)]
            if len(hits) == 1:
                return hits[0]
        raise EntryNotFoundError(f"store {self.path} has no reference or entry {ref_or_id!r} (refs: {sorted(refs)})")

    # -- entries ---------------------------------------------------------------------------
    def entries(self) -> list[str]:
        """Ids of all complete entries."""
        return sorted(p.name for p in self.entries_dir.iterdir() if _ID.match(p.name))

    def open(self, ref_or_id: str) -> EntryReader:
        return EntryReader(self, self.resolve(ref_or_id))

    def info(self, ref_or_id: str) -> EntryInfo:
        with self.open(ref_or_id) as r:
            sections: dict[str, tuple[int, int]] = {}
            for section, _, rec in r.tensor_records():
                raw, stored = sections.get(section, (0, 0))
                blobs = sum(b["nbytes"] for b in rec.get("blobs", {}).values())
                sections[section] = (raw + rec.get("raw_nbytes", 0), stored + blobs)
            raw = sum(v[0] for v in sections.values()) + sum(int(x["size"]) for x in r.manifest["extras"].values())
            disk = sum(p.stat().st_size for p in r.path.iterdir())
            return EntryInfo(r.id, r.base, disk, raw, r.metadata, sections)

    def chain(self, ref_or_id: str) -> list[str]:
        """The entry and its bases back to the keyframe, newest first."""
        out = [self.resolve(ref_or_id)]
        while True:
            with EntryReader(self, out[-1]) as r:
                if r.base is None:
                    return out
                if not (self.entries_dir / r.base).is_dir():
                    raise MissingBaseError(r.id, r.base, str(self.path))
                out.append(r.base)

    def write(
        self,
        sections: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
        *,
        trees: Mapping[str, Any] | None = None,
        extras: Mapping[str, bytes] | None = None,
        metadata: Mapping[str, Any] | None = None,
        codecs: Mapping[str, Codec | str] | Codec | str | Callable[[str, str], Codec | str] = "lossless",
        base: str | None = None,
        ref: str | None = None,
        progress: bool = False,
        base_states: dict[tuple[str, str], Any] | None = None,
        keep_states: dict[tuple[str, str], Any] | None = None,
        freed: ReleaseFreed | None = None,
    ) -> str:
        """Write one checkpoint as a new entry and return its id.

        Args:
            sections: named groups of tensors, e.g. ``{"model": model.state_dict()}``.
                Tensors sharing storage with an earlier one in the same section (tied weights)
                are stored once.
            trees: nested structures with tensors inside, e.g. ``{"optimizer": opt.state_dict()}``;
                their tensors form a section of the same name (a :class:`~hf_dynaquant.store.tree.DeferredTensor`
                leaf is made when it is encoded, and never taken for a tied tensor).
            extras: opaque bytes (scheduler state, RNG state); stored, never interpreted.
            metadata: small JSON (step, loss, ...).
            codecs: one codec (name or instance) for everything, ``{section: codec}`` (sections
                not named use ``lossless``), or a function ``(section, name) -> codec``.
            base: a reference or id to delta-code against; tensors whose codec gains nothing
                from it are stored self-contained, and an entry using no base is a keyframe.
            ref: a reference name to point at the new entry.
            progress: show a progress bar.
            base_states: ``{(section, name): state}`` of the base entry, as collected by
                ``keep_states`` when it was written; saves decoding the base's chain again. Each
                state is removed as its tensor is encoded, so the base's states and the new
                entry's are not all held at once.
            keep_states: a dict to fill with the states a later delta on this entry will need,
                in the form the codec keeps them (:meth:`Codec.kept <hf_dynaquant.codecs.base.Codec.kept>`:
                ``dynaquant``'s codes, packed; a copy of a small ``lossless`` tensor; a state the
                codec does not keep is read back from this entry by that delta).
            freed: what paces handing the encoders' freed memory back to the operating system
                (:class:`~hf_dynaquant.core.memory.ReleaseFreed`; default: every
                :data:`~hf_dynaquant.core.memory.TRIM_EVERY` values).

        The tensors are read while this runs; do not modify them concurrently.
        """
        groups: dict[str, Mapping[str, torch.Tensor]] = dict(sections or {})
        skeletons: dict[str, Any] = {}
        for tname, tree in (trees or {}).items():
            if tname in groups:
                raise ValueError(f"a tree and a section are both named {tname!r}")
            skeletons[tname], groups[tname] = flatten_tree(tree, where=f"tree {tname!r}")
        extras = dict(extras or {})
        for name, data in extras.items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"extra {name!r} must be bytes, got {type(data).__name__}")

        def codec_for(section: str, name: str) -> Codec:
            if isinstance(codecs, Mapping):
                return get_codec(codecs.get(section, "lossless"))
            return get_codec(codecs(section, name) if callable(codecs) and not isinstance(codecs, Codec) else codecs)

        base_reader = self.open(base) if base is not None else None
        base_id = base_reader.id if base_reader is not None else None
        keys = [
            f"{s}/{n}/c{i}"
            for s, group in groups.items()
            for n, numel in _numels(group).items()
            for i in range(codec_for(s, n).max_blobs(numel))
        ] + [f"extras/{n}" for n in extras]
        try:
            writer = _EntryWriter(self, keys)
        except BaseException as exc:
            if base_reader is not None:
                base_reader.close()
            if isinstance(exc, OSError):
                raise StoreWriteError(f"store {self.path}", exc) from exc
            raise

        def jobs() -> Iterator[_Job]:
            """The tensors to encode, in order (tied weights recorded as aliases on the way); a
            deferred one as it is, made when the pool takes it (``made``)."""
            for section, group in groups.items():
                seen = {}
                for name, tensor in group.items():
                    bar.update()
                    item: RawTensor | DeferredTensor = tensor
                    if not isinstance(tensor, DeferredTensor):  # (a deferred one's memory may be an earlier one's)
                        key = storage_key(tensor)
                        if key in seen:
                            alias_like = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
                            writer.add_alias(section, name, seen[key], alias_like)
                            continue
                        if key is not None:
                            seen[key] = name
                        item = to_raw(tensor, f"{section}/{name}")
                    if base_reader is not None and base_states is not None and (section, name) in base_states:
                        base_state = base_states.pop((section, name))
                    else:
                        base_state = _base_state(base_reader, section, name, *_dtype_and_shape(item))
                    yield section, name, item, codec_for(section, name), base_state

        def made(job: _Job) -> tuple[str, str, RawTensor | ValuesInParts, Codec, Any]:
            """The job with its deferred tensor made, as the pool takes it (in this thread, which
            goes on to the next while the pool encodes); one made in parts, for a codec that
            reads them, is made by the codec on the pool, a part at a time."""
            section, name, item, codec, base_state = job
            if not isinstance(item, DeferredTensor):
                return job
            if item.fill is not None and codec.reads_parts:
                return section, name, ValuesInParts(tuple(item.shape), item.fill), codec, base_state
            return section, name, _made(item, f"{section}/{name}"), codec, base_state

        def encode(job: tuple[str, str, RawTensor | ValuesInParts, Codec, Any]) -> _Encoded:
            section, name, raw, codec, base_state = job
            encoded = codec.encode(raw, base_state)
            if keep_states is None or not codec.stable_state:
                encoded.state = None  # not kept: let go now
            else:
                encoded.state = codec.kept(encoded.state)  # in the form kept, made here on the pool
            # the result keeps the raw tensor's dtype and size, not its bits (a made optimizer
            # update, say): a result waiting its turn then holds only its blobs and a kept state;
            # the blobs' checksums are taken here, on the pool, not by the thread that writes
            return section, name, _RawSize(raw.dtype, raw.shape, raw.nbytes), codec, encoded, blob_digests(encoded)

        try:
            total = sum(len(g) for g in groups.values())
            with tqdm(total=total, desc="compressing", unit="tensor", disable=not progress) as bar:
                # tensors are encoded a few at a time on the pool; their blobs go to the payload in order
                weigh = lambda job: _weight(*_dtype_and_shape(job[2]))  # noqa: E731
                encoded_jobs = ordered_map(
                    _TENSOR_POOL, encode, jobs(), weight=weigh, budget=VALUES_IN_FLIGHT, held=_held_weight, prepare=made
                )
                freed = freed if freed is not None else ReleaseFreed()
                for section, name, raw, codec, encoded, digests in encoded_jobs:
                    if encoded.uses_base and base_reader is None:
                        raise CodecError(
                            f"tensor {section}/{name} was coded against a base entry, but the write names none"
                        )
                    writer.add_encoded(section, name, raw, codec, encoded, digests)
                    if keep_states is not None and codec.stable_state and encoded.state is not None:
                        keep_states[(section, name)] = encoded.state
                    freed.processed(math.prod(raw.shape))
            for name, data in extras.items():
                writer.add_extra(name, bytes(data))
            return_id = writer.finish(base_id, skeletons, dict(metadata or {}))
        except OSError as exc:
            writer.abort()
            raise StoreWriteError(f"store {self.path}", exc, writer.tmp) from exc
        except BaseException:
            writer.abort()
            raise
        finally:
            if base_reader is not None:
                base_reader.close()
        if ref is not None:
            self.set_ref(ref, return_id)
        return return_id

    # -- maintenance -----------------------------------------------------------------------
    def reachable(self) -> set[str]:
        """Entries a reference reaches, directly or as a base."""
        alive: set[str] = set()
        for entry in self.refs().values():
            for eid in self._chain_lenient(entry):
                alive.add(eid)
        return alive

    def _chain_lenient(self, entry: str) -> Iterable[str]:
        while entry and (self.entries_dir / entry).is_dir():
            yield entry
            try:
                with EntryReader(self, entry) as r:
                    entry = r.base
            except DynaQuantError:
                return

    def leftovers(self) -> list[Path]:
        """Temporary files and folders of writes whose writer died (a save killed mid-write).
        A live writer's are never listed (see :mod:`.atomic` for how ownership is told)."""
        return dead_leftovers(self.entries_dir) + dead_leftovers(self.refs_dir) + dead_leftovers(self.path)

    def gc(self) -> list[str]:
        """Delete entries no reference reaches, and the leftovers of dead writers (never a live
        writer's temporary files). Returns the ids removed."""
        alive = self.reachable()
        removed = [e for e in self.entries() if e not in alive]
        for eid in removed:
            shutil.rmtree(self.entries_dir / eid)
        for folder in (self.entries_dir, self.refs_dir, self.path):
            remove_dead_leftovers(folder)
        fsync_dir(self.entries_dir)
        return removed

    def compact(self, ref_or_id: str) -> str:
        """Rewrite an entry as a self-contained keyframe with the same content.

        Code deltas become code keyframes. A tensor coded as a residual against its base's decoded
        values (``residual: previous``) has no exact self-contained code, so its decoded values are
        stored losslessly (bit-exact, larger). Residuals against pre-trained weights keep them (the
        metadata naming them is kept).

        References that pointed at the old entry are moved to the new one; the old chain becomes
        garbage for :meth:`gc` unless something else still uses it. Returns the new id.
        """
        old = self.open(ref_or_id)
        with old:
            if old.base is None:
                return old.id
            keys = [f"{s}/{n}/{b}" for s, n, rec in old.tensor_records() for b in rec.get("blobs", {})]
            writer = _EntryWriter(self, keys + [f"extras/{n}" for n in old.extras])
            try:
                for section, name, rec in old.tensor_records():
                    if "alias_of" in rec:
                        writer.add_alias(section, name, rec["alias_of"], {"dtype": rec["dtype"], "shape": rec["shape"]})
                    elif not rec["uses_base"]:
                        writer.copy_record(
                            section, name, rec, {b: _Blobs(old, section, name, rec)(b) for b in rec["blobs"]}
                        )
                    else:
                        codec = get_codec(rec["codec"])
                        state = old.state(section, name)
                        raw = codec.to_raw(state)
                        if codec.reference_kind(rec["params"]) == "previous":
                            # its reference (the base's decoded values) goes with the chain: exact only losslessly
                            codec = get_codec("lossless")
                            writer.add_encoded(section, name, raw, codec, codec.encode(raw))
                        else:
                            writer.add_encoded(section, name, raw, codec, codec.keyframe(state))
                for name in old.extras:
                    writer.add_extra(name, old.extra(name))
                new_id = writer.finish(None, old.manifest["trees"], old.metadata)
            except BaseException:
                writer.abort()
                raise
        for name, target in self.refs().items():
            if target == old.id:
                self.set_ref(name, new_id)
        return new_id

    def verify(
        self, ref_or_id: str | None = None, *, deep: bool = False, leftovers: bool = True, pretrained: bool = True
    ) -> list[str]:
        """Check the store marker, references, manifests, blob checksums, chain links and (with
        ``pretrained``) the pre-trained weights residual entries were coded against (present and
        unchanged: their SHA-256, computed once per process however many entries name them), and
        (with ``leftovers``) look for leftovers of killed writes; with ``deep``, also decode every
        tensor. Returns a list of problems (empty when all is well); damage is reported, never
        raised. ``pretrained=False`` checks the store's own files only (what a copy to another
        machine carries)."""
        problems: list[str] = []
        try:
            check_store_marker(self.path / "store.json")
        except DynaQuantError as exc:
            problems.append(f"store marker: {exc}")
        refs, ref_problems = self._read_refs()
        problems += ref_problems
        try:
            targets = list(self._chain_lenient(self.resolve(ref_or_id))) if ref_or_id else self.entries()
        except DynaQuantError as exc:
            return problems + [str(exc)]
        for eid in targets:
            try:
                with EntryReader(self, eid) as r:
                    if r.base is not None and manifest_file(self.entries_dir / r.base) is None:
                        raise MissingBaseError(r.id, r.base, str(self.path))
                    if pretrained and r.metadata.get("pretrained") is not None:
                        try:
                            r.pretrained()
                        except MissingPretrainedError as exc:  # its files are gone or changed
                            problems.append(str(exc))  # (the message names the entry and the store)
                        except DynaQuantError as exc:  # an unreadable descriptor: the entry's own damage
                            problems.append(f"entry {eid[:16]}: {exc}")
                    for section, name, rec in r.tensor_records():
                        if deep:
                            r.raw(section, name)
                        else:
                            for b in rec.get("blobs", {}):
                                _Blobs(r, section, name, rec)(b)
                    for name in r.extras:
                        r.extra(name)
            except DynaQuantError as exc:
                problems.append(f"entry {eid[:16]}: {exc}")
        for name, target in refs.items():
            if not (self.entries_dir / target).is_dir():
                problems.append(f"reference {name!r} points at missing entry {target[:16]}")
        for item in self.leftovers() if leftovers else []:
            problems.append(
                f"leftover of an interrupted write: {item} ({size_on_disk(item) / 1e3:.0f} KB, its writer is "
                "gone); gc or the next write removes it"
            )
        return problems


@dataclass(frozen=True)
class _RawSize:
    """What an entry's record says of an encoded tensor: its dtype, shape and raw size."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


# one tensor to write: (section, name, its raw bits or the deferred tensor that makes them, codec, base state)
_Job = tuple[str, str, RawTensor | DeferredTensor, Codec, Any]
# what the pool makes of one tensor to write: (section, name, its dtype and size, codec, encoded, blob digests)
_Encoded = tuple[str, str, _RawSize, Codec, Encoded, dict[str, str]]


def _bytes_view(data: bytes | np.ndarray) -> memoryview:
    """A blob's bytes as a flat byte view (an array made contiguous first)."""
    return memoryview(data if isinstance(data, bytes) else np.ascontiguousarray(data)).cast("B")


def blob_digests(encoded: Encoded) -> dict[str, str]:
    """The hex SHA-256 of each of an encoded tensor's blobs, as the manifest records them."""
    return {b: hashlib.sha256(_bytes_view(data)).hexdigest() for b, data in encoded.blobs.items()}


def _held_weight(result: _Encoded) -> int:
    """What an encoded tensor waiting to be written holds, against
    :data:`~hf_dynaquant.core.pool.VALUES_IN_FLIGHT` (as float32 values): its blobs. (A state
    it still holds, a quantized tensor's codes, is what the next delta keeps of it anyway.)"""
    return sum(len(blob) for blob in result[4].blobs.values()) // 4


def _weight(dtype: str, shape: Iterable[int]) -> int:
    """A tensor's weight against :data:`~hf_dynaquant.core.pool.VALUES_IN_FLIGHT`
    (:func:`~hf_dynaquant.core.pool.tensor_weight`), for the encoder's raw tensors and the stored
    records alike; an unknown dtype (a damaged record) counts as float32, and decoding the tensor
    names what is wrong with it."""
    try:
        size = itemsize(dtype)
    except UnsupportedTensorError:
        size = 4
    return tensor_weight(math.prod(shape), size)


def _numels(group: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Element counts of a section's tensors; a lazily loading mapping (one that has a
    ``numels()`` method, like a safetensors file) answers without loading them."""
    numels = getattr(group, "numels", None)
    return numels() if callable(numels) else {n: t.numel() for n, t in group.items()}


def _base_state(base: EntryReader | None, section: str, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    """The base entry's state of the same tensor, when it has a compatible one."""
    if base is None:
        return None
    rec = base.manifest["sections"].get(section, {}).get(name)
    if rec is None or rec["dtype"] != dtype or tuple(rec["shape"]) != shape:
        return None
    return base.state(section, name)


def _dtype_and_shape(item: RawTensor | DeferredTensor) -> tuple[str, tuple[int, ...]]:
    """The stored dtype name and shape of a tensor to encode, a deferred one's as declared."""
    if isinstance(item, DeferredTensor):
        return dtype_name(item.dtype), tuple(int(s) for s in item.shape)
    return item.dtype, item.shape


def _made(deferred: DeferredTensor, where: str) -> RawTensor:
    """A deferred tensor made (as the encoding pool takes it), as raw bits; an
    :class:`~hf_dynaquant.errors.UnsupportedTensorError` where it is not the dtype and shape it
    declared (its weight and base state were its declared ones)."""
    tensor = deferred.make()
    if tensor.dtype != deferred.dtype or tuple(tensor.shape) != tuple(deferred.shape):
        raise UnsupportedTensorError(
            f"{where}: a deferred tensor declared {deferred.dtype} of shape {tuple(deferred.shape)}, "
            f"made {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    return to_raw(tensor, where)
