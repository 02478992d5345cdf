"""The configuration search the DynaQuant paper gave its baselines, for a peer codec in training.

The paper compares DynaQuant with QD+, CNR+ and GOBO+ "with configuration search capability
(search space defined in Appendix A.3.1)" (section 8.3): each baseline's knob is searched per
checkpoint under the same quality threshold, so that methods are compared by their size at
equal quality rather than at fixed settings. :class:`PeerSearch` does that for the peers of
:mod:`hf_dynaquant.codecs.peers` (``DynaQuantCallback(codec="qd", threshold=0.01)``): at every
checkpoint it picks the most compressive value of the peer's knob (:data:`PEER_CUBES`) whose
decoded checkpoint passes the same test as :class:`~.configuration.ConfigurationSearch` (every
measure's degradation plus ``z`` standard errors within the threshold, on the same metric).

* **The cubes** (most compressive first; each knob's size grows along it):
  - ``qd``: bits 3-8, Table 8's 8-256 bins, one width for every layer (Table 8's minimum and
    maximum equal: QD's entropy-driven per-layer widths, :func:`~hf_dynaquant.codecs.peers.qd_bits`,
    would need a codec per tensor, which a checkpoint section does not have);
  - ``cnr``: bins 8-256 (Table 9). Table 9's range-search knobs (step bins, clipping range) only
    tune each row's range for a given size; searching them would multiply every checkpoint's
    evaluations by 20, so training keeps FBGEMM's defaults, and the Table 4 bench searches them;
  - ``gobo``: bins 8-256 (Table 10; its separate embedding bins would need a codec per tensor);
  - ``jointsq``: its budget of bits per value, 1-8 (the paper's own setting is 1.6).
  NF4 has a single configuration and ExCP codes weights and moments together with its own
  pruning ratios (:mod:`hf_dynaquant.training.excp`): neither is searched.
* **The walk** is the paper's along one axis: the first checkpoint tries the values from the
  most compressive one up, and the first that passes is the answer (sizes grow along the knob);
  a later checkpoint starts at the last answer and never goes bolder (the paper's
  neighbourhood rule: the model grows denser as training goes on), so after a walk in which
  nothing passed, not even the top, the next starts at the top. When nothing passes, or the
  search's seconds run out first, the checkpoint is stored losslessly, never unverified.
* **Evaluation** writes each candidate's decoded weights into the model the search is given,
  as :class:`~.configuration.ConfigurationSearch` does, and copies the originals back
  bit-exactly; the RNG states are saved and restored only on the thread that made the search.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codecs import get_codec
from ..core.dtypes import from_raw, to_raw
from ..errors import InvalidSettingError
from .configuration import DEFAULT_Z, evaluation_mode, pass_rule, written
from .quality import QualityMetric

__all__ = ["PEER_CUBES", "PeerSearch", "PeerChoice"]

#: Each searchable peer's knob and its values, most compressive first (see the module docstring).
PEER_CUBES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "qd": ("bits", (3, 4, 5, 6, 7, 8)),
    "cnr": ("bins", (8, 16, 32, 64, 128, 256)),
    "gobo": ("bins", (8, 16, 32, 64, 128, 256)),
    "jointsq": ("bits_per_value", (1.0, 1.6, 2.0, 3.0, 4.0, 6.0, 8.0)),
}


@dataclass
class PeerChoice:
    """What the search chose for one checkpoint: ``options`` for the peer's codec (``None``:
    nothing passed, store it losslessly) and every candidate judged, in the order tried."""

    codec: str
    options: dict[str, Any] | None
    baseline: float
    mode: str  # "exhaustive" | "neighbourhood" | "out of time" | "non-finite"
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        chosen = next((c for c in self.candidates if self.options and c["options"] == self.options), None)
        return {
            "codec": self.codec,
            "config": self.options,
            "degradation": chosen["degradation"] if chosen else None,
            "standard_error": chosen["standard_error"] if chosen else None,
            "baseline": self.baseline if math.isfinite(self.baseline) else str(self.baseline),
            "mode": self.mode,
            "evaluations": len(self.candidates),
            "candidates": self.candidates,
        }


class PeerSearch:
    """Chooses a peer codec's knob per checkpoint (see the module docstring).

    Args:
        codec: the peer's registered name, one of :data:`PEER_CUBES`.
        metric: the quality measure, as for :class:`~.configuration.ConfigurationSearch`.
        threshold: the relative degradation a decoded checkpoint may have (0.01 = 1%).
        z: standard errors added to a degradation before it is compared with the threshold.
        seconds: the most one checkpoint's search may take before it evaluates no further
            candidate (``None``: unbounded).
    """

    def __init__(
        self,
        codec: str,
        metric: QualityMetric,
        threshold: float,
        *,
        z: float = DEFAULT_Z,
        seconds: float | None = None,
    ) -> None:
        if codec not in PEER_CUBES:
            raise InvalidSettingError(f"codec={codec!r} has no configuration to search; searchable: {sorted(PEER_CUBES)}")
        self.codec, self.metric, self.threshold, self.z, self.seconds = codec, metric, threshold, z, seconds
        self.knob, self.values = PEER_CUBES[codec]
        self.last: int | None = None  # index of the last answer in self.values
        self._rng_thread = threading.get_ident()

    def continue_from(self, record: Mapping[str, Any] | None) -> None:
        """Go on from a stored checkpoint's search record (its ``search`` metadata), as if this
        search had made it: the next search starts at the value it chose, or at the top when it
        tried the top and nothing passed. Anything else starts the walk again."""
        self.last = None
        if not isinstance(record, Mapping) or record.get("codec") != self.codec:
            return
        options = record.get("config")
        if isinstance(options, Mapping) and options.get(self.knob) in self.values:
            self.last = self.values.index(options[self.knob])
        elif options is None and any(
            isinstance(c, Mapping) and (c.get("options") or {}).get(self.knob) == self.values[-1]
            for c in record.get("candidates") or ()
        ):
            self.last = len(self.values) - 1

    def search(self, model: torch.nn.Module, snapshot: Mapping[str, torch.Tensor], *, where: str | None = None) -> PeerChoice:
        """The choice for the checkpoint whose exact weights are ``snapshot`` (names as in
        ``model.state_dict()``), judged on ``model``."""
        started = time.perf_counter()
        rng = threading.get_ident() == self._rng_thread
        with evaluation_mode(model, rng):
            baseline = self.metric.measure(model)
        finite = math.isfinite(baseline.value)  # else nothing to compare candidates with
        mode = "non-finite" if not finite else "exhaustive" if self.last is None else "neighbourhood"
        choice = PeerChoice(self.codec, None, baseline.value, mode)
        for index in range(self.last or 0, len(self.values) if finite else 0):
            if self.seconds is not None and time.perf_counter() - started > self.seconds:
                choice.mode = "out of time"
                break
            options = {self.knob: self.values[index]}
            codec = get_codec(self.codec, **options)
            stored = [0]
            with evaluation_mode(model, rng), written(model, snapshot, self._decoded(codec, snapshot, stored)):
                value = self.metric.measure(model)
            measures = self.metric.compare(baseline, value)
            passed, deg, se = pass_rule(measures, self.threshold, self.z)
            choice.candidates.append(
                {
                    "options": options,
                    "degradation": deg,
                    "standard_error": se,
                    "measures": {k: list(v) for k, v in measures.items()},
                    "bytes": stored[0],
                    "passed": passed,
                }
            )
            if passed:
                choice.options, self.last = options, index
                return choice
        if choice.mode == "exhaustive" and len(choice.candidates) == len(self.values):
            self.last = len(self.values) - 1  # nothing passed, the top included: never bolder from here
        warnings.warn(
            f"the {self.codec} configuration search{f' at {where}' if where else ''} found no {self.knob} that keeps "
            f"the {self.metric.name} degradation within {self.threshold:.2%} ({choice.mode}): this checkpoint is "
            "stored losslessly",
            stacklevel=2,
        )
        return choice

    @staticmethod
    def _decoded(codec: Any, snapshot: Mapping[str, torch.Tensor], stored: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor the codec quantizes, as it decodes; ``stored[0]`` adds up their encoded bytes."""
        for name, tensor in snapshot.items():
            raw = to_raw(tensor.detach().cpu())
            if not codec.quantizes(raw):
                continue
            encoded = codec.encode(raw)
            stored[0] += sum(len(b) for b in encoded.blobs.values())
            yield name, from_raw(codec.to_raw(encoded.state))
