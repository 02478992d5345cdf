"""The fine-tune check (issue 19): fine-tuning from the original and from a snapshot with the same
seeds, paired by seed, and the model card that states it. Real MiniLM, real transformers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoModel

import hf_dynaquant
from hf_dynaquant import FineTuneCheck, QuantConfig, topic_classification
from hf_dynaquant.errors import DynaQuantError, InvalidSettingError, UnsupportedSetupError
from hf_dynaquant.integrations.hub import _card_fine_tune
from hf_dynaquant.pretrained.transfer import FineTuneResult, paired_interval, run_fine_tune_check

FIXED = QuantConfig(bins=8, prune=0.2, protect=0.0005, embedding_bins=3, sigma=1.0)


def _embedding_mean(folder: Path, seed: int) -> float:
    """A stand-in for a fine-tune that needs no training: a figure of the weights as loaded from
    ``folder`` (so the two arms differ, and the snapshot's figure shows which weights it saw)."""
    model = AutoModel.from_pretrained(str(folder))
    return float(model.embeddings.word_embeddings.weight[seed].detach().abs().mean())


def test_topic_fine_tune_is_deterministic_and_keeps_the_callers_random_state(minilm_dir: Path) -> None:
    check = topic_classification(seeds=(0, 1), splits=(4, 1, 5), epochs=1)
    assert "30 train / 30 test" in check.task and check.metric == "accuracy"
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = check.fine_tune(minilm_dir, 3)
    assert torch.equal(torch.get_rng_state(), state)  # forked: the caller's generator is untouched
    assert check.fine_tune(minilm_dir, 3) == first
    assert 0 <= first <= 1 and math.isclose(first * 30, round(first * 30), abs_tol=1e-4)  # a count of 30


def test_paired_interval_is_the_t_interval() -> None:
    diffs = [0.01, -0.02, 0.005, 0.0, 0.03, -0.01]
    mean, half = paired_interval(diffs)
    lo, hi = stats.t.interval(0.95, len(diffs) - 1, loc=mean, scale=stats.sem(diffs))
    assert mean == pytest.approx(sum(diffs) / len(diffs)) and half == pytest.approx((hi - lo) / 2)
    assert paired_interval([0.5]) == (0.5, math.inf)
    with pytest.raises(InvalidSettingError):
        paired_interval([])


def test_the_arms_are_paired_by_seed(tmp_path: Path) -> None:
    ran = []

    def fine_tune(folder: Path, seed: int) -> float:
        ran.append((folder.name, seed))
        return {"orig": 0.50, "snap": 0.40}[folder.name] + seed / 100

    check = FineTuneCheck(fine_tune, task="toy", seeds=(1, 2, 4))
    result = run_fine_tune_check(tmp_path / "orig", tmp_path / "snap", check, progress=False)
    assert ran == [("snap", 1), ("orig", 1), ("snap", 2), ("orig", 2), ("snap", 4), ("orig", 4)]  # snapshot first
    assert result.original == pytest.approx((0.51, 0.52, 0.54)) and result.snapshot == pytest.approx((0.41, 0.42, 0.44))
    assert result.difference == pytest.approx(-0.1) and result.interval == pytest.approx(0, abs=1e-12)
    assert result.summary("original") == pytest.approx((0.5233333, 0.0152753), rel=1e-5)
    with pytest.raises(InvalidSettingError, match="not one of"):
        result.summary("nf4")
    with pytest.raises(InvalidSettingError, match="the same number"):
        FineTuneResult("toy", "accuracy", (1, 2, 3), (0.5, 0.5, 0.5), (0.5, 0.5))


def test_card_prints_an_accuracy_in_percent_and_points() -> None:
    result = FineTuneResult("toy", "accuracy", (0, 1, 2), (0.76, 0.77, 0.75), (0.765, 0.77, 0.751))
    figures = _card_fine_tune(result)
    assert figures["original"] == "76.00 ± 1.00%" and figures["snapshot"] == "76.20 ± 0.98%"
    assert figures["difference"] == f"+0.20 ± {100 * result.interval:.2f} points" and figures["seeds"] == 3


def test_card_states_the_fine_tune_measured_on_the_finished_snapshot(minilm_dir: Path, tmp_path: Path) -> None:
    check = FineTuneCheck(_embedding_mean, task="embedding rows", metric="mean |weight|", seeds=(5, 6, 7))
    snap = hf_dynaquant.compress_pretrained(
        minilm_dir, tmp_path / "s", threshold=None, config=FIXED, fine_tune=check, progress=False
    )
    result = snap.fine_tune
    assert result is not None and result.seeds == (5, 6, 7)
    assert result.original == tuple(_embedding_mean(minilm_dir, s) for s in (5, 6, 7))
    assert result.snapshot == tuple(_embedding_mean(snap.path, s) for s in (5, 6, 7))  # the published weights
    assert result.snapshot != result.original
    card = (snap.path / "README.md").read_text()
    mean, std = result.summary("snapshot")
    assert "same 3 seeds" in card and "Task: embedding rows. Metric: mean |weight|," in card
    assert f"this snapshot: **{mean:.4g} ± {std:.4g}**" in card
    assert f"**{result.difference:+.4g} ± {result.interval:.4g}**" in card
    assert "not measured" not in card


def test_a_failing_fine_tune_names_arm_and_seed_and_publishes_nothing(minilm_dir: Path, tmp_path: Path) -> None:
    def broken(folder: Path, seed: int) -> float:
        if seed == 1:
            raise RuntimeError("out of patience")
        return 0.5

    out = tmp_path / "s"
    with pytest.raises(DynaQuantError, match=r"'flaky', snapshot .* seed 1: RuntimeError: out of patience"):
        hf_dynaquant.compress_pretrained(
            minilm_dir, out, threshold=None, config=FIXED, progress=False,
            fine_tune=FineTuneCheck(broken, task="flaky", seeds=(0, 1)),
        )  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    "value, metric, message",
    [
        (float("nan"), "loss", "returned nan, not a finite loss"),
        ("0.9", "accuracy", "returned '0.9', not an accuracy in"),
        (76.5, "accuracy", r"returned 76.5, not an accuracy in \[0, 1\]"),
        (True, "accuracy", "returned True"),
    ],
)
def test_a_metric_that_is_no_number_is_refused(tmp_path: Path, value: object, metric: str, message: str) -> None:
    check = FineTuneCheck(lambda folder, seed: value, task="odd", metric=metric, seeds=(0, 1))
    with pytest.raises(DynaQuantError, match=r"'odd', snapshot \(.*\), seed 0: the fine-tune " + message):
        run_fine_tune_check(tmp_path, tmp_path, check, progress=False)


def test_numbers_of_other_types_are_taken(tmp_path: Path) -> None:
    values = iter([np.float32(0.5), torch.tensor(0.25), 1, np.float64(0.75)])
    check = FineTuneCheck(lambda folder, seed: next(values), task="types", seeds=(0, 1))
    result = run_fine_tune_check(tmp_path, tmp_path, check, progress=False)
    assert result.snapshot == (0.5, 1.0) and result.original == (0.25, 0.75)


def test_our_errors_keep_their_class_and_gain_the_arm_and_seed(tmp_path: Path) -> None:
    def refused(folder: Path, seed: int) -> float:
        raise UnsupportedSetupError("transformers 9.0 is not tested")

    check = FineTuneCheck(refused, task="load", seeds=(3, 4))
    with pytest.raises(UnsupportedSetupError, match=r"'load', snapshot \(.*\), seed 3: transformers 9.0"):
        run_fine_tune_check(tmp_path / "o", tmp_path / "s", check, progress=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seeds": (0,)}, "two or more distinct seeds"),
        ({"seeds": (1, 1)}, "two or more distinct seeds"),
        ({"fine_tune": 3}, "must be callable"),
        ({"seeds": (0.5, 1.5)}, "seeds are integers"),
    ],
)
def test_check_settings_are_checked(kwargs: dict, message: str) -> None:
    settings = {"fine_tune": _embedding_mean, "task": "t", **kwargs}
    with pytest.raises(InvalidSettingError, match=message):
        FineTuneCheck(**settings)
    assert FineTuneCheck(_embedding_mean, task="t", seeds=range(3)).seeds == (0, 1, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"splits": (0, 1, 5)}, "train and test at least 1"), ({"splits": (900, 0, 5)}, "fewer than"),
     ({"epochs": 0}, "at least 1 epoch"), ({"lr": 0.0}, "lr > 0")],
)  # fmt: skip
def test_topic_task_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidSettingError, match=message):
        topic_classification(**kwargs)
