"""Compress and decompress whole Hugging Face model folders (or single safetensors files).

A compressed folder is the source folder's non-weight files (config, tokenizer, README, ...)
plus a store in ``dynaquant/`` whose reference ``model`` holds every ``*.safetensors`` file of
the source, one section per file (named by its relative path), with the files' own metadata.
Decompressing writes those safetensors files back, so ``from_pretrained`` loads the result.
Weights stored as pickle (``pytorch_model*.bin``) are refused: we never unpickle.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from ..codecs.base import Codec
from ..codecs.dynaquant import DynaQuantCodec
from ..core.dtypes import itemsize
from ..core.quantizer import Calibration, QuantConfig, plan_quantization
from ..errors import CorruptCheckpointError, DynaQuantError, UnsafeInputError
from ..pipeline import plan_key, write_planned
from ..renames import renamed_keywords, take_renamed
from ..store import STORE_DIR, CheckpointStore
from ..store.atomic import publish_folder, staging_folder
from ..store.safetensors_io import StreamingWriter, header_size_estimate
from .calibration import PRETRAINED_BASE, calibrate_folder, load_model, search_pretrained

__all__ = ["compress_folder", "decompress_folder", "CompressResult", "STORE_DIR", "MODEL_REF", "find_store"]

logger = logging.getLogger(__name__)

MODEL_REF = "model"
_PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass(frozen=True)
class CompressResult:
    """What :func:`compress_folder` wrote."""

    path: Path
    entry: str
    raw_nbytes: int
    stored_nbytes: int

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.stored_nbytes if self.stored_nbytes else float("inf")


class _SafetensorsTensors(Mapping[str, torch.Tensor]):
    """A safetensors file as a read-only mapping that loads one tensor at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt")
            self._keys = list(self._f.keys())
            self.metadata = self._f.metadata() or {}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"{path}: cannot read safetensors file ({exc})") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._f.get_tensor(key)

    def numels(self) -> dict[str, int]:
        """Element counts from the header, without loading any tensor."""
        return {k: math.prod(self._f.get_slice(k).get_shape()) for k in self._keys}

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _AllSections(Mapping[str, torch.Tensor]):
    """The tensors of every source file as one lazy mapping, for checkpoint-wide thresholds."""

    def __init__(self, sources: Mapping[str, _SafetensorsTensors]) -> None:
        self.sources = sources

    def __getitem__(self, key: str) -> torch.Tensor:
        section, _, name = key.partition("::")
        return self.sources[section][name]

    def __iter__(self) -> Iterator[str]:
        return (plan_key(s, n) for s, tensors in self.sources.items() for n in tensors)

    def __len__(self) -> int:
        return sum(len(t) for t in self.sources.values())


def _weight_files(src: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors weight files, other files) under ``src``, as paths relative to it."""
    files = sorted(
        p.relative_to(src) for p in src.rglob("*") if p.is_file() and STORE_DIR not in p.relative_to(src).parts[:1]
    )
    weights = [p for p in files if p.suffix == ".safetensors"]
    pickled = [p for p in files if any(p.match(g) for g in _PICKLE_WEIGHTS)]
    if pickled and not weights:
        raise UnsafeInputError(
            f"{src}: weights are stored as pickle ({', '.join(map(str, pickled))}); hf_dynaquant never unpickles. "
            "Convert them to safetensors first (for example model.save_pretrained(dir, safe_serialization=True))"
        )
    for p in pickled:
        logger.warning("%s: skipping pickle weight file %s (the safetensors weights are used)", src, p)
    others = [p for p in files if p not in weights and p not in pickled]
    return weights, others


@renamed_keywords(quant="config")
def compress_folder(
    src: str | Path,
    dst: str | Path,
    *,
    codec: Codec | str = "lossless",
    config: QuantConfig | None = None,
    threshold: float | None = None,
    search: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> CompressResult:
    """Compress a model folder (or one ``.safetensors`` file) into the folder ``dst``.

    Non-weight files are copied as they are; every ``*.safetensors`` file becomes a section of
    the store entry ``model`` in ``dst/dynaquant``. ``dst`` appears complete or not at all.
    With ``codec="dynaquant"`` the weights are quantized with ``config`` (default
    :data:`~hf_dynaquant.pretrained.calibration.PRETRAINED_BASE`), or, given a ``threshold``, with the
    most compressive configuration
    whose output cosine distance on calibration text stays within it (see
    :mod:`hf_dynaquant.pretrained.calibration`); without gradients, sensitivity means magnitude.
    A configuration with ``error_feedback`` (the default's) is calibrated on the same text
    (:func:`~hf_dynaquant.pretrained.calibration.calibrate_folder`; ``search={"eval_data": ...}``
    gives other text), and ``progress`` also shows the search's candidates.
    ``search`` passes further options to :func:`~hf_dynaquant.pretrained.calibration.search_pretrained`
    (``metric``, ``eval_data``, ``search_space``; ``data`` and ``space`` before).
    """
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if src.is_file():
        if src.suffix != ".safetensors":
            raise UnsafeInputError(f"{src}: only .safetensors files (or model folders) can be compressed")
        root, weights, others = src.parent, [Path(src.name)], []
    else:
        root, (weights, others) = src, _weight_files(src)
        if not weights:
            raise DynaQuantError(f"{src}: no .safetensors weight files found")
    with staging_folder(dst) as tmp:
        for rel in others:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, tmp / rel)
        sources = {str(rel): _SafetensorsTensors(root / rel) for rel in weights}
        store = CheckpointStore(tmp / STORE_DIR)
        metadata: dict[str, Any] = {
            "kind": "model_folder",
            "files": {name: {"metadata": f.metadata} for name, f in sources.items()},
        }
        plan, chosen = None, None
        if codec == "dynaquant" or isinstance(codec, DynaQuantCodec):
            options = dict(search or {})
            renames = {"data": "eval_data", "space": "search_space"}
            take_renamed(options, renames, "compress_folder(search=...)", spell=repr, stacklevel=4)
            calibration = model = None
            feedback = (config or PRETRAINED_BASE).error_feedback
            if feedback and threshold is not None:  # both evaluate the model: it is loaded once
                with contextlib.suppress(DynaQuantError):  # a folder without one: each says so below
                    model = load_model(root)
            if feedback:
                calibration = calibrate_folder(root, options.get("eval_data"), model=model)
            if threshold is not None:
                result = search_pretrained(
                    root, threshold, config=config, calibration=calibration, progress=progress, model=model, **options
                )
                metadata["search"] = result.to_dict()
                if result.config is None:
                    raise DynaQuantError(
                        f"{src}: no configuration of the search space keeps the quality loss within {threshold} "
                        "(by default the output cosine distance on calibration text); "
                        "use codec='lossless' or a larger threshold="
                    )
                config = result.config
            chosen = config or PRETRAINED_BASE
            tensors = _AllSections(sources)
            plan = plan_quantization(tensors, chosen, calibration=_by_plan_key(calibration, tensors))
        entry = write_planned(
            store,
            sources,
            plan,
            config=chosen,
            fallback="lossless" if plan is not None else codec,
            metadata=metadata,
            ref=MODEL_REF,
            progress=progress,
        )
        info = store.info(entry)
        publish_folder(tmp, dst, overwrite)
    return CompressResult(dst, entry, info.raw_nbytes, info.nbytes)


def _by_plan_key(calibration: Calibration | None, tensors: _AllSections) -> Calibration | None:
    """``calibration`` (keyed by the loaded model's parameter names) keyed by the files' tensors:
    a file name may carry the model class's prefix (``bert.encoder...``) that ``AutoModel``'s
    names lack, or the other way round; a match must also agree in shape."""
    if calibration is None:
        return None

    def by_key(stats: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key in tensors:
            name = key.partition("::")[2]
            for param, value in stats.items():
                if name == param or name.endswith("." + param) or param.endswith("." + name):
                    out[key] = value
                    break
        return out

    return Calibration(by_key(calibration.grams), by_key(calibration.rows))


def find_store(path: str | Path, *, strict: bool = True) -> CheckpointStore:
    """The store of a compressed folder, or ``path`` itself when it is a store (``strict=False``:
    even with a damaged ``store.json``, for :meth:`~CheckpointStore.verify` to report)."""
    path = Path(path)
    for candidate in (path / STORE_DIR, path):
        if CheckpointStore.is_store(candidate):
            return CheckpointStore(candidate, create=False, strict=strict)
    raise DynaQuantError(f"{path} is neither a compressed folder (no {STORE_DIR}/store.json) nor a store")


def decompress_folder(
    src: str | Path,
    dst: str | Path,
    *,
    ref: str = MODEL_REF,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write a compressed folder back as a plain Hugging Face folder that ``from_pretrained`` loads."""
    src, dst = Path(src), Path(dst)
    store = find_store(src)
    with staging_folder(dst) as tmp:
        if store.path != src:
            for p in sorted(src.rglob("*")):
                rel = p.relative_to(src)
                if p.is_file() and rel.parts[0] != STORE_DIR:
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(p, tmp / rel)
        with store.open(ref) as entry:
            files: dict[str, Any] = entry.metadata.get("files") or {s: {} for s in entry.sections}
            total = sum(len(entry.names(s)) for s in files)
            with tqdm(total=total, desc="decompressing", unit="tensor", disable=not progress) as bar:
                for section, info in files.items():
                    _write_safetensors(entry, section, tmp / section, info.get("metadata") or None, bar)
        publish_folder(tmp, dst, overwrite)
    return dst


def _write_safetensors(entry: Any, section: str, path: Path, metadata: dict[str, str] | None, bar: Any) -> None:
    """Stream one section into a safetensors file, one decoded tensor at a time.

    Tensors are ordered by decreasing item size so that, with the 8-byte-aligned header, every
    tensor starts at an address aligned to its element size.
    """
    records = {n: entry.record(section, n) for n in entry.names(section)}
    order = sorted(records, key=lambda n: (-itemsize(records[n]["dtype"]), n))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = StreamingWriter(
        path, header_size_estimate(order, per_key_shape_digits=120) + (len(str(metadata)) * 2 if metadata else 0)
    )
    try:
        for name in order:
            raw = entry.raw(section, name)
            writer.add(name, raw.dtype, raw.shape, raw.bits)
            bar.update()
        writer.close(metadata)
    except BaseException:
        writer.abort()
        raise
