"""The DynaQuant quantizer (section 4.2, 4.3): partition into protected / pruned / quantized,
then map the quantized values to approximate-K-means centres.

Decisions where the paper is silent (also in FORMAT.md):

* **What is quantized**: floating tensors with at least 2 dimensions and ``min_numel`` elements
  (Linear, Conv, Embedding and similar weights). Biases, norm weights, other 1-D or tiny float
  tensors, and every integer or boolean buffer stay bit-exact (``lossless`` codec): they are a
  sliver of the bytes and quality is sensitive to them.
* **Protection** is global: the top ``protect/2`` of all quantized values by magnitude plus the
  top ``protect/2`` by sensitivity (without gradients: the top ``protect`` by magnitude). They
  are kept as bfloat16.
* **Pruning** is per layer *type* (one threshold per type, the same fraction for all types), by
  the chosen metric; protection wins over pruning; embeddings are never pruned.
* **Codebooks** are per tensor: ``bins`` centres (``embedding_bins`` for embeddings) from
  approximate K-means over the tensor's remaining values.
* **Codes**: ``0`` = pruned (decodes to 0), ``1`` = protected (value stored apart), ``2 + i`` =
  centre ``i``; at most 256 levels, so a code is one byte.

All thresholds come from :class:`~hf_dynaquant.core.sketch.LogSketch` quantiles; sketches merge,
so sharded models get the thresholds of the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .kmeans import approximate_kmeans, assign
from .sketch import LogSketch

__all__ = [
    "QuantConfig",
    "TensorPlan",
    "QuantPlan",
    "PRUNED",
    "PROTECTED",
    "FIRST_CENTRE",
    "layer_types",
    "infer_layer_type",
    "is_quantizable",
    "plan_quantization",
    "quantize",
    "dequantize",
]

PRUNED, PROTECTED, FIRST_CENTRE = 0, 1, 2
EMBEDDING = "Embedding"
METRICS = ("magnitude", "sensitivity")


@dataclass(frozen=True)
class QuantConfig:
    """One point of DynaQuant's configuration cube (Table 7), plus fixed knobs.

    Args:
        bins: K-means centres for non-embedding tensors (any value from 2 to 254).
        prune: fraction of each layer type's values set to zero (embeddings excepted).
        protect: fraction of values kept as bfloat16, half by magnitude, half by sensitivity.
        metric: pruning metric, ``"magnitude"`` or ``"sensitivity"``.
        embedding_bins: centres for embedding tensors (the paper searches 16 or 32).
        sigma: frequency vs magnitude weight of sketch buckets in K-means (0.2 in the paper).
        alpha: relative accuracy of the threshold sketches.
        min_numel: tensors with fewer elements stay lossless.
        seed: K-means++ seed (results are deterministic for a seed).
    """

    bins: int = 16
    prune: float = 0.2
    protect: float = 0.005
    metric: str = "magnitude"
    embedding_bins: int = 32
    sigma: float = 0.2
    alpha: float = 0.01
    min_numel: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("bins", "embedding_bins"):
            value = getattr(self, name)
            if not 2 <= value <= 254:
                raise ValueError(f"{name} must be between 2 and 254 (codes are one byte), got {value}")
        if not 0 <= self.prune < 1:
            raise ValueError(f"prune must be a fraction in [0, 1), got {self.prune}")
        if not 0 <= self.protect < 1:
            raise ValueError(f"protect must be a fraction in [0, 1), got {self.protect}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def layer_types(model: torch.nn.Module) -> dict[str, str]:
    """``{parameter or buffer name: class name of the module that owns it}``."""
    out = {}
    for mod_name, module in model.named_modules():
        kind = EMBEDDING if isinstance(module, torch.nn.Embedding) else type(module).__name__
        for pname, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            out[f"{mod_name}.{pname}" if mod_name else pname] = kind
    return out


def infer_layer_type(name: str, shape: tuple[int, ...]) -> str:
    """A layer type from a tensor's name and shape, for state dicts without their model."""
    lowered = name.lower()
    if "embed" in lowered or lowered.endswith(("wte.weight", "wpe.weight", "shared.weight")):
        return EMBEDDING
    return {3: "Conv1d", 4: "Conv2d", 5: "Conv3d"}.get(len(shape), "Linear")


def is_quantizable(tensor: torch.Tensor, config: QuantConfig) -> bool:
    return tensor.is_floating_point() and tensor.dim() >= 2 and tensor.numel() >= config.min_numel


@dataclass
class TensorPlan:
    """How one tensor is quantized: its thresholds and codebook."""

    layer_type: str
    centres: np.ndarray
    protect_magnitude: float  # |w| above this is protected
    protect_sensitivity: float | None  # sensitivity above this is protected (None: unused)
    prune_threshold: float | None  # metric below this is pruned (None: no pruning)
    metric: str
    sensitivity: torch.Tensor | None = field(default=None, repr=False)

    def masks(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(protected, pruned) boolean masks for the flat weights ``w``."""
        mag = w.abs()
        protected = mag > self.protect_magnitude
        sens = self.sensitivity.reshape(-1) if self.sensitivity is not None else None
        if self.protect_sensitivity is not None and sens is not None:
            protected |= sens > self.protect_sensitivity
        if self.prune_threshold is None:
            return protected, torch.zeros_like(protected)
        metric = sens if self.metric == "sensitivity" and sens is not None else mag
        return protected, (metric < self.prune_threshold) & ~protected


@dataclass
class QuantPlan:
    """The per-tensor plans of one checkpoint, and the configuration they came from."""

    config: QuantConfig
    tensors: dict[str, TensorPlan]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).float()


def plan_quantization(
    tensors: Mapping[str, torch.Tensor],
    config: QuantConfig,
    *,
    types: Mapping[str, str] | None = None,
    sensitivity: Mapping[str, torch.Tensor] | None = None,
) -> QuantPlan:
    """Thresholds and codebooks for every quantizable tensor of a checkpoint.

    ``types`` maps names to layer types (see :func:`layer_types`; inferred when missing);
    ``sensitivity`` maps names to ``|EMA(g) * w|`` tensors (absent: magnitude only).
    """
    names = [n for n, t in tensors.items() if is_quantizable(t, config)]
    sens = {n: _flat(sensitivity[n]) for n in names if sensitivity is not None and n in sensitivity}
    kinds = {n: (types or {}).get(n) or infer_layer_type(n, tuple(tensors[n].shape)) for n in names}

    # protection thresholds, global
    mag_sketch = LogSketch(config.alpha)
    for n in names:
        mag_sketch.add(_flat(tensors[n]).abs())
    use_sens = bool(sens) and len(sens) == len(names)
    share = config.protect / 2 if use_sens else config.protect
    tau_mag = mag_sketch.quantile(1 - share) if names and config.protect > 0 else float("inf")
    tau_sens = None
    if use_sens and config.protect > 0:
        sens_sketch = LogSketch(config.alpha)
        for n in names:
            sens_sketch.add(sens[n])
        tau_sens = sens_sketch.quantile(1 - share)

    # pruning thresholds, one per layer type
    metric = config.metric if use_sens else "magnitude"
    prune_tau: dict[str, float | None] = {}
    for kind in sorted(set(kinds.values())):
        if kind == EMBEDDING or config.prune <= 0:
            prune_tau[kind] = None
            continue
        sketch = LogSketch(config.alpha)
        for n in names:
            if kinds[n] == kind:
                sketch.add(sens[n] if metric == "sensitivity" else _flat(tensors[n]).abs())
        prune_tau[kind] = sketch.quantile(config.prune)

    plans = {}
    for n in names:
        plan = TensorPlan(kinds[n], np.zeros(0), tau_mag, tau_sens, prune_tau[kinds[n]], metric, sens.get(n))
        w = _flat(tensors[n])
        protected, pruned = plan.masks(w)
        rest = w[~(protected | pruned)]
        k = config.embedding_bins if kinds[n] == EMBEDDING else config.bins
        plan.centres = (
            approximate_kmeans(rest.numpy(), k, sigma=config.sigma, seed=config.seed) if rest.numel() else np.zeros(1)
        ).astype(np.float32)
        plans[n] = plan
    return QuantPlan(config, plans)


def quantize(w: torch.Tensor, plan: TensorPlan) -> tuple[np.ndarray, np.ndarray]:
    """``(codes uint8, protected values as bf16 bits uint16)`` of a tensor under its plan."""
    flat = _flat(w)
    protected, pruned = plan.masks(flat)
    codes = assign(flat.numpy(), plan.centres.astype(np.float32)).astype(np.uint8) + FIRST_CENTRE
    codes[pruned.numpy()] = PRUNED
    prot = protected.numpy()
    codes[prot] = PROTECTED
    kept = flat[protected].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return codes, kept


def dequantize(codes: np.ndarray, centres: np.ndarray, protected_bf16: np.ndarray) -> np.ndarray:
    """Float32 values of codes (pruned: 0, protected: their bf16 values, in order)."""
    table = np.concatenate(([0.0, 0.0], centres)).astype(np.float32)
    out = table[codes]
    prot = codes == PROTECTED
    if int(prot.sum()) != protected_bf16.size:
        raise ValueError(f"{protected_bf16.size} protected values stored, {int(prot.sum())} codes need one")
    out[prot] = (protected_bf16.astype(np.uint32) << 16).view(np.float32)
    return out
