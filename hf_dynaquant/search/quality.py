"""Quality metrics: what the configuration search judges a decoded model by.

A :class:`QualityMetric` maps a model to a value (lower is better unless ``higher_is_better``)
and, where it can, to a :class:`Measurement` whose evidence gives the standard error of a paired
degradation (the baseline and a candidate see the same examples). The ready-made ones: the mean
loss (:func:`mean_loss`), perplexity, accuracy, and the output distortion snapshots use.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InvalidSettingError
from ..renames import renamed_keywords

__all__ = [
    "Measurement",
    "QualityMetric",
    "paired_standard_error",
    "held_out",
    "model_output_loss",
    "mean_loss",
    "perplexity",
    "accuracy",
    "output_distortion",
    "device_of",
    "move_to",
]


@dataclass
class Measurement:
    """One evaluation of a model by a :class:`QualityMetric`: its value and, for a metric that can
    say how precise it is, the per-example evidence that two evaluations on the same examples are
    compared by (per-batch losses, cached predictions)."""

    value: float
    evidence: Any = field(default=None, repr=False)


@dataclass
class QualityMetric:
    """A model-quality measure and its direction; :meth:`degradation` is relative (0.01 = 1%).

    A metric made with ``measure`` (``model -> Measurement``) and ``paired_error`` (``(baseline,
    candidate) -> standard error of the degradation``) tells the search how precisely a
    degradation is known: the baseline and a candidate are evaluated on the same examples, so
    the degradation is a paired difference whose standard error the evidence gives (see
    :func:`mean_loss` and :func:`hf_dynaquant.integrations.trainer.trainer_metric`)."""

    fn: Callable[[torch.nn.Module], float]
    higher_is_better: bool = False
    name: str = "metric"
    relative: bool = True  # False for a metric that is itself a distortion (0 = perfect)
    measure_fn: Callable[[torch.nn.Module], Measurement] | None = field(default=None, repr=False)
    paired_error: Callable[[Measurement, Measurement], float] | None = field(default=None, repr=False)

    def __call__(self, model: torch.nn.Module) -> float:
        return float(self.fn(model))

    def measure(self, model: torch.nn.Module) -> Measurement:
        """The value on ``model`` with the evidence :meth:`compare` needs."""
        return self.measure_fn(model) if self.measure_fn is not None else Measurement(self(model))

    def degradation(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline``, relative to it (negative: better)."""
        worse = baseline - value if self.higher_is_better else value - baseline
        return worse / max(abs(baseline), 1e-12) if self.relative else worse

    def compare(self, baseline: Measurement, value: Measurement) -> dict[str, tuple[float, float]]:
        """``{measure name: (degradation, standard error)}`` of a candidate against the baseline;
        a candidate passes only if every measure does. The standard error is 0 for a metric
        without ``paired_error`` (nothing is known about its precision)."""
        deg = self.degradation(baseline.value, value.value)
        se = self.paired_error(baseline, value) if self.paired_error is not None and math.isfinite(deg) else 0.0
        return {self.name: (deg, float(se))}


def paired_standard_error(baseline: np.ndarray, value: np.ndarray, scale: float) -> float:
    """Standard error of ``mean(value - baseline) / scale`` over paired units (examples or
    batches of the same examples); 0 with fewer than 2 units (nothing to estimate it from)."""
    diff = np.asarray(value, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if diff.size < 2:
        return 0.0
    return float(diff.std(ddof=1) / math.sqrt(diff.size) / max(abs(scale), 1e-12))


def _batches(data: Iterable[Any]) -> list[Any]:
    return list(data)


@renamed_keywords(data="eval_data")
def held_out(eval_data: Iterable[Any], n: int) -> list[Any]:
    """The first ``n`` batches of ``eval_data`` (a DataLoader, a list, any iterable), materialised,
    to evaluate candidates on; keep them out of training."""
    return list(itertools.islice(iter(eval_data), n))


def _loss_of(model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    if isinstance(batch, Mapping):
        out = model(**batch)
        return model_output_loss(out) if loss_fn is None else loss_fn(out, batch)
    inputs, target = batch
    out = model(inputs)
    logits = getattr(out, "logits", out)
    return (loss_fn or torch.nn.functional.cross_entropy)(logits, target)


def model_output_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output, read as ``transformers.Trainer.compute_loss`` reads it: a
    ``ModelOutput`` or a dict holds it under ``"loss"``, a tuple or list first."""
    if isinstance(out, Mapping):  # ModelOutput is an OrderedDict
        loss = out.get("loss")
    elif isinstance(out, (tuple, list)):
        loss = out[0] if out else None
    else:
        loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        keys = f" (keys: {', '.join(map(str, out.keys()))})" if isinstance(out, Mapping) else ""
        raise InvalidSettingError(
            f"the model returned no loss for an evaluation batch: got {type(out).__name__}{keys}; give the batches "
            "their labels, or pass metric= (a callable model -> float) for the configuration search"
        )
    return loss


@renamed_keywords(data="eval_data")
def mean_loss(
    eval_data: Iterable[Any],
    loss_fn: Callable | None = None,
    *,
    compute_loss: Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor] | None = None,
) -> QualityMetric:
    """Mean loss over evaluation batches (lower is better). A batch is a dict for a Hugging Face
    model (the loss of ``model(**batch)``: a ``ModelOutput``'s or dict's ``"loss"``, a tuple's
    first element) or an ``(inputs, target)`` pair (cross-entropy by default). ``compute_loss``
    (``(model, batch) -> loss``, e.g. a ``Trainer``'s own ``compute_loss``) replaces the default for
    dict batches; it gets a shallow copy of each batch, so it may pop keys.

    The batches are the paired units of the standard error (a loss function returns one mean
    per batch): the degradation's standard error is that of the mean of per-batch differences,
    so it needs at least 2 batches (with 1 it is reported as 0)."""
    batches = _batches(eval_data)

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if compute_loss is not None and isinstance(batch, Mapping):
            return compute_loss(model, dict(batch))
        return _loss_of(model, batch, loss_fn)

    def measure(model: torch.nn.Module) -> Measurement:
        dev = device_of(model)
        losses = np.array([loss(model, move_to(b, dev)).item() for b in batches], dtype=np.float64)
        return Measurement(float(losses.mean()), losses)

    return _paired(measure, higher_is_better=False, name="loss")


def _paired(measure: Callable[[torch.nn.Module], Measurement], *, higher_is_better: bool, name: str) -> QualityMetric:
    """A metric whose measurements carry per-unit evidence (per-batch losses, per-example
    correctness): a degradation's standard error comes from the paired differences."""
    return QualityMetric(
        lambda model: measure(model).value,
        higher_is_better=higher_is_better,
        name=name,
        measure_fn=measure,
        paired_error=lambda base, cand: paired_standard_error(base.evidence, cand.evidence, base.value),
    )


@renamed_keywords(data="eval_data")
def perplexity(eval_data: Iterable[Any]) -> QualityMetric:
    """``exp`` of the mean loss over ``eval_data`` (lower is better)."""
    loss = mean_loss(eval_data)
    return QualityMetric(lambda m: math.exp(loss(m)), higher_is_better=False, name="perplexity")


@renamed_keywords(data="eval_data")
def accuracy(eval_data: Iterable[Any]) -> QualityMetric:
    """Top-1 accuracy over ``eval_data``, ``(inputs, labels)`` batches (higher is better); the
    standard error of a degradation from the per-example differences in correctness."""
    batches = _batches(eval_data)

    def measure(model: torch.nn.Module) -> Measurement:
        dev = device_of(model)
        right = [
            (getattr(out, "logits", out).argmax(-1).cpu() == labels).reshape(-1)
            for out, labels in ((model(move_to(inputs, dev)), labels) for inputs, labels in batches)
        ]
        correct = torch.cat(right).numpy().astype(np.float64) if right else np.zeros(0)
        return Measurement(float(correct.mean()) if correct.size else 0.0, correct)

    return _paired(measure, higher_is_better=True, name="accuracy")


@renamed_keywords(data="eval_data")
def output_distortion(model: torch.nn.Module, eval_data: Iterable[Any]) -> QualityMetric:
    """Default calibration metric without labels: relative squared error of the model's outputs
    against the original model's outputs on the same inputs, the batches ``eval_data`` (0 for the
    original)."""
    batches = _batches(eval_data)
    with torch.no_grad():
        reference = [_output(model, b) for b in batches]

    def fn(m: torch.nn.Module) -> float:
        num = den = 0.0
        for b, ref in zip(batches, reference):
            out = _output(m, b)
            num += float((out - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
        return num / max(den, 1e-30)

    return QualityMetric(fn, higher_is_better=False, name="output_distortion", relative=False)


def output_cosine(model: torch.nn.Module, eval_data: Iterable[Any]) -> QualityMetric:
    """The default metric of a pre-trained snapshot: the *cosine distance* of the model's outputs,
    1 minus the mean cosine similarity between the original model's output vector and the
    quantized model's at each position of the batches ``eval_data`` (at each position their
    ``attention_mask`` keeps, when they carry one; 0 for the original). A threshold of 0.03 thus
    asks that the outputs keep a mean cosine of 0.97 with the original's."""
    batches = _batches(eval_data)
    with torch.no_grad():
        reference = [_output(model, b) for b in batches]
    keep = [_kept_positions(b, ref) for b, ref in zip(batches, reference)]

    def fn(m: torch.nn.Module) -> float:
        total = count = 0.0
        for b, ref, kept in zip(batches, reference, keep):
            cos = torch.nn.functional.cosine_similarity(_output(m, b)[kept], ref[kept], dim=-1)
            total, count = total + float(cos.sum()), count + cos.numel()
        return 1.0 - total / max(count, 1.0)

    return QualityMetric(fn, higher_is_better=False, name="output_cosine_distance", relative=False)


def _kept_positions(batch: Any, output: torch.Tensor) -> Any:
    """The positions of ``output`` (``batch x length x features``) its batch's attention mask
    keeps, as an index; every position without one."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(output.shape[:-1]):
        return mask.bool().cpu()
    return (...,)


def _output(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    dev = device_of(model)
    out = model(**move_to(batch, dev)) if isinstance(batch, Mapping) else model(move_to(batch, dev))
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr).float().cpu()
    return (out[0] if isinstance(out, (tuple, list)) else out).float().cpu()


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def move_to(batch: Any, device: torch.device) -> Any:
    """A batch (tensors nested in dicts, lists and tuples) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch
