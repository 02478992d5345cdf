"""The configuration cube the search walks (the paper's Table 7, plus 3 bins) and what a search
returns: :class:`SearchSpace`, the residual :class:`Reference` a candidate may be coded against,
a judged :class:`Candidate` and the :class:`SearchResult`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..core.quantizer import (
    RESIDUALS,
    QuantConfig,
    QuantPlan,
)
from ..errors import InvalidSettingError
from ..renames import renamed_attribute, renamed_keywords

__all__ = ["SearchSpace", "Reference", "Candidate", "SearchResult"]


@renamed_keywords(metrics="prune_by")
@dataclass(frozen=True)
class SearchSpace:
    """The configuration cube (the paper's Table 7, plus 3 bins). Each axis is listed from the
    most compressive to the highest-quality value; ``prune_by`` holds the pruning criteria searched
    (``QuantConfig.prune_by``; ``metrics=`` before).

    3 bins is our addition: on the Trainer benchmark (benchmarks/RESULTS.md, "Trainer
    integration") the search takes it at the 1% threshold and the run ends as close to the
    uncompressed one as with 4 bins (+0.3%) at 1.2x the weights ratio. 2 bins also passes the
    per-checkpoint test there but ends +2% after 10 restores, so it is not offered by default.
    """

    bins: tuple[int, ...] = (3, 4, 6, 8, 12, 16, 32)
    prune: tuple[float, ...] = (0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
    protect: tuple[float, ...] = (0.0005, 0.005, 0.01)
    prune_by: tuple[str, ...] = ("magnitude", "sensitivity")
    embedding_bins: tuple[int, ...] = (16, 32)
    residuals: tuple[str, ...] = ("pretrained", "previous", "none")  # each offered where available

    metrics = renamed_attribute("metrics", "prune_by")

    def __post_init__(self) -> None:
        if bad := [r for r in self.residuals if r not in RESIDUALS]:
            raise InvalidSettingError(f"SearchSpace.residuals: unknown {bad}; choose from {RESIDUALS}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.bins), len(self.prune), len(self.protect)

    @renamed_keywords(metric="prune_by", base="config")
    def config(
        self,
        point: tuple[int, int, int],
        prune_by: str,
        config: QuantConfig,
        embedding_bins: int,
        residual: str = "none",
    ) -> QuantConfig:
        """The configuration at ``point`` (indices along bins, prune, protect) pruned by
        ``prune_by``, with the other knobs of ``config``."""
        return replace(
            config,
            bins=self.bins[point[0]],
            prune=self.prune[point[1]],
            protect=self.protect[point[2]],
            prune_by=prune_by,
            embedding_bins=embedding_bins,
            residual=residual,
        )

    def point_of(self, config: QuantConfig) -> tuple[int, int, int]:
        return self.bins.index(config.bins), self.prune.index(config.prune), self.protect.index(config.protect)

    def holds(self, config: QuantConfig) -> bool:
        """Whether ``config`` is one of this cube's configurations (every searched knob on an axis)."""
        on_axes = (
            config.bins in self.bins
            and config.prune in self.prune
            and config.protect in self.protect
            and config.embedding_bins in self.embedding_bins
        )
        return on_axes and config.prune_by in self.prune_by and config.residual in self.residuals


@dataclass(frozen=True)
class Reference:
    """What residual candidates of one kind (``"previous"`` or ``"pretrained"``) code against:
    reference values by tensor name (a tensor without one is coded directly), and the
    sensitivity of the residual, ``|EMA(g) * (w - ref)|`` (``None`` without gradients)."""

    values: Mapping[str, torch.Tensor]
    sensitivity: Mapping[str, torch.Tensor] | None = None


@dataclass
class Candidate:
    """One evaluated configuration."""

    config: QuantConfig
    degradation: float  # of the binding measure: the one with the largest degradation + z * standard error
    bits: float  # measured: entropy of the codes + 16 per protected value, per quantized value
    passed: bool
    plan: QuantPlan | None = field(default=None, repr=False, compare=False)  # kept on the rank that made it
    standard_error: float = 0.0  # of ``degradation`` (paired: baseline and candidate on the same examples)
    measures: dict[str, tuple[float, float]] = field(default_factory=dict)  # every measure: (degradation, s.e.)
    weight_error: float | None = None  # relative L2 error of the decoded quantized weights (what a resume loads)

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "bins": c.bins,
            "prune": c.prune,
            "protect": c.protect,
            "prune_by": c.prune_by,
            "embedding_bins": c.embedding_bins,
            "residual": c.residual,
            "degradation": self.degradation,
            "standard_error": self.standard_error,
            "measures": {k: list(v) for k, v in self.measures.items()},
            "weight_error": self.weight_error,
            "bits": self.bits,
            "passed": self.passed,
        }


@dataclass
class SearchResult:
    """What the manager chose for one checkpoint and how."""

    config: QuantConfig | None  # None: nothing passed; store this checkpoint losslessly
    degradation: float | None
    baseline: float
    # "exhaustive" | "neighbourhood" | "fallback" | "non-finite" (the metric was NaN or inf) | "out of time"
    mode: str
    candidates: list[Candidate] = field(default_factory=list)
    local_evaluations: int = 0  # candidates this process evaluated itself (the rest came from other ranks)
    plan: QuantPlan | None = field(default=None, repr=False)
    sized: int = 0  # configurations planned and measured without evaluating the model, to order the candidates
    standard_error: float | None = None  # of the chosen candidate's degradation: what the test could resolve
    z: float = 0.0  # the pass rule: degradation + z * standard_error <= threshold
    weight_error: float | None = None  # of the chosen candidate: relative L2 error of the weights a resume loads
    bits: float | None = None  # of the chosen candidate: measured bits per quantized value, as stored
    # the search's delta costs after this choice (ConfigurationSearch.delta_bits): a resumed run goes on from them
    delta_bits: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the candidates are a record: their plans (sensitivities, references: up to the weights'
        # size in float32 each) served the search alone and are not kept past it
        self.candidates = [replace(c, plan=None) if c.plan is not None else c for c in self.candidates]

    @property
    def evaluations(self) -> int:
        return len(self.candidates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict() if self.config else None,
            "residual": self.config.residual if self.config else None,
            "degradation": self.degradation,
            "standard_error": self.standard_error,
            "z": self.z,
            "weight_error": self.weight_error,
            "bits": self.bits,
            "delta_bits": self.delta_bits,
            "baseline": self.baseline if math.isfinite(self.baseline) else str(self.baseline),  # JSON has no NaN
            "mode": self.mode,
            "evaluations": self.evaluations,
            "sized": self.sized,
            "candidates": [c.to_dict() for c in self.candidates],
        }
