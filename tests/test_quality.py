"""The default quality test measures what the user measures (issue 15, item 2).

With the real ``transformers.Trainer`` and a small real classifier: ``compute_metrics`` /
``metric_for_best_model`` is the default test's metric (its direction respected) besides the
loss; a candidate that keeps the loss but loses accuracy fails; the standard error of a
degradation is recorded and shrinks with more examples; drawing the evaluation examples leaves
the process RNGs alone; a ``metric_for_best_model`` that ``compute_metrics`` does not return is a
clear error naming it and the keys it returns."""

from __future__ import annotations

import math
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from transformers import Seq2SeqTrainer, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput

from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.core.rng import preserved_rng
from hf_dynaquant.errors import InvalidSettingError
from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer, draw_examples
from hf_dynaquant.search import ConfigurationSearch, SearchSpace
from hf_dynaquant.training.checkpoint_dir import checkpoint_store
from hf_dynaquant.training.compressor import read_checkpoint


class Classifier(nn.Module):
    """Two classes from 2 features: ``logit = s * (cos t, sin t) . x``; the rotation ``t`` flips
    the examples near the boundary, the scale ``s`` makes the rest more confident."""

    def __init__(self, theta: float = 0.0, scale: float = 2.0, hidden: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.direction = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.direction.weight.copy_(scale * torch.tensor([[math.cos(theta), math.sin(theta)]]))
        self.mlp = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1)) if hidden else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logit = self.direction(x).squeeze(-1)
        if self.mlp is not None:
            logit = logit + self.mlp(x).squeeze(-1)
        logits = torch.stack([-logit / 2, logit / 2], -1)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def dataset(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = (x[:, 0] > 0).long()
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def accuracy(pred) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def error_rate(pred) -> dict[str, float]:
    return {"error": 1.0 - accuracy(pred)["accuracy"]}


def trainer_for(
    tmp_path, eval_n: int = 2048, compute_metrics=accuracy, key: str | None = "accuracy", greater=None, **cb
):
    args = TrainingArguments(
        str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        metric_for_best_model=key,
        greater_is_better=greater,
    )
    return DynaQuantTrainer(
        model=Classifier(hidden=cb.pop("hidden", 0)),
        args=args,
        train_dataset=dataset(256, seed=1),
        eval_dataset=dataset(eval_n, seed=2),
        compute_metrics=compute_metrics,
        callbacks=[DynaQuantCallback(**{"busy_saves": "wait", **cb})],
    )


def default_metric(trainer):
    cb = trainer.dynaquant
    with preserved_rng():
        batches = cb._default_eval_data(None)
    return cb._default_metric(batches), batches


def test_compute_metrics_is_measured_with_its_direction(tmp_path) -> None:
    trainer = trainer_for(tmp_path / "acc")
    metric, batches = default_metric(trainer)
    assert metric.name == "accuracy" and metric.higher_is_better
    assert sum(len(b["labels"]) for b in batches) == 512  # eval_examples of the 2048
    base = metric.measure(Classifier())
    assert base.value == pytest.approx(1.0)  # the rule the data follow

    err = trainer_for(tmp_path / "err", compute_metrics=error_rate, key="eval_error", greater=False)
    metric_err, _ = default_metric(err)
    assert metric_err.name == "error" and not metric_err.higher_is_better  # the Trainer's direction
    worse = Classifier(theta=0.3)
    deg = metric.compare(base, metric.measure(worse))["accuracy"][0]
    assert deg > 0.05  # fewer right: worse, relative to 1.0
    base_err = metric_err.measure(Classifier(theta=0.01))
    assert metric_err.compare(base_err, metric_err.measure(worse))["error"][0] > 0  # more errors: worse too

    loss_only = trainer_for(tmp_path / "loss", compute_metrics=None, key=None)
    assert default_metric(loss_only)[0].name == "loss"


def test_keeping_the_loss_but_losing_accuracy_fails(tmp_path) -> None:
    trainer = trainer_for(tmp_path)
    metric, _ = default_metric(trainer)
    base = metric.measure(Classifier(scale=2.0))
    measures = metric.compare(base, metric.measure(Classifier(theta=0.15, scale=2.6)))
    (acc_deg, acc_se), (loss_deg, loss_se) = measures["accuracy"], measures["loss"]
    assert loss_deg < 0 and acc_deg > 0.03  # the loss improved while accuracy fell
    assert acc_se > 0 and loss_se > 0
    search = ConfigurationSearch(metric, 0.01)
    judged = search.judge(None, measures, 1.0, None)
    assert not judged.passed and judged.degradation == acc_deg and judged.standard_error == acc_se
    # the loss alone (the test before issue 15) would have passed it
    loss_only = trainer_for(tmp_path / "loss", compute_metrics=None, key=None)
    loss_metric, _ = default_metric(loss_only)
    loss_base = loss_metric.measure(Classifier(scale=2.0))
    loss_measures = loss_metric.compare(loss_base, loss_metric.measure(Classifier(0.15, 2.6)))
    assert search.judge(None, loss_measures, 1.0, None).passed


def test_standard_error_shrinks_with_more_examples(tmp_path) -> None:
    errors = {}
    for n in (128, 1024):  # 8 and 64 batches: the loss's paired units
        trainer = trainer_for(tmp_path / str(n), eval_examples=n)
        metric, _ = default_metric(trainer)
        base = metric.measure(Classifier())
        errors[n] = metric.compare(base, metric.measure(Classifier(theta=0.1, scale=2.2)))
    for name in ("accuracy", "loss"):
        assert 0 < errors[1024][name][1] < 0.6 * errors[128][name][1], (name, errors)  # ~1/sqrt(8) = 0.35


def test_standard_error_is_recorded_in_the_search_result(tmp_path) -> None:
    config = QuantConfig(min_numel=64)
    space = SearchSpace(bins=(4, 32), prune=(0.0,), protect=(0.005,), prune_by=("magnitude",))
    trainer = trainer_for(
        tmp_path, eval_n=256, hidden=64, threshold=0.05, config=config, search_space=space, background=False
    )
    trainer.train()
    _, _, meta = read_checkpoint(checkpoint_store(tmp_path), "checkpoint-8")
    search = meta["search"]
    assert search["z"] == pytest.approx(1.645) and search["candidates"]
    for cand in search["candidates"]:
        assert set(cand["measures"]) == {"accuracy", "loss"} and cand["standard_error"] >= 0
        bound = max(d + search["z"] * se for d, se in cand["measures"].values())
        assert cand["passed"] == (bound <= 0.05)
        assert 0 < cand["weight_error"] < 1  # the decoded weights' relative L2 error, recorded
    assert search["config"] is not None and search["standard_error"] > 0 and search["weight_error"] > 0
    assert trainer.dynaquant.reports[-1]["dynaquant/standard_error"] == search["standard_error"]


def test_an_overridden_prediction_step_is_named(tmp_path) -> None:
    """The search measures compute_metrics through compute_loss, not a subclass's own
    prediction_step: the user is told, with the way out."""

    class Generating(DynaQuantTrainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    trainer = trainer_for(tmp_path)
    trainer.__class__ = Generating
    with pytest.warns(UserWarning, match=r"Generating overrides prediction_step.*pass metric="):
        default_metric(trainer)

    class Seq2Seq(DynaQuantTrainer, Seq2SeqTrainer):  # its prediction_step is Trainer's unless it generates
        pass

    trainer.__class__ = Seq2Seq
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default_metric(trainer)
    trainer.args.predict_with_generate = True
    with pytest.warns(UserWarning, match=r"Seq2Seq overrides prediction_step"):
        default_metric(trainer)


def test_a_metric_compute_metrics_does_not_return_is_named(tmp_path) -> None:
    trainer = trainer_for(tmp_path, key="f1")
    metric, _ = default_metric(trainer)
    with pytest.raises(InvalidSettingError, match=r"metric_for_best_model='f1'.*'accuracy'"):
        metric.measure(Classifier())


def test_drawing_eval_examples_touches_no_process_rng() -> None:
    data = dataset(1000)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    drawn = draw_examples(data, 512)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert len(drawn) == 512 and list(drawn.indices) == list(draw_examples(data, 512).indices)  # fixed seed
    assert sorted(drawn.indices) == list(drawn.indices)
    assert draw_examples(data[:100], 512) == data[:100]  # all of a smaller set


def test_eval_batches_is_deprecated() -> None:
    with pytest.warns(DeprecationWarning, match="eval_batches"):
        DynaQuantCallback(eval_batches=4)


def test_accuracy_helper_gives_a_paired_standard_error() -> None:
    from hf_dynaquant.search import accuracy

    data = dataset(512)
    x, y = torch.stack([r["x"] for r in data]), torch.stack([r["labels"] for r in data])
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 512, 64)]

    class Logits(nn.Module):  # accuracy() feeds inputs positionally
        def __init__(self, inner: Classifier) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).logits

    metric = accuracy(batches)
    base = metric.measure(Logits(Classifier()))
    ((deg, se),) = metric.compare(base, metric.measure(Logits(Classifier(theta=0.15)))).values()
    flips = 512 * deg  # baseline accuracy 1: every change is a loss; se = std of the 0/-1 differences / sqrt(n)
    assert deg > 0 and se == pytest.approx(math.sqrt(flips * (1 - flips / 512) / 511 / 512), rel=1e-6)
