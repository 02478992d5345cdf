"""``AutoModel.from_pretrained(repo)`` for DynaQuant snapshots, through transformers' quantizer hooks.

A Hub snapshot's ``config.json`` carries ``"quantization_config": {"quant_method": "dynaquant", ...}``
and ``"transformers_weights"`` naming the store entry's payload (a safetensors file of checksummed
uint8 blobs, keyed ``<file>/<tensor>/<blob>``; FORMAT.md section 3). After ``import hf_dynaquant``,
transformers routes such a config to :class:`DynaQuantHfQuantizer`, which

1. reads the entry's manifest (next to the payload, or fetched from the same repo and commit),
2. adds one weight converter that gathers each tensor's blobs under the tensor's own name, and
3. decodes them with the entry's codecs while the weights load (dequantize-on-load),

so the result is an ordinary float model: trainable, saved as plain safetensors. Blob checksums
are checked as on every other read; a failure stops the load with a :class:`DynaQuantError`
naming the file and tensor; every blob is checked before loading starts, because an error
inside transformers' loader only surfaces as a generic RuntimeError.

This rides on transformers' v5 loading internals (``get_load_operations``-era weight converters,
``ConversionOps``), which change between minor versions; it is tested with the versions in
:data:`TESTED_TRANSFORMERS` and refuses others with a pointer to the public-API path,
:func:`hf_dynaquant.from_pretrained`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..codecs import get_codec
from ..core.dtypes import from_raw
from ..errors import CorruptCheckpointError, DynaQuantError, FormatError
from ..pretrained.snapshot import QUANT_METHOD
from ..store.manifest import MANIFEST, manifest_file, parse_manifest, read_manifest_bytes
from ..store.safetensors_io import PayloadFile, read_checked_blob

__all__ = ["QUANT_METHOD", "TESTED_TRANSFORMERS", "DynaQuantConfig", "DynaQuantHfQuantizer", "transformers_sections"]

TESTED_TRANSFORMERS = SpecifierSet(">=5.23,<5.25")


def transformers_sections(sections: list[str]) -> list[str]:
    """The store sections transformers loads as weights: the top-level ``*.safetensors`` files
    (``model.safetensors``, ``model-00001-of-00002.safetensors``), not e.g. ``1_Dense/...``."""
    return [s for s in sections if "/" not in s and s.endswith(".safetensors")]


class DynaQuantConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a DynaQuant snapshot's ``config.json``.

    Args:
        entry: id of the store entry holding the weights.
        store: the store's folder inside the snapshot.
        sections: the entry's sections that hold transformers weights.
        format_version: the container format version (FORMAT.md).
        config: the DynaQuant configuration used (informative).
        dequantize: always true: weights are decoded to floats on load.
    """

    def __init__(
        self,
        entry: str | None = None,
        store: str = "dynaquant",
        sections: list[str] | None = None,
        format_version: int = 1,
        config: dict[str, Any] | None = None,
        dequantize: bool = True,
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        self.entry, self.store, self.sections = entry, store, list(sections or ["model.safetensors"])
        self.format_version, self.config, self.dequantize = format_version, dict(config or {}), dequantize


class _Entry:
    """The manifest of the snapshot's entry and the blob-name patterns transformers matches."""

    def __init__(self, payload: Path, manifest: dict[str, Any], sections: list[str]) -> None:
        self.payload, self.manifest = payload, manifest
        self.records = {s: manifest["sections"][s] for s in sections if s in manifest["sections"]}
        if not self.records:
            raise FormatError(f"{payload}: the entry has none of the weight sections {sections}")
        self.patterns: dict[str, tuple[str, str]] = {}
        for section, records in self.records.items():
            for blob in sorted({b for rec in records.values() for b in rec.get("blobs", {})}):
                self.patterns[f"^{re.escape(section)}/(.+)/{re.escape(blob)}$"] = (section, blob)

    def record(self, section: str, name: str, prefix: str) -> tuple[str, dict[str, Any]]:
        """The record of a model parameter, allowing for the base-model prefix transformers adds or strips."""
        records = self.records[section]
        for candidate in (name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}"):
            if candidate in records:
                return candidate, records[candidate]
        raise CorruptCheckpointError(f"{self.payload}: section {section!r} has no tensor for parameter {name!r}")

    def verify(self) -> None:
        """Check every blob of the weight sections against its SHA-256 before transformers loads
        them: a conversion error inside transformers' loader only surfaces as a generic
        RuntimeError, so integrity is settled here, naming the file and tensor at fault."""
        handle = PayloadFile(self.payload)  # a damaged header fails here, naming the file
        try:
            for section, records in self.records.items():
                for name, rec in records.items():
                    for blob, info in rec.get("blobs", {}).items():
                        read_checked_blob(handle, info, f"{section}/{name}", blob)
        finally:
            handle.close()

    def decode(self, name: str, blobs: dict[str, list[torch.Tensor]], prefix: str) -> torch.Tensor:
        """Decode one tensor from the blobs transformers gathered for it (verified beforehand)."""
        found = {self.patterns[p]: t[0] for p, t in blobs.items() if t}
        sections = {section for section, _ in found}
        if len(sections) != 1:
            raise CorruptCheckpointError(f"{self.payload}: blobs of {name!r} come from sections {sorted(sections)}")
        section = sections.pop()
        tensor, rec = self.record(section, name, prefix)
        where = f"{section}/{tensor}"
        if rec.get("uses_base"):
            raise FormatError(f"{self.payload}: tensor {where!r} is a delta; Hub snapshots must be keyframes")
        data = {blob: t.contiguous().numpy() for (_, blob), t in found.items()}

        def source(blob: str) -> np.ndarray:
            if blob not in data:
                raise CorruptCheckpointError(f"{self.payload}: blob {blob!r} of tensor {where!r} is missing")
            return data[blob]

        source.where = f"{self.payload} (tensor {where!r})"  # type: ignore[attr-defined]
        codec = get_codec(rec["codec"])
        state = codec.decode(rec["dtype"], tuple(rec["shape"]), rec["params"], source)
        return from_raw(codec.to_raw(state))


def _read_manifest(payload: Path, config: DynaQuantConfig, model_config: Any) -> dict[str, Any]:
    """The entry's manifest: beside the payload (local folders, full snapshots), else fetched
    from the repo at the commit transformers resolved, into the same Hugging Face cache."""
    path = manifest_file(payload.parent) or payload.parent / MANIFEST
    if not path.exists():
        from huggingface_hub import hf_hub_download

        relative = f"{config.store}/entries/{config.entry}/{MANIFEST}"
        snapshot = payload.parents[len(Path(relative).parts) - 1]
        if snapshot.parent.name != "snapshots":
            raise CorruptCheckpointError(f"{path} is missing: the snapshot has no manifest for its weights")
        try:
            path = Path(
                hf_hub_download(
                    model_config.name_or_path,
                    relative,
                    revision=snapshot.name,
                    cache_dir=snapshot.parents[2],
                )
            )
        except Exception as exc:  # the client raises several error types for one cause
            raise CorruptCheckpointError(
                f"{model_config.name_or_path}@{snapshot.name}: cannot fetch {relative} ({exc})"
            ) from None
    return parse_manifest(read_manifest_bytes(path), path, config.entry)


class DynaQuantDequantize(ConversionOps):
    """Turns one tensor's blobs into the float tensor (see :class:`DynaQuantHfQuantizer`)."""

    def __init__(self, hf_quantizer: DynaQuantHfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo: dict) -> DynaQuantDequantize:
        # transformers deep-copies the converter for every tensor; the op is stateless and must
        # keep reporting to the one quantizer (copying it would also copy the whole manifest)
        return self

    def convert(self, input_dict: dict[str, Any], *, full_layer_name: str, model: Any = None, **kwargs: Any) -> dict:
        tensor = self.hf_quantizer.entry.decode(full_layer_name, input_dict, model.base_model_prefix)
        return {full_layer_name: tensor}


class DynaQuantHfQuantizer(HfQuantizer):
    """Dequantize-on-load of DynaQuant snapshots (see the module docstring)."""

    requires_calibration = True  # only pre-quantized snapshots: compress with hf_dynaquant.compress_pretrained

    def __init__(self, quantization_config: DynaQuantConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.entry: _Entry | None = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        version = transformers.__version__
        if version not in TESTED_TRANSFORMERS:
            raise DynaQuantError(
                f"loading DynaQuant snapshots through AutoModel.from_pretrained is tested with transformers "
                f"{TESTED_TRANSFORMERS}, not {version}; use hf_dynaquant.from_pretrained(AutoModel..., repo), "
                "which needs only public APIs"
            )
        if self.quantization_config.format_version != 1:
            raise DynaQuantError(
                f"snapshot format version {self.quantization_config.format_version} is not supported (reads 1)"
            )
        self.quantization_config.dequantize = True  # the only mode: weights become floats

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # the payload holds uint8 blobs: never let "auto" pick their dtype for the model
        return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32

    def _process_model_before_weight_loading(self, model: Any, checkpoint_files: list[str] | None = None, **kw: Any):
        if not checkpoint_files:
            raise DynaQuantError("no weights file resolved for a DynaQuant snapshot (config.json transformers_weights)")
        payload = Path(checkpoint_files[0])
        manifest = _read_manifest(payload, self.quantization_config, model.config)
        self.entry = _Entry(payload, manifest, self.quantization_config.sections)
        self.entry.verify()
        return model

    def get_weight_conversions(self) -> list[WeightConverter]:
        if self.entry is None:
            return []
        return [WeightConverter(list(self.entry.patterns), [r"\1"], [DynaQuantDequantize(self)])]

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        # the model is plain now: save_pretrained must neither name the compressed payload nor try
        # to reverse our converter (it has no inverse: the snapshot is lossy)
        if hasattr(model.config, "transformers_weights"):
            del model.config.transformers_weights
        model._weight_conversions = [
            c
            for c in getattr(model, "_weight_conversions", [])
            if not isinstance(c, WeightConverter) or not any(isinstance(op, DynaQuantDequantize) for op in c.operations)
        ]
        return model

    def is_serializable(self) -> bool:
        return True  # dequantized on load: the model saves as plain safetensors

    @property
    def is_trainable(self) -> bool:
        return True


def register() -> None:
    """Make transformers route ``quant_method: dynaquant`` to this module (idempotent): adds
    :class:`DynaQuantConfig` and :class:`DynaQuantHfQuantizer` to transformers' quantization
    mappings, through its public ``register_quantization_config`` / ``register_quantizer``.

    ``hf_dynaquant/__init__.py`` calls it when the package is imported, and nothing else does: a
    user's own ``AutoModel.from_pretrained(<snapshot>)`` never passes through hf_dynaquant, so
    registering on first use of our functions would leave that call (which the README and the
    tests promise after ``import hf_dynaquant``) failing."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(DynaQuantConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(DynaQuantHfQuantizer)
