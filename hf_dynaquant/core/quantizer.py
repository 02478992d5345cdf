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
  the chosen criterion (``QuantConfig.prune_by``); protection wins over pruning; embeddings are
  never pruned. Values whose criterion is exactly 0 (zero weights; zero sensitivity, e.g. behind
  dead ReLUs) are pruned whenever pruning is on, even past the requested fraction: ranking ties
  at 0 would otherwise leave a 0 threshold that prunes nothing.
* **Codebooks** are per tensor: ``bins`` centres (``embedding_bins`` for embeddings) from
  approximate K-means over the tensor's remaining values.
* **Codes**: ``0`` = pruned (decodes to 0), ``1`` = protected (value stored apart), ``2 + i`` =
  centre ``i``; at most 256 levels, so a code is one byte.
* **Rounding** is to the nearest centre, or stochastic (``QuantConfig.rounding``): unbiased,
  for checkpoints that training resumes from, see :mod:`hf_dynaquant.core.rounding`.
* **Residual coding** (``QuantConfig.residual``): instead of the weights, code ``w - ref``
  against reference values the decoder already has: the previous checkpoint's *decoded* weights
  (``"previous"``: closed loop, so quantization errors never accumulate along a chain) or the
  pre-trained weights a fine-tune started from (``"pretrained"``). A tensor with a reference of its
  shape is planned on its residual (sketches, thresholds, K-means); ``TensorPlan.reference`` reads
  the reference; the decoded value is ``ref + dequantized code`` in float32
  (:func:`decoded_values`), so a pruned residual keeps the reference value. Sensitivity of a
  residual is ``|EMA(g) * r|`` (zeroing it moves the weight by ``r``, the loss by about ``g * r``),
  its magnitude ``|r|``. Tensors without a reference are coded directly.
* **Error feedback** (``QuantConfig.error_feedback``): where calibration text gave the Gram
  matrix of a linear layer's inputs (:class:`Calibration`, snapshots of pre-trained models), its
  weights are rounded column by column with GPTQ's error feedback (:mod:`.feedback`) instead of
  each to its nearest centre; same codebook, same format. Nearest rounding only.
* **Rare rows** (``QuantConfig.rare_bins``): where calibration text counted how often each row
  of the input embedding is used (:class:`Calibration`), the rows it never used get a codebook of
  their own with ``rare_bins`` centres, the others ``embedding_bins``. Both codebooks are one
  table (the rare rows' centres follow the others', so codes of the two never collide and
  decoding is unchanged); the codes of each kind of row are entropy-coded apart, under the row
  map the entry stores (FORMAT.md). Nearest rounding only.
* **NaN and infinite values** cannot be ranked or clustered. A tensor holding any is stored
  losslessly, bit-exact, so the NaN survives the round trip for whoever debugs the divergence,
  with a :class:`~hf_dynaquant.errors.NonFiniteTensorWarning` naming it; with
  ``QuantConfig(non_finite="raise")`` a :class:`~hf_dynaquant.errors.NonFiniteTensorError`
  instead. A non-finite *sensitivity* (a NaN or infinite gradient in the EMA window, e.g. a step
  the fp16 grad scaler skipped) only makes the checkpoint rank by magnitude, with a warning.

All thresholds come from :class:`~hf_dynaquant.core.sketch.LogSketch` quantiles, and codebooks
from K-means over sketches; a tensor of 2^20 values or more is sketched from an even sample of
an eighth of its values (:func:`~hf_dynaquant.core.sketch.sample`). Sketches merge, and shards
sample what the whole tensor would, so sharded models get the thresholds of the whole model.

**Where the values live.** The encoder partitions on the host, in the compiled kernels. The
configuration search plans, sizes and evaluates many candidates on every value; when the model
is on an accelerator it does so there (copying each candidate's tensors to the host was most of
a search at 353M parameters), with :meth:`TensorPlan.device_codes` and :func:`device_decoded`:
the same rules in torch ops, equal to the kernels bit for bit. The kernels compare ``(double)
x`` with double thresholds; a float32 ``x`` lies above a double ``t`` exactly when it lies above
the largest float32 not above ``t``, and below ``t`` exactly when below the smallest float32 not
below it, so the torch comparisons run in float32 against those neighbours. Plans with error
feedback or rare rows (pre-trained snapshots) are partitioned on the host only.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import NonFiniteTensorError, NonFiniteTensorWarning
from ..renames import renamed_attribute, renamed_keywords
from . import trellis
from .dtypes import ValuesInParts, all_finite, bf16_bits_to_f32, check_storable, from_raw, storage_key
from .feedback import columnwise, feedback_round, inverse_factor
from .kernels import native
from .kmeans import KMEANS_ALPHA, approximate_kmeans
from .memory import cached_on_device, on_accelerator
from .pool import VALUES_IN_FLIGHT, ForkSafePool, ordered_map
from .rounding import device_stochastic_codes, device_uniform, seeded_stochastic_codes, tensor_seed
from .sketch import LogSketch, sample

__all__ = [
    "QuantConfig",
    "TensorPlan",
    "QuantPlan",
    "remaining_sketch",
    "codebook_of",
    "midpoints",
    "PRUNED",
    "PROTECTED",
    "FIRST_CENTRE",
    "layer_types",
    "infer_layer_type",
    "is_quantizable",
    "plan_quantization",
    "quantize",
    "dequantize",
    "decoded_values",
    "coded_values",
    "Coded",
    "code_table",
    "device_decoded",
    "RESIDUALS",
    "NON_FINITE",
    "refuse_or_warn_non_finite",
    "PRUNE_BY",
    "read_config_record",
    "Calibration",
]

PRUNED, PROTECTED, FIRST_CENTRE = 0, 1, 2
# values made and partitioned at a time by quantize (ValuesInParts): 512 KB of float32, within a
# core's L2 cache beside their codes (a part of 2^16 to 2^20 values took 0.57-0.59 ns a value
# made and partitioned on one thread, 2^14 0.67)
PART_VALUES = 1 << 17
EMBEDDING = "Embedding"
PRUNE_BY = ("magnitude", "sensitivity")  # the pruning criteria
ROUNDINGS = ("nearest", "stochastic")
NON_FINITE = ("lossless", "raise")
RESIDUALS = ("none", "previous", "pretrained")
# Codebooks are made tensor by tensor on a pool (the partition and sketch kernels release the
# GIL), a few at a time so that only those tensors' temporaries are held.
_PLAN_POOL = ForkSafePool("dq-plan")
# Keys of stored configuration records (a manifest's ``quant_config``, the configurations and
# candidates of a search record) renamed since entries were first written, old -> new; both are read.
RENAMED_RECORD_KEYS = {"metric": "prune_by"}


@renamed_keywords(metric="prune_by")
@dataclass(frozen=True)
class QuantConfig:
    """One point of DynaQuant's configuration cube (Table 7), plus fixed knobs.

    Args:
        bins: K-means centres for non-embedding tensors (any value from 2 to 254).
        prune: fraction of each layer type's values set to zero (embeddings excepted).
        protect: fraction of values kept as bfloat16, half by magnitude, half by sensitivity.
        prune_by: the pruning criterion, ``"magnitude"`` or ``"sensitivity"`` (``metric=`` before;
            the name ``metric`` is kept for quality metrics).
        embedding_bins: centres for embedding tensors (the paper searches 16 or 32).
        sigma: frequency vs magnitude weight of sketch buckets in K-means (0.2 in the paper).
        alpha: relative accuracy of the threshold sketches.
        min_numel: tensors with fewer elements stay lossless.
        seed: K-means++ seed (results are deterministic for a seed).
        rounding: ``"nearest"`` centre, or ``"stochastic"`` (unbiased; for a checkpoint that
            training goes on from after a restore, see :mod:`hf_dynaquant.core.rounding`).
        rounding_seed: seed of the stochastic rounding's random numbers.
        non_finite: a tensor holding NaN or infinite values is stored ``"lossless"`` (bit-exact,
            with a :class:`~hf_dynaquant.errors.NonFiniteTensorWarning` naming it), or makes the
            checkpoint ``"raise"`` a :class:`~hf_dynaquant.errors.NonFiniteTensorError`. The
            same holds for optimizer moments under ``optimizer_state="compress"``.
        residual: what the codes are taken of: ``"none"`` (the weights), ``"previous"`` (the
            residual against the previous checkpoint's decoded weights) or ``"pretrained"`` (against
            the pre-trained weights); see the module docstring. Tensors without a reference of
            their shape are coded directly.
        error_feedback: round a linear layer's weights with GPTQ's error feedback where a
            :class:`Calibration` gives its inputs' Gram matrix (see :mod:`.feedback`): the
            layer's output error on calibration text falls, at the same codebook and about the
            same bits. Needs ``rounding="nearest"``; without calibration it changes nothing.
        rare_bins: centres for the rows of the input embedding that calibration text never used
            (see the module docstring; ``None``: every row gets ``embedding_bins``). Their tokens
            are rare in text like the calibration text, so fewer levels there cost little
            fidelity and save most of a vocabulary's bytes. Needs ``rounding="nearest"``.
        trellis: where calibration text informs the rounding (a linear layer that error feedback
            rounds; the input embedding's common and rare rows, with ``rare_bins``), round by
            trellis-coded quantization on a uniform grid instead of to K-means centres
            (:mod:`.trellis`): on MiniLM 4-7% fewer bytes at about the same held-out cosine.
            A linear layer's ``bins`` set its grid's spacing (that many levels of one parity
            span the range the K-means centres would); an embedding's grids are spaced to match
            the error of its codebooks at ``embedding_bins`` and ``rare_bins``. Needs
            ``error_feedback``.
    """

    bins: int = 16
    prune: float = 0.2
    protect: float = 0.005
    prune_by: str = "magnitude"
    embedding_bins: int = 32
    sigma: float = 0.2
    alpha: float = 0.01
    min_numel: int = 4096
    seed: int = 0
    rounding: str = "nearest"
    rounding_seed: int = 0
    non_finite: str = "lossless"
    residual: str = "none"
    error_feedback: bool = False
    rare_bins: int | None = None
    trellis: bool = False

    def __post_init__(self) -> None:
        for name in ("bins", "embedding_bins", "rare_bins"):
            value = getattr(self, name)
            if value is None:
                continue
            if not 2 <= value <= 254:
                raise ValueError(f"{name} must be between 2 and 254 (codes are one byte), got {value}")
        if not 0 <= self.prune < 1:
            raise ValueError(f"prune must be a fraction in [0, 1), got {self.prune}")
        if not 0 <= self.protect < 1:
            raise ValueError(f"protect must be a fraction in [0, 1), got {self.protect}")
        if self.prune_by not in PRUNE_BY:
            raise ValueError(f"prune_by must be one of {PRUNE_BY}, got {self.prune_by!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.non_finite not in NON_FINITE:
            raise ValueError(f"non_finite must be one of {NON_FINITE}, got {self.non_finite!r}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {self.residual!r}")
        if (self.error_feedback or self.rare_bins is not None) and self.rounding != "nearest":
            raise ValueError("error_feedback and rare_bins round to the nearest centre, not stochastically")
        if self.trellis and not self.error_feedback:
            raise ValueError("trellis rounds where error feedback does: it needs error_feedback=True")
        if self.rare_bins is not None and self.embedding_bins + self.rare_bins > 254:
            raise ValueError("embedding_bins + rare_bins must be at most 254 (the two codebooks share one byte)")

    metric = renamed_attribute("metric", "prune_by")

    def to_dict(self) -> dict:
        return asdict(self)


def read_config_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A stored configuration record (``quant_config``, or a search record's configuration or
    candidate) with this version's key names: entries written before the pruning criterion was
    named ``prune_by`` record it as ``metric``."""
    return {RENAMED_RECORD_KEYS.get(k, k): v for k, v in record.items()}


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


@dataclass(frozen=True)
class Calibration:
    """What calibration text tells the quantizer about a model, beyond its weights.

    ``grams``: ``{weight name: X Xᵀ}``, the Gram matrix (``in x in``) of the inputs a linear layer
    saw on calibration text, for :attr:`QuantConfig.error_feedback`. ``rows``: ``{weight name:
    int64 counts}``, how often calibration text used each row of the input embedding, for
    :attr:`QuantConfig.rare_bins`. Made by :func:`hf_dynaquant.pretrained.calibration.calibrate`."""

    grams: Mapping[str, torch.Tensor] = field(default_factory=dict)
    rows: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass
class TensorPlan:
    """How one tensor is quantized: its thresholds and codebook."""

    layer_type: str
    centres: np.ndarray  # float32, sorted
    protect_magnitude: float  # |w| above this is protected
    protect_sensitivity: float | None  # sensitivity above this is protected (None: unused)
    prune_threshold: float | None  # the pruning criterion below this is pruned (None: no pruning)
    prune_by: str
    # computes this tensor's sensitivity (|EMA(g) * w|, or of its residual) when its codes are
    # made: as large as the weights in float32, so a plan holds the recipe, not the values
    sensitivity: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    dither_seed: int | None = None  # stochastic rounding's seed for this tensor (None: nearest)
    dither_offset: int = 0  # index of the first value in the whole tensor (a shard's offset)
    residual: str = "none"  # "none", or the kind of reference the codes are a residual against
    # computes the flat float32 reference values (a residual's), read when the codes are made or
    # decoded: as large as the weights, so a plan holds the recipe, not the values
    reference: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    feedback: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)  # (factor, order), see .feedback
    rare_rows: np.ndarray | None = field(default=None, repr=False)  # uint8 per row, 1: a rare row (rare_bins)
    common: int = 0  # with rare_rows: how many of the centres are the common rows' (the rest are the rare rows')
    # the partition's midpoints in the domain of the values the codes are made from, where that is
    # not the centres' (an Adam scale's codes are made from v: see moments.scale_plan); None: the
    # centres'. Nearest rounding by the partition only (no dither, error feedback or rare rows)
    thresholds: np.ndarray | None = field(default=None, repr=False)
    # under QuantConfig.trellis: the spacing of each uniform grid the centres are (trellis.grid;
    # with rare_rows, the common rows' and the rare rows'), rounded to by TCQ down each column
    # (with error feedback, or by row kind); None: nearest-centre rounding
    trellis_steps: tuple[float, ...] | None = None
    # round each value to its nearest centre, error feedback and the trellis left out: how the
    # search sizes candidates (see search.configuration.measured_bits)
    nearest: bool = False
    # a keyframe may code the codes with contexts from their rows' and columns' terms
    # (core.factored): an Adam scale's (moments.scale_plan), whose codes are close to a row
    # term plus a column term
    factored: bool = False

    def target(self, w: torch.Tensor) -> np.ndarray:
        """The flat float32 values the codes quantize: the weights, or their residual."""
        flat = flat_f32(w).numpy()
        return flat if self.reference is None else flat - self.reference_values()

    def codes(self, w: np.ndarray, centres: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """``(codes, protected count)`` of flat float32 weights (or bfloat16 ones as their bits,
        uint16, where :meth:`reads_bf16`); without centres every value that is neither pruned
        nor protected gets code ``FIRST_CENTRE``. Rounding is to the nearest centre, or
        stochastic when the plan has a ``dither_seed``."""
        centres = self.centres if centres is None else centres
        sens = self.sensitivity_values()
        if self.rare_rows is not None and centres.size:
            return self._rows_partition(w, sens, centres)
        codes, nprot = self._partition(w, sens, centres)
        if self.dither_seed is not None and centres.size:
            seeded_stochastic_codes(codes, w, centres, self.dither_seed, self.dither_offset, FIRST_CENTRE, PRUNED)
        return codes, nprot

    def reference_values(self) -> np.ndarray | None:
        """The flat float32 reference values of a residual plan, made now (None: direct coding)."""
        return None if self.reference is None else self.reference()

    def with_reference(self) -> tuple[TensorPlan, np.ndarray | None]:
        """This plan with its reference made once (its recipe then returns that array), and the
        array: for a caller that codes and then decodes or keeps one tensor's values, which
        would otherwise make the reference twice."""
        ref = self.reference_values()
        return (self if ref is None else replace(self, reference=lambda: ref)), ref

    def sensitivity_values(self) -> np.ndarray | None:
        """This tensor's sensitivity, flat float32 on the host, computed now (None: unused)."""
        return None if self.sensitivity is None else flat_f32(self.sensitivity()).numpy()

    def reads_bf16(self) -> bool:
        """Whether :func:`quantize` codes a bfloat16 tensor's bits as they are: the plan codes
        the values themselves (no reference) by the partition and, after a restore, the
        stochastic rounding (no error feedback, trellis grid or rare rows)."""
        return self.reference is None and self.partitions_on_device() and self.rare_rows is None

    def reads_parts(self) -> bool:
        """Whether :func:`quantize` codes values made a part at a time
        (:class:`~hf_dynaquant.core.dtypes.ValuesInParts`) a part at a time: the plan codes the
        values themselves, each by the partition alone (no reference, sensitivity, dither,
        error feedback, trellis grid or rare rows), as Adam's update is coded."""
        return (
            self.reference is None
            and self.sensitivity is None
            and self.dither_seed is None
            and self.feedback is None
            and self.rare_rows is None
            and self.trellis_steps is None
        )

    def partitions_on_device(self) -> bool:
        """Whether :meth:`device_codes` takes this plan (error feedback, trellis grids and rare
        rows: host only)."""
        return (self.feedback is None or self.nearest) and self.rare_rows is None and self.trellis_steps is None

    def device_codes(
        self, values: torch.Tensor, sensitivity: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes uint8, protected values as bfloat16)`` of flat float32 ``values`` (the
        target: a residual has its reference taken off already) where they live, equal to
        :meth:`codes` and the protected values :func:`quantize` stores (see the module
        docstring); ``sensitivity``: this plan's, flat, on the values' device."""
        if not self.partitions_on_device():
            raise ValueError("plans with error feedback, trellis grids or rare rows are partitioned on the host")
        mids, tau_sens, tau_prune, by_sens = self.rules(self.centres, sensitivity is not None)
        magnitude = values.abs()
        protected = magnitude > _at_most(self.protect_magnitude)
        if sensitivity is not None:
            protected |= sensitivity > _at_most(tau_sens)
        bounds = torch.from_numpy(mids).to(values.device)
        codes = (torch.searchsorted(bounds, values, out_int32=True) + FIRST_CENTRE).to(torch.uint8)
        if tau_prune >= 0:
            criterion = sensitivity if by_sens else magnitude
            codes.masked_fill_((criterion < _at_least(tau_prune)) | (criterion == 0), PRUNED)
        codes.masked_fill_(protected, PROTECTED)
        if self.dither_seed is not None and self.centres.size:
            u = device_uniform(self.dither_seed, self.dither_offset, values.numel(), values.device)
            centres = torch.from_numpy(self.centres).to(values.device)
            device_stochastic_codes(codes, values, centres, u, FIRST_CENTRE, PRUNED)
        return codes, values[protected].to(torch.bfloat16)

    def feedback_codes(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, decoded values)`` of flat float32 values rounded with error feedback
        (:func:`~.feedback.feedback_round`), the tensor seen as ``rows x in`` for the plan's
        ``in x in`` factor; each column is partitioned and rounded as :meth:`codes` does, or by the
        trellis down the column (:mod:`.trellis`) with ``trellis_steps`` (in the compiled kernel
        when there is one)."""
        factor, order = self.feedback
        cols = factor.shape[0]
        rows = w.size // cols
        codes = np.empty((cols, rows), dtype=np.uint8)  # in rounding order, a column per row
        sens = self.sensitivity_values()
        if sens is not None:
            sens = np.ascontiguousarray(sens.reshape(rows, cols)[:, order].T)
        table = code_table(self.centres)
        step = self.trellis_steps[0] if self.trellis_steps is not None else None
        c0 = float(self.centres[0]) if step is not None else 0.0
        if native is not None:
            mids, tau_sens, tau_prune, by_sens = self.rules(self.centres, sens is not None)

            def round_block(block: np.ndarray, u: np.ndarray, first: int) -> np.ndarray:
                errors = np.empty_like(block)
                part = sens[first : first + block.shape[0]] if sens is not None else block
                native.feedback_block_f32(
                    block, part, sens is not None, rows, u, self.protect_magnitude, tau_sens, tau_prune, by_sens,
                    mids, table, codes[first : first + block.shape[0]], errors, step is not None, c0, step or 0.0,
                )  # fmt: skip
                return errors

        else:

            def round_column(column: np.ndarray, k: int) -> np.ndarray:
                codes[k], _ = self._partition(column, None if sens is None else sens[k], self.centres)
                if step is not None:
                    trellis.round_sequences(column[None], codes[k : k + 1], c0, step, table)
                rounded = table[codes[k]]
                kept = codes[k] == PROTECTED
                rounded[kept] = _bf16(column[kept])
                return rounded

            round_block = columnwise(round_column)
        values = feedback_round(w.reshape(rows, cols), factor, order, round_block)
        out = np.empty((rows, cols), dtype=np.uint8)
        out[:, order] = codes.T
        return out.reshape(-1), values.reshape(-1)

    def trellis_rows(self, w: np.ndarray, codes: np.ndarray) -> None:
        """Round the values of flat ``w`` that ``codes`` (flat, from :meth:`codes`) gives a centre
        by TCQ instead (:mod:`.trellis`), down each column, the common and the rare rows apart,
        each on its own grid; in place."""
        rows = self.rare_rows.size
        matrix, table = w.reshape(rows, -1), codes.reshape(rows, -1)
        for kind, (first, stop) in enumerate(((0, self.common), (self.common, self.centres.size))):
            which = self.rare_rows == kind
            grid = self.centres[first:stop]
            group = table[which]  # (the trellis runs down the columns of these rows: transposed views)
            trellis.round_sequences(matrix[which].T, group.T, float(grid[0]), self.trellis_steps[kind],
                                    code_table(grid))  # fmt: skip
            group[group >= FIRST_CENTRE] += first
            table[which] = group

    def row_values(self, w: np.ndarray, rare: bool) -> np.ndarray:
        """The flat values of the common (or the rare) rows of flat ``w``, in order."""
        return w.reshape(self.rare_rows.size, -1)[self.rare_rows == rare].reshape(-1)

    def _rows_partition(self, w: np.ndarray, sens: np.ndarray | None, centres: np.ndarray) -> tuple[np.ndarray, int]:
        """:meth:`_partition` of the common rows on the first ``common`` centres and of the rare
        rows on the others (their codes offset past the common rows' own)."""
        codes = np.empty((self.rare_rows.size, w.size // self.rare_rows.size), dtype=np.uint8)
        total = 0
        for rare, part, offset in ((False, centres[: self.common], 0), (True, centres[self.common :], self.common)):
            group_sens = None if sens is None else self.row_values(sens, rare)
            group, nprot = self._partition(self.row_values(w, rare), group_sens, part)
            group[group >= FIRST_CENTRE] += offset
            codes[self.rare_rows == rare] = group.reshape(-1, codes.shape[1])
            total += nprot
        return codes.reshape(-1), total

    def rules(self, centres: np.ndarray, has_sens: bool) -> tuple[np.ndarray, float, float, bool]:
        """What partitioning needs, as the kernels take it: the centres' midpoints (or the plan's
        ``thresholds``), the sensitivity protection threshold (inf: unused), the pruning
        threshold (-1: none) and whether pruning goes by sensitivity."""
        own = self.thresholds is not None and centres is self.centres  # (thresholds are of the plan's own grid)
        mids = self.thresholds if own else midpoints(centres)
        tau_sens = self.protect_sensitivity if self.protect_sensitivity is not None else float("inf")
        tau_prune = self.prune_threshold if self.prune_threshold is not None else -1.0
        return mids, tau_sens, tau_prune, self.prune_by == "sensitivity" and has_sens

    def keeps_every_value(self, has_sens: bool) -> bool:
        """Whether the partition gives every finite value a centre: nothing pruned or protected."""
        _, tau_sens, tau_prune, _ = self.rules(np.zeros(0, np.float32), has_sens)
        return self.protect_magnitude == math.inf and (not has_sens or tau_sens == math.inf) and tau_prune < 0

    def _partition(
        self, w: np.ndarray, sens: np.ndarray | None, centres: np.ndarray, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, int]:
        """``(codes, protected count)``: protected, pruned, else the nearest centre. ``w``: flat
        float32 values, or bfloat16 ones as their bits (uint16), read as they are; the codes
        go into ``out`` where given (uint8, one per value)."""
        mids, tau_sens, tau_prune, by_sens = self.rules(centres, sens is not None)
        if native is not None:
            codes = np.empty(w.size, dtype=np.uint8) if out is None else out
            nprot = native.partition(
                w,
                w.dtype == np.uint16,
                sens if sens is not None else mids,
                sens is not None,
                self.protect_magnitude,
                tau_sens,
                tau_prune,
                by_sens,
                mids,
                codes,
            )
            return codes, nprot
        if w.dtype == np.uint16:
            w = bf16_bits_to_f32(w)
        mag = np.abs(w)
        protected = mag > self.protect_magnitude
        if sens is not None:
            protected |= sens > tau_sens
        criterion = sens if by_sens else mag
        pruned = (
            ((criterion < tau_prune) | (criterion == 0)) & ~protected if tau_prune >= 0 else np.zeros_like(protected)
        )
        codes = (np.searchsorted(mids, w, side="left") + FIRST_CENTRE).astype(np.uint8)
        codes[pruned] = PRUNED
        codes[protected] = PROTECTED
        if out is not None:
            out[...] = codes
            codes = out
        return codes, int(protected.sum())


@dataclass
class QuantPlan:
    """The per-tensor plans of one checkpoint, and the configuration they came from."""

    config: QuantConfig
    tensors: dict[str, TensorPlan]


def refuse_or_warn_non_finite(tensors: Iterable[str], policy: str, where: str | None = None) -> None:
    """Apply a ``QuantConfig.non_finite`` policy to tensors found holding NaN or infinite values
    (``tensors``: how to name each, e.g. ``"'fc.weight'"``; ``where``: e.g. ``"step 40"``):
    raise :class:`NonFiniteTensorError`, or warn that they are stored losslessly."""
    named = list(tensors)
    if not named:
        return
    at = f" at {where}" if where else ""
    what = f"{', '.join(named)} {'holds' if len(named) == 1 else 'hold'} NaN or infinite values{at}"
    if policy == "raise":
        raise NonFiniteTensorError(
            f"{what}; QuantConfig(non_finite='raise') refuses to store them (the default, 'lossless', "
            "keeps them bit-exact)",
            named,
            where,
        )
    warnings.warn(
        f"{what}: stored losslessly (bit-exact, so NaN and inf survive the round trip) instead of "
        "quantized; QuantConfig(non_finite='raise') makes this an error",
        NonFiniteTensorWarning,
        stacklevel=3,
    )


def _finite(cache: dict, key: tuple, tensor: Callable[[], torch.Tensor], fresh: list) -> bool:
    """Whether a tensor holds only finite values, computed once per ``cache`` (the result of a
    new check is appended to ``fresh`` as ``(key, finite)``)."""
    if key not in cache:
        cache[key] = all_finite(tensor())
        fresh.append((key, cache[key]))
    return cache[key]


def remaining_sketch(
    plan: TensorPlan,
    w: np.ndarray,
    sens: np.ndarray | None,
    total: int,
    offset: int = 0,
    *,
    weight: int | None = None,
) -> LogSketch:
    """The sketch a codebook is clustered from: of the flat float32 values ``w`` (``sens``,
    their sensitivities, or ``None``) that ``plan``'s thresholds neither prune nor protect, read
    from their :func:`~.sketch.sample` (``total``, ``offset``: the tensor's size and where ``w``
    begins in it), so only the sample is partitioned (not at all when the plan neither prunes
    nor protects). ``weight``: ``w`` is a sample already, each value counting that many times."""
    x, counts = sample(torch.from_numpy(w), total, offset, given=weight)
    if plan.keeps_every_value(sens is not None):
        return LogSketch(KMEANS_ALPHA).add(x, weight=counts)
    s = None if sens is None else sample(torch.from_numpy(sens), total, offset, given=weight)[0].numpy()
    codes, _ = plan._partition(x.numpy(), s, np.zeros(0, np.float32))
    return LogSketch(KMEANS_ALPHA).add(x, where=(codes, FIRST_CENTRE), weight=counts)


def codebook_of(rest: LogSketch, k: int, config: QuantConfig) -> np.ndarray:
    """``k`` float32 K-means centres (Alg. 1) of a :func:`remaining_sketch`, a single 0 when it
    holds no value (every value pruned or protected)."""
    centres = approximate_kmeans(rest, k, sigma=config.sigma, seed=config.seed) if rest.count else np.zeros(1)
    return centres.astype(np.float32)


def midpoints(centres: np.ndarray) -> np.ndarray:
    """The float32 midpoints between consecutive sorted centres: where the partition's codes
    change from one centre to the next."""
    return ((centres[1:] + centres[:-1]) / 2).astype(np.float32)


def flat_f32(t: torch.Tensor) -> torch.Tensor:
    """A flat float32 CPU view or copy (codes are computed on the host; sketches where the tensor lives)."""
    return t.detach().reshape(-1).to("cpu", torch.float32).contiguous()


def plan_quantization(
    tensors: Mapping[str, torch.Tensor],
    config: QuantConfig,
    *,
    types: Mapping[str, str] | None = None,
    sensitivity: Mapping[str, torch.Tensor] | None = None,
    sketch_cache: dict | None = None,
    where: str | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
    calibration: Calibration | None = None,
    sample_weights: Mapping[str, int] | None = None,
    codebooks: bool = True,
) -> QuantPlan:
    """Thresholds and codebooks for every quantizable tensor of a checkpoint.

    ``types`` maps names to layer types (see :func:`layer_types`; inferred when missing);
    ``sensitivity`` maps names to ``|EMA(g) * w|`` tensors (absent: magnitude only).
    Each tensor is read a few times, a few tensors at a time, so a lazily loading mapping works;
    a sensitivity is read again whenever codes are made, never held by the plan (a
    :class:`~hf_dynaquant.core.memory.Computed` makes each on access); so is a ``reference``.
    ``sketch_cache`` (any dict, reused across calls on the same weights) keeps the per-tensor
    sketches, which do not depend on the configuration: the configuration search plans many
    candidates for one checkpoint.

    A tensor holding NaN or infinite values is left out of the plan (so stored losslessly) or
    refused, as ``config.non_finite`` says; ``where`` (e.g. ``"step 40"``) goes in the message,
    which is given once per ``sketch_cache``. A tensor on the meta device is refused.

    ``reference`` (used when ``config.residual`` is not ``"none"``) maps names to the values the
    residual is taken against (the kind ``config.residual`` names); a quantizable tensor with a
    reference of its shape is planned on ``w - ref``, and ``sensitivity`` should then hold
    ``|EMA(g) * (w - ref)|`` for it. A reference holding NaN or inf is not used.

    ``calibration`` (see :class:`Calibration`): with ``config.error_feedback``, every 2-D tensor
    with a Gram matrix of its inputs' width is rounded with error feedback.

    ``sample_weights`` names tensors given as a sample the caller took (:func:`~.sketch.sample`
    of a larger tensor), each value counting that many times: they are sketched as they are.

    ``codebooks=False`` plans the thresholds only, each plan's ``centres`` left empty (and no
    rare rows' codebook), for a caller that clusters sketches of its own
    (:func:`~hf_dynaquant.training.sharded.plan_sharded` merges every rank's sketch of a
    tensor's remaining values first).
    """
    cache = sketch_cache if sketch_cache is not None else {}
    presampled = sample_weights or {}
    refs = _references(tensors, reference, config.residual, cache)  # name -> where its reference lives

    def reference_of(name: str) -> torch.Tensor | None:
        """The reference of ``name``, read now (never held: a lazy mapping makes it on each read)."""
        return reference[name] if name in refs else None

    def flat_reference(name: str) -> Callable[[], np.ndarray] | None:
        """How a plan reads the flat float32 reference of ``name`` (None: coded directly)."""
        return (lambda: flat_f32(reference[name]).numpy()) if name in refs else None

    checked: list[tuple[tuple, bool]] = []  # finiteness checks made by this call (reported once per cache)

    def sketch_of(name: str, kind: str, values: Callable[[], torch.Tensor], magnitude: bool) -> LogSketch:
        # a residual's sketches apart; a direct tensor's keyed as callers that fill the cache expect
        key = (name, kind, config.alpha) + ((config.residual,) if name in refs else ())
        if key not in cache:
            x, weight = sampled(name, values())
            cache[key] = LogSketch(config.alpha).add(x, magnitude=magnitude, weight=weight)
        return cache[key]

    def sampled(name: str, values: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The values of ``name`` that its sketches read, and their weight."""
        return sample(values, numel[name], given=presampled.get(name))

    names, kinds, first_name = [], {}, {}
    numel: dict[str, int] = {}
    on_host: dict[str, bool] = {}
    for n in tensors:
        t = tensors[n]
        if not is_quantizable(t, config):
            continue
        kind = (types or {}).get(n) or infer_layer_type(n, tuple(t.shape))
        key = storage_key(t)
        if key in first_name:  # a tied weight: planned once, under its first name (as the store keeps it)
            if kind == EMBEDDING:
                kinds[first_name[key]] = EMBEDDING  # tied to an embedding: never pruned
            continue
        if key is not None:
            first_name[key] = n
        check_storable(t, n)
        if not _finite(cache, (n, "finite"), lambda t=t: t, checked):
            continue
        names.append(n)
        kinds[n] = kind
        numel[n] = t.numel()
        on_host[n] = t.device.type == "cpu" and (n not in refs or refs[n].type == "cpu")
    refuse_or_warn_non_finite([repr(k[0]) for k, ok in checked if not ok], config.non_finite, where)
    # each tensor's sensitivity, flat float32, made when read (see the docstring)
    sens: dict[str, Callable[[], torch.Tensor]] = {
        n: (lambda n=n: flat_f32(sensitivity[n])) for n in names if sensitivity is not None and n in sensitivity
    }
    sens_checked: list[tuple[tuple, bool]] = []
    sens = {n: s for n, s in sens.items() if _finite(cache, (n, "finite sensitivity"), s, sens_checked)}
    if bad_sens := [k[0] for k, ok in sens_checked if not ok]:
        warnings.warn(
            f"the sensitivity (|EMA(g) * w|) of {', '.join(map(repr, bad_sens))} holds NaN or infinite values"
            f"{f' at {where}' if where else ''} (a non-finite gradient in the EMA window): pruning and "
            "protection rank by magnitude",
            NonFiniteTensorWarning,
            stacklevel=2,
        )
    use_sens = bool(names) and len(sens) == len(names)
    if config.prune_by == "sensitivity" and names and not use_sens:
        warnings.warn(
            "prune_by='sensitivity' needs gradients (|EMA(g) * w|) for every quantized tensor; without them "
            "pruning and protection fall back to magnitude",
            stacklevel=2,
        )

    def magnitudes(n: str) -> LogSketch:
        """The sketch of the magnitudes of ``n`` (of its residual), made only when a threshold needs it."""
        return sketch_of(n, "magnitude", lambda: _residual(tensors[n], reference_of(n)), True)

    def merged(sketches: list[LogSketch]) -> LogSketch:
        out = LogSketch(config.alpha)
        for sk in sketches:
            out.merge(sk)
        return out

    # protection thresholds, global: half by magnitude, half by sensitivity
    share = config.protect / 2 if use_sens else config.protect
    no_protection = not names or config.protect <= 0
    prune_by = config.prune_by if use_sens else "magnitude"
    by_magnitude = [  # the tensors whose magnitude sketch a threshold needs
        n
        for n in names
        if not no_protection or (config.prune > 0 and kinds[n] != EMBEDDING and prune_by == "magnitude")
    ]
    if all(on_host[n] for n in by_magnitude):  # made a few at a time (an accelerator's, in this thread, below)
        for _ in ordered_map(_PLAN_POOL, magnitudes, by_magnitude, weight=numel.__getitem__, budget=VALUES_IN_FLIGHT):
            pass
    tau_mag = float("inf") if no_protection else merged([magnitudes(n) for n in names]).quantile(1 - share)
    tau_sens = None
    if use_sens and not no_protection:
        tau_sens = merged([sketch_of(n, "sensitivity", sens[n], False) for n in names]).quantile(1 - share)

    # pruning thresholds, one per layer type
    prune_tau: dict[str, float | None] = {}
    for kind in sorted(set(kinds.values())):
        members = [n for n in names if kinds[n] == kind]
        if kind == EMBEDDING or config.prune <= 0:
            prune_tau[kind] = None
        elif prune_by == "sensitivity":
            sketches = [sketch_of(n, "sensitivity", sens[n], False) for n in members]
            prune_tau[kind] = merged(sketches).quantile(config.prune)
        else:
            prune_tau[kind] = merged([magnitudes(n) for n in members]).quantile(config.prune)

    grams = {
        n: g
        for n, g in (calibration.grams if calibration is not None else {}).items()
        if n in kinds and tuple(g.shape) == (tensors[n].shape[-1],) * 2
    }

    # the row map of each quantized tensor whose row use calibration counted (1: never used)
    rare_rows = {
        n: (np.asarray(c) == 0).astype(np.uint8)
        for n, c in (calibration.rows if calibration is not None and config.rare_bins is not None else {}).items()
        if n in kinds and tensors[n].dim() == 2 and len(c) == tensors[n].shape[0]
    }

    def dither(name: str) -> int | None:
        return tensor_seed(config.rounding_seed, name) if config.rounding == "stochastic" else None

    def plan_of(n: str) -> TensorPlan:
        plan = TensorPlan(
            kinds[n],
            np.zeros(0, np.float32),
            tau_mag,
            tau_sens,
            prune_tau[kinds[n]],
            prune_by,
            sens.get(n),
            dither(n),
            residual=config.residual if n in refs else "none",
            reference=flat_reference(n),
        )
        if config.error_feedback and n in grams and n not in rare_rows and tensors[n].dim() == 2:
            if (n, "feedback") not in cache:
                cache[(n, "feedback")] = inverse_factor(grams[n])
            plan.feedback = cache[(n, "feedback")]
        if not codebooks:
            return plan
        k = config.embedding_bins if kinds[n] == EMBEDDING else config.bins
        if n not in rare_rows:
            plan.centres = codebook(plan, n, k)
            if config.trellis and plan.feedback is not None and plan.centres.size >= 2 and plan.centres[-1] > plan.centres[0]:
                plan.centres, step = trellis.grid(plan.centres)
                plan.trellis_steps = (step,)
            return plan
        plan.rare_rows = rare_rows[n]
        same = (rest_key(n, False), rest_key(n, True), k, config.rare_bins, config.trellis, config.sigma, config.seed,
                config.alpha, plan.rare_rows.tobytes(), "rows plan")  # fmt: skip
        if same in cache:  # every candidate with these thresholds: one plan (the search keeps its codes)
            return cache[same]
        common = codebook(plan, n, k, rare=False)
        rare = codebook(plan, n, config.rare_bins, rare=True)
        if config.trellis and all(c.size >= 2 and c[-1] > c[0] for c in (common, rare)):
            grids = [matched(plan, n, c, kind) for kind, c in enumerate((common, rare))]
            if grids[0][0].size + grids[1][0].size <= trellis.MAX_LEVELS:  # (else the codebooks: one byte a code)
                (common, step), (rare, rare_step) = grids
                plan.trellis_steps = (step, rare_step)
        plan.centres, plan.common = np.concatenate((common, rare)), common.size
        cache[same] = plan
        return plan

    def matched(plan: TensorPlan, n: str, centres: np.ndarray, kind: int) -> tuple[np.ndarray, float]:
        """The trellis grid of the common (``kind`` 0) or rare rows of ``n`` matched to their
        codebook's error (:func:`~.trellis.matched_grid`), kept in the cache: candidates that
        differ in bins only share it."""
        key = (rest_key(n, bool(kind)), centres.tobytes(), "trellis grid")
        if key not in cache:
            matrix = plan.target(tensors[n]).reshape(plan.rare_rows.size, -1)
            cache[key] = trellis.matched_grid(trellis_sample(matrix[plan.rare_rows == kind]), centres, tau_mag)
        return cache[key]

    def rest_key(n: str, rare: bool | None = None) -> tuple:
        """The cache key of the sketch of the values of ``n`` neither pruned nor protected: it
        depends on the thresholds, not on the bins, so candidates that differ in bins only share it."""
        residual = config.residual if n in refs else "none"
        return (n, "rest", residual, tau_mag, tau_sens, prune_tau[kinds[n]], prune_by, n in sens, rare)

    def rest_sketch(plan: TensorPlan, n: str, rare: bool | None = None) -> LogSketch:
        """That sketch, made on the host from the sample of the values it reads (of a host
        tensor as it is, where its values are the target: a bfloat16 one is not widened whole)."""
        tensor = tensors[n]  # (read once: a lazy mapping loads it at each read)
        if rare is None and plan.reference is None and tensor.device.type == "cpu":
            x, weight = sample(tensor.detach().reshape(-1), tensor.numel(), given=presampled.get(n))
            x = flat_f32(x)
        else:
            w = plan.target(tensor)
            if rare is not None:
                w = plan.row_values(w, rare)
            x, weight = sample(torch.from_numpy(w), w.size, given=presampled.get(n))
        s = None if plan.keeps_every_value(n in sens) else sensitivity_sample(plan, n, rare)  # (read only then)
        return remaining_sketch(plan, x.numpy(), s, x.numel(), weight=weight)

    def sensitivity_sample(plan: TensorPlan, n: str, rare: bool | None) -> np.ndarray | None:
        """The sample of the sensitivity of ``n`` (of its common or rare rows) that its rest
        sketches read, kept in the cache: every candidate's thresholds read the same one, and a
        sensitivity is otherwise computed anew each time it is read."""
        if n not in sens:
            return None
        key = (n, "sensitivity sample", config.residual if n in refs else "none", rare)
        if key not in cache:
            s = sens[n]().numpy()
            s = s if rare is None else plan.row_values(s, rare)
            cache[key] = sample(torch.from_numpy(s), s.size, given=presampled.get(n))[0].numpy()
        return cache[key]

    def codebook(plan: TensorPlan, n: str, k: int, rare: bool | None = None) -> np.ndarray:
        """``k`` K-means centres of the values of ``n`` neither pruned nor protected (of its
        common or rare rows only, with ``rare``)."""
        key = rest_key(n, rare)
        rest = cache.get(key)
        if rest is None:
            rest = cache[key] = rest_sketch(plan, n, rare)
        return codebook_of(rest, k, config)

    device = on_accelerator(tensors[n] for n in names) if names and codebooks and not rare_rows else None
    if device is not None:
        # on an accelerator those sketches are made there, in this thread (on its stream), before
        # the pool plans: the pool's threads never touch the tensors
        for n in names:
            key = rest_key(n)
            if key in cache:
                continue
            probe = TensorPlan(kinds[n], np.zeros(0, np.float32), tau_mag, tau_sens, prune_tau[kinds[n]], prune_by)
            with contextlib.suppress(torch.OutOfMemoryError):
                s = cached_on_device(cache, (n, "sensitivity", key[2]), sens[n], device) if n in sens else None
                if n not in sens or s is not None:
                    w, weight = sampled(n, _residual(tensors[n], reference_of(n)).reshape(-1).float())
                    codes, _ = probe.device_codes(w, None if s is None else sampled(n, s)[0])
                    cache[key] = LogSketch(KMEANS_ALPHA).add(w[codes == FIRST_CENTRE], weight=weight)
            if key not in cache:  # no room on the device: sketched on the host, in this thread too
                probe.reference = flat_reference(n)
                cache[key] = rest_sketch(probe, n)

    # each tensor's codebook on its own (seeded, so the same on any thread), a few tensors at a time
    plans = dict(zip(names, ordered_map(_PLAN_POOL, plan_of, names)))
    return QuantPlan(config, plans)


def trellis_sample(rows: np.ndarray, columns: int = 16) -> np.ndarray:
    """Up to ``columns`` of the columns of ``rows`` (``rows x width``), spread evenly, as the
    sequences a trellis runs down: the sample a grid's error is matched on
    (:func:`~.trellis.matched_grid`)."""
    stride = max(1, rows.shape[1] // columns)
    return np.ascontiguousarray(rows[:, ::stride][:, :columns].T, dtype=np.float32)


def _references(
    tensors: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor] | None, residual: str, cache: dict
) -> dict[str, torch.device]:
    """The tensors whose reference a residual configuration uses (one of the tensor's shape,
    finite), with the device each reference is on. Each reference is read once per ``cache``
    for these checks, and not held (a lazy mapping makes it again when a plan reads it)."""
    if residual == "none" or not reference:
        return {}
    out = {}
    for n in reference:
        if n not in tensors:
            continue
        key = (n, "usable reference", residual)
        if key not in cache:
            ref = reference[n]
            cache[key] = ref.device if tuple(ref.shape) == tuple(tensors[n].shape) and all_finite(ref) else None
        if cache[key] is not None:
            out[n] = cache[key]
    return out


def _residual(w: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """``w - ref`` in float32 where ``w`` lives (``w`` itself without a reference), as
    :meth:`TensorPlan.target` computes it."""
    if ref is None:
        return w
    flat = w.detach().reshape(-1).float()
    return (flat - ref.detach().reshape(-1).to(flat.device, torch.float32)).view(w.shape)


def quantize(w: torch.Tensor | ValuesInParts, plan: TensorPlan) -> tuple[np.ndarray, np.ndarray]:
    """``(codes uint8, protected values as bf16 bits uint16)`` of a tensor under its plan (of its
    residual when the plan has a reference). A bfloat16 tensor that the partition and the
    stochastic rounding code (no reference, error feedback, trellis or rare rows) is read as it
    is: no float32 copy (2 bytes a value of new memory), the same codes, and its protected values
    are its own bits. Values made a part at a time are coded a part at a time where the plan
    :meth:`~TensorPlan.reads_parts` (the same codes), else made whole first."""
    if isinstance(w, ValuesInParts):
        if plan.reads_parts():
            return _quantize_parts(w, plan)
        w = from_raw(w.made())
    bits = _bf16_bits(w) if plan.reads_bf16() else None
    if bits is not None:
        codes, protected = plan.codes(bits)
        return codes, _selected(codes, protected, bits)
    flat = plan.target(w)
    protected: int | None = None  # how many, where the partition counted them
    if plan.feedback is not None and not plan.nearest:
        codes, flat = plan.feedback_codes(flat)
    else:
        codes, protected = plan.codes(flat)
        if plan.trellis_steps is not None and plan.rare_rows is not None and not plan.nearest:
            plan.trellis_rows(flat, codes)
    if protected == 0:  # (optimizer moments are never protected: no pass over the codes for them)
        return codes, np.zeros(0, dtype=np.uint16)
    if protected is not None and native is not None and flat.dtype == np.float32:
        values = _selected(codes, protected, np.ascontiguousarray(flat))
    else:
        values = flat[codes == PROTECTED]
    return codes, _bf16_bits_of(values)


def _quantize_parts(values: ValuesInParts, plan: TensorPlan) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize` of values made :data:`PART_VALUES` at a time into one buffer, each part
    partitioned as it is made (the plan :meth:`~TensorPlan.reads_parts`): the values are never
    held whole. On one thread, Adam's update of a 124M GPT-2's embedding made and partitioned
    so took 0.6 ns a value, against 0.9 made whole first (``benchmarks/RESULTS.md``, session 49)."""
    n = values.numel
    codes = np.empty(n, dtype=np.uint8)
    part = np.empty(min(n, PART_VALUES), dtype=np.float32)
    protected = []
    for start in range(0, n, PART_VALUES):
        stop = min(n, start + PART_VALUES)
        w = part[: stop - start]
        values.fill(start, stop, w)
        _, count = plan._partition(w, None, plan.centres, codes[start:stop])
        if count:
            protected.append(_selected(codes[start:stop], count, w))
    if not protected:
        return codes, np.zeros(0, dtype=np.uint16)
    return codes, _bf16_bits_of(np.concatenate(protected))


def _bf16_bits_of(values: np.ndarray) -> np.ndarray:
    """Float32 protected values rounded to bfloat16, as the bits (uint16) they are stored as."""
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_bits(w: torch.Tensor) -> np.ndarray | None:
    """The flat bits (uint16) of a bfloat16 CPU tensor, None for another."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        return None
    return w.detach().reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)


def _selected(codes: np.ndarray, count: int, values: np.ndarray) -> np.ndarray:
    """The ``count`` values (flat float32, or bfloat16 bits) whose code is ``PROTECTED``, in
    order, in an array of their own (never a view of ``values``, which may be the tensor's
    memory): found where the codes say, into an array of that size (no mask of every value)."""
    if count == 0:
        return np.zeros(0, dtype=values.dtype)
    if native is None:
        return values[codes == PROTECTED]
    out = np.empty(count, dtype=values.dtype)
    return out[: native.select_u8(codes, PROTECTED, values, out)]


def _bf16(values: np.ndarray) -> np.ndarray:
    """Float32 values rounded to bfloat16, as protected values are stored."""
    return torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()


def dequantize(codes: np.ndarray, centres: np.ndarray, protected_bf16: np.ndarray) -> np.ndarray:
    """Float32 values of codes (pruned: 0, protected: their bf16 values, in order)."""
    return decoded_values(codes, centres, protected_bf16)


class Coded(Protocol):
    """A quantized tensor as :func:`decoded_values` takes it (the codec's state is one)."""

    codes: np.ndarray  # flat
    centres: np.ndarray  # float32
    protected: np.ndarray  # uint16 bfloat16 bits, in element order
    shape: tuple[int, ...]  # the tensor's


def code_table(centres: np.ndarray) -> np.ndarray:
    """Each code's float32 value: 0 for the pruned and protected codes (a protected value is
    stored apart), then the centres."""
    return np.concatenate(([0.0, 0.0], centres)).astype(np.float32)


def decoded_values(
    codes: np.ndarray,
    centres: np.ndarray,
    protected_bf16: np.ndarray,
    reference: np.ndarray | None = None,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The flat float32 values a tensor decodes to: :func:`dequantize`, plus the reference of a
    residual (a pruned residual keeps the reference value). The one rule the search's evaluation,
    the codec's encode and its decode share, so a restore gives exactly what the search judged.
    One pass in the compiled kernel. ``out``: a flat float32 array of the codes' size to write
    them into (a restore's model parameter), returned; when the codes do not decode (the
    ``ValueError``), what it holds is undefined."""
    table = code_table(centres)
    if reference is not None and reference.size != codes.size:
        raise ValueError(f"the reference holds {reference.size} values, the codes {codes.size}")
    if out is not None and (out.dtype != np.float32 or out.shape != (codes.size,)):
        raise ValueError(f"the output holds {out.size} {out.dtype} values, the codes decode to {codes.size} float32")
    if native is not None and codes.dtype == np.uint8:
        out = np.empty(codes.size, dtype=np.float32) if out is None else out
        ref = np.ascontiguousarray(reference, dtype=np.float32) if reference is not None else out[:0]
        used = native.dequantize_u8(
            np.ascontiguousarray(codes).reshape(-1),
            table,
            np.ascontiguousarray(protected_bf16, dtype=np.uint16),
            ref,
            reference is not None,
            out,
        )
    else:
        values = table[codes]
        prot = codes == PROTECTED
        used = int(prot.sum())
        if used == protected_bf16.size:
            values[prot] = bf16_bits_to_f32(protected_bf16)
        if reference is not None:
            values += reference
        if out is None:
            out = values
        else:
            out[...] = values.reshape(-1)
    if used != protected_bf16.size:
        raise ValueError(f"{protected_bf16.size} protected values stored, {used} codes need one")
    return out


def coded_values(c: Coded) -> torch.Tensor:
    """The float32 values of a quantized tensor's codes (:func:`decoded_values`), in its shape."""
    return torch.from_numpy(decoded_values(c.codes, c.centres, c.protected)).reshape(c.shape)


def device_decoded(
    codes: torch.Tensor, centres: np.ndarray, protected: torch.Tensor, reference: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat float32 values codes decode to, where they live: :func:`decoded_values`
    (pruned 0, protected their bfloat16 values in order, else their centre; plus the reference
    of a residual), bit for bit."""
    table = torch.from_numpy(code_table(centres)).to(codes.device)
    out = table.index_select(0, codes.int())
    out[codes == PROTECTED] = protected.float()
    return out if reference is None else out + reference


def _at_most(t: float) -> float:
    """The largest float32 not above ``t``: float32 ``x > t`` exactly when ``x >`` it."""
    with np.errstate(over="ignore"):
        f = np.float32(t)
    return float(np.nextafter(f, np.float32(-np.inf)) if float(f) > t else f)


def _at_least(t: float) -> float:
    """The smallest float32 not below ``t``: float32 ``x < t`` exactly when ``x <`` it."""
    with np.errstate(over="ignore"):
        f = np.float32(t)
    return float(np.nextafter(f, np.float32(np.inf)) if float(f) < t else f)
