"""One settings object for training checkpoints, shared by every entry point.

:class:`CheckpointSettings` says how a run's checkpoints are compressed: the quantization
knobs, the quality test the configuration search keeps (``threshold`` and what it is measured
on), the optimizer-state mode, the delta chain, the background writer. The plain-PyTorch
:class:`~hf_dynaquant.training.compressor.Compressor`, the sharded compressor, the Trainer's
:class:`~hf_dynaquant.integrations.trainer.DynaQuantCallback` and Accelerate's
:class:`~hf_dynaquant.integrations.accelerate.DynaQuantPlugin` all take it (their keyword
arguments are shortcuts that build one), and it is validated once, here, with
:class:`~hf_dynaquant.errors.InvalidSettingError` naming the setting.

:meth:`CheckpointSettings.from_env` reads the ``ACCELERATE_DYNAQUANT_*`` environment variables
(the way Accelerate's own plugins take their defaults, so ``accelerate launch`` users can set
them); each field's ``metadata`` names its variable and help text.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import torch

from ..codecs import codec_names
from ..codecs.dynaquant import DEFAULT_DELTA_CODING, DELTA_CODINGS
from ..core.quantizer import QuantConfig
from ..errors import InvalidSettingError
from ..search import QualityMetric, SearchSpace, mean_loss
from ..search.peers import PEER_CUBES
from .optimizer_state import OPTIMIZER_MODES, MomentQuant

__all__ = ["CheckpointSettings", "SettingsView", "ENV_PREFIX", "DEFAULT_EVAL_EXAMPLES", "BUSY_SAVES"]

ENV_PREFIX = "ACCELERATE_DYNAQUANT_"
BUSY_SAVES = ("plain", "wait")  # see CheckpointSettings.busy_saves
JOINT_CODECS = ("excp",)  # codecs of weights and optimizer state together (hf_dynaquant.training.excp)
# Examples of the eval dataset the Trainer's default test evaluates every candidate on (all of it
# when smaller). The standard error of a paired degradation falls as 1/sqrt(examples). Measured on
# a tiny GPT-2 LM at 4 bins (benchmarks/bench_restore_budget.py's model, 150 steps): loss
# degradation 0.31% with standard error 0.30% on 32 examples (the old default, 4 batches of 8),
# 0.088% on 128, 0.045% on 512, so 512 resolves a 1% loss threshold with room to spare. An
# accuracy degradation's standard error is about sqrt(changed predictions) / examples / accuracy:
# at 512 a 1% threshold passes only candidates that change a few predictions (raise
# eval_examples for a classification metric to let more through). Each candidate costs 512
# forward passes.
DEFAULT_EVAL_EXAMPLES = 512


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser where ``none`` / ``off`` mean "no value"."""
    return lambda raw: None if raw.strip().lower() in ("none", "off") else parse(raw)


def _boolean(raw: str) -> bool:
    """An environment flag as Accelerate reads its own (``true``/``1``/``yes``/...)."""
    from accelerate.utils import str_to_bool  # imported when a variable is read: accelerate is heavy

    return bool(str_to_bool(raw))


def _setting(default: Any, help: str, env: Callable[[str], Any] | None = None) -> Any:
    """A field with its help text and, where ``env`` is given, the parser of its environment variable."""
    return field(default=default, metadata={"help": help, "env": env})


@dataclass(frozen=True)
class CheckpointSettings:
    """How a run's training checkpoints are compressed (see the module docstring).

    Frozen: derive a changed copy with :meth:`replace`. Every field is documented in its
    ``metadata["help"]``; ``python -c "from hf_dynaquant import CheckpointSettings as S;
    S.describe()"`` prints them.
    """

    threshold: float | None = _setting(
        0.01,
        "How much worse (relative, 0.01 = 1%) the quality metric may be on any decoded checkpoint, which is what "
        "training resumed from it starts with, than on the uncompressed weights, with one-sided 95% confidence "
        "where the metric gives a standard error; the most compressive configuration within it is searched at "
        "every checkpoint. None: store every checkpoint with `config` as it is.",
        _optional(float),
    )
    config: QuantConfig | None = _setting(
        None, "The fixed quantization knobs (and the configuration itself when threshold is None)."
    )
    metric: QualityMetric | Callable[[torch.nn.Module], float] | None = _setting(
        None,
        "What the threshold is measured on: a QualityMetric, or a callable model -> float (lower is better unless "
        "higher_is_better). Default: the integration's own (the Trainer's metric_for_best_model and loss), else "
        "the mean loss on eval_data.",
    )
    higher_is_better: bool = _setting(False, "Direction of a callable metric.")
    eval_data: Any = _setting(
        None,
        "Model-ready evaluation batches (a DataLoader or a list) for the default metric, the same on every rank; "
        "the batches are the units of the standard error, so give 16 or more for a 1% threshold to be resolved. "
        "Default with the Trainer: eval_examples examples of its eval dataset.",
    )
    eval_examples: int = _setting(
        DEFAULT_EVAL_EXAMPLES,
        "How many examples of the Trainer's eval dataset the default test evaluates every candidate on.",
        int,
    )
    search_space: SearchSpace | None = _setting(
        None, "The configuration cube (SearchSpace: the paper's Table 7 plus 3 bins, and the residual kinds)."
    )
    search_seconds: float | None = _setting(
        None,
        "Most seconds one checkpoint's configuration search may take (every candidate is a pass over the eval "
        "examples: minutes at 100M+ parameters on a CPU). Once spent no further candidate is evaluated: the "
        "checkpoint takes a passing configuration already found, else it is stored losslessly, never with an "
        "unverified one. None: unbounded.",
        _optional(float),
    )
    optimizer_state: str = _setting(
        "compress",
        "'compress' (Adam moments and SGD momentum quantized, fidelity checked), 'lossless' or 'drop' (no "
        "optimizer state; a load warns loudly).",
        str,
    )
    moment_quant: MomentQuant | None = _setting(None, "Settings of optimizer_state='compress' (MomentQuant).")
    keyframe_every: int = _setting(
        10,
        "Longest delta chain: every keyframe_every-th checkpoint is self-contained, which bounds restore time.",
        int,
    )
    restore_depth: int | None = _setting(
        None,
        "Most deltas a restore replays: a checkpoint whose restore would replay restore_depth + 1 deltas is coded "
        "on its chain's keyframe instead (an anchor), so any checkpoint restores from its keyframe and at most "
        "restore_depth deltas. An anchor is larger than a delta on the checkpoint before (at 124M, 28-36 MB against "
        "11-27 MB) but far smaller than a keyframe (95 MB), takes no 'previous' residual, and the compressor keeps "
        "the keyframe's codes (a few bits a value) between saves while an anchor may come. None: each delta on the "
        "checkpoint before (up to keyframe_every - 1 of them).",
        _optional(int),
    )
    checkpoint_every: int | None = _setting(
        None,
        "Optimizer steps between checkpoints, if regular: gradients are then recorded only in the ema_steps steps "
        "before each (else at every step). The Trainer integration reads it from TrainingArguments.",
        _optional(int),
    )
    ema_steps: int = _setting(
        50, "Optimizer steps before a checkpoint over which the gradient EMA (sensitivity) is taken.", int
    )
    ema_beta: float = _setting(0.9, "EMA weight of the newest gradient.", float)
    background: bool = _setting(
        True,
        "Encode and write on a background thread (at most one checkpoint in flight; its error is raised at the "
        "next optimizer step or save).",
        _boolean,
    )
    use_accelerator: bool = _setting(
        True,
        "With the model on a CUDA device that has room: keep the gradient EMA of the window before a save there "
        "(float32, 4 bytes a parameter), take a background save's snapshot as a copy on the device (milliseconds "
        "of stall; moved to host memory in the background) and evaluate the search's candidates there. False: "
        "gradients copied to the host at every window step, the snapshot straight into host memory (a stall of one "
        "device-to-host copy) and the search on a CPU copy of the model, using no device memory.",
        _boolean,
    )
    busy_saves: str = _setting(
        "plain",
        "What a save does when the checkpoint before it is still being encoded in the background: 'plain' (the "
        "framework's own uncompressed, resumable save, so training never stalls longer than a plain save; the "
        "next save is compressed again) or 'wait' (block until the encoder is done: every checkpoint compressed).",
        str,
    )
    delta_coding: str = _setting(
        DEFAULT_DELTA_CODING,
        "'ans' (regrouped, rANS-coded; default), 'regroup' (the paper's), 'rle' or 'entropy'.",
        str,
    )
    codec: str = _setting(
        "dynaquant",
        "The weights' codec: 'dynaquant' (the method: config's plan, or the search under a threshold), or, for "
        "comparisons, a peer: 'qd', 'cnr', 'gobo' and 'jointsq' have their knob searched under the threshold as "
        "the DynaQuant paper searched its baselines (hf_dynaquant.search.peers), or run at their defaults with "
        "threshold=None; 'nf4', 'excp' and 'lossless' take threshold=None. The optimizer state keeps "
        "optimizer_state's coding, except with 'excp', which codes the weights' residuals and Adam's moments "
        "together (hf_dynaquant.training.excp).",
        str,
    )
    progress: bool | None = _setting(
        None, "Show a progress bar while a checkpoint is written (default: for checkpoints over 256 MB).", None
    )
    pretrained: Any = _setting(
        "auto",
        "The pre-trained weights a fine-tune's checkpoints may be coded as residuals against: 'auto' takes the "
        "folder, or the Hub repo in the local Hugging Face cache, that from_pretrained loaded the model from "
        "(safetensors only, never downloaded; none for a model built from a config); a folder path or cached repo "
        "id names them; None turns residuals against them off. They must stay available, unchanged, to restore.",
        _optional(str),
    )
    store_dir: str | None = _setting(
        None,
        "Where the compressed entries go (outside the rotated folders). Default: <output_dir>/dynaquant (Trainer), "
        "<project_dir>/dynaquant or dynaquant beside the checkpoint folders (Accelerate).",
        _optional(str),
    )

    def __post_init__(self) -> None:
        if self.threshold is not None and not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise InvalidSettingError(f"threshold must be a finite number >= 0 or None, got {self.threshold!r}")
        for name in ("keyframe_every", "restore_depth", "ema_steps", "eval_examples", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidSettingError(f"{name} must be an integer of at least 1, got {value!r}")
        seconds = self.search_seconds
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise InvalidSettingError(f"search_seconds must be a finite number > 0 or None, got {seconds!r}")
        if not 0 < self.ema_beta <= 1:
            raise InvalidSettingError(f"ema_beta must be in (0, 1], got {self.ema_beta!r}")
        if self.optimizer_state not in OPTIMIZER_MODES:
            raise InvalidSettingError(f"optimizer_state must be one of {OPTIMIZER_MODES}, got {self.optimizer_state!r}")
        if self.busy_saves not in BUSY_SAVES:
            raise InvalidSettingError(f"busy_saves must be one of {BUSY_SAVES}, got {self.busy_saves!r}")
        if self.delta_coding not in DELTA_CODINGS:
            raise InvalidSettingError(f"delta_coding must be one of {DELTA_CODINGS}, got {self.delta_coding!r}")
        if self.codec not in codec_names():
            raise InvalidSettingError(f"codec must be one of {codec_names()}, got {self.codec!r}")
        if self.codec in JOINT_CODECS and self.optimizer_state != "compress":
            raise InvalidSettingError(
                f"codec={self.codec!r} codes the optimizer's moments together with the weights, in place of "
                f"optimizer_state's coding: leave optimizer_state='compress' (got {self.optimizer_state!r})"
            )
        if self.codec != "dynaquant" and self.codec not in PEER_CUBES and self.threshold is not None:
            raise InvalidSettingError(
                f"codec={self.codec!r} takes threshold=None: it has no configuration to search (searchable peers: "
                f"{', '.join(sorted(PEER_CUBES))}) and codes the weights with its defaults (got threshold={self.threshold!r})"
            )

    @classmethod
    def from_env(cls, **given: Any) -> CheckpointSettings:
        """Settings whose defaults come from ``ACCELERATE_DYNAQUANT_<FIELD>`` variables where
        set (``none`` or ``off`` for "no value"); the keyword arguments always win."""
        values = dict(given)
        for f in fields(cls):
            parse = f.metadata.get("env")
            if f.name in values or parse is None:
                continue
            raw = os.environ.get(ENV_PREFIX + f.name.upper(), "")
            if not raw:
                continue
            try:
                values[f.name] = parse(raw)
            except ValueError as exc:
                raise InvalidSettingError(f"{ENV_PREFIX}{f.name.upper()}={raw!r} cannot be used: {exc}") from None
        return cls(**values)

    def replace(self, **changes: Any) -> CheckpointSettings:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def quality_metric(self, default: QualityMetric | None = None) -> QualityMetric | None:
        """The metric the threshold is measured on (``None`` without a threshold): ``metric``,
        else the integration's ``default``, else the mean loss on ``eval_data``. The one place
        that refuses a threshold with nothing to judge configurations by."""
        if self.threshold is None:
            return None
        if self.metric is not None:
            if isinstance(self.metric, QualityMetric):
                return self.metric
            return QualityMetric(self.metric, higher_is_better=self.higher_is_better)
        if default is not None:
            return default
        if self.eval_data is None:
            raise InvalidSettingError(
                f"threshold={self.threshold} needs eval_data= (a few batches) or metric= to judge configurations; "
                f"or fix the configuration with threshold=None ({ENV_PREFIX}THRESHOLD=none) and config=QuantConfig(...)"
            )
        return mean_loss(self.eval_data)

    @classmethod
    def describe(cls) -> str:
        """Every setting, its default, its environment variable and what it does, as text."""
        lines = []
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            env = f"  (env {ENV_PREFIX}{f.name.upper()})" if f.metadata.get("env") else ""
            lines.append(f"{f.name} = {default!r}{env}\n    {f.metadata['help']}")
        return "\n".join(lines)


_FIELD_NAMES = frozenset(f.name for f in fields(CheckpointSettings))


class SettingsView:
    """A mixin for objects that hold a :class:`CheckpointSettings` as ``self.settings``: its
    fields read through (``callback.threshold`` is ``callback.settings.threshold``)."""

    settings: CheckpointSettings

    def __getattr__(self, name: str) -> Any:
        if name in _FIELD_NAMES and "settings" in vars(self):
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
