"""The fine-tune check: does fine-tuning from a compressed snapshot land where fine-tuning from
the original does?

A snapshot is published as a starting point for transfer learning, so the figure its users need
is their own task's metric after fine-tuning, not only how close the embeddings stay. The check
fine-tunes the original and the snapshot with the same seeds, data and hyper-parameters (a
:class:`FineTuneCheck`: the user's fine-tune, ``(model folder, seed) -> metric``), and pairs the
two arms by seed: fine-tunes that share a seed share their head's initialisation and the order of
their batches (:class:`FineTuneResult`: the paired difference's mean and 95% t-interval). How
much that pairing helps depends on the task: on MiniLM's docstring topics the two arms'
accuracies correlate only weakly across seeds (0.18 over 37 seeds), so the difference is about as
noisy as either arm, and resolving 1 point took 37 seeds.

:func:`topic_classification` is a ready task that needs nothing downloaded: sentence
classification on :func:`~hf_dynaquant.pretrained.corpus.docstring_topics` for a text encoder
with a tokenizer. ``benchmarks/bench_transfer.py`` runs it over many seeds on all-MiniLM-L6-v2.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import DynaQuantError, InvalidSettingError

__all__ = ["FineTuneCheck", "FineTuneResult", "paired_interval", "run_fine_tune_check", "topic_classification"]

ARMS = ("original", "snapshot")


@dataclass(frozen=True)
class FineTuneCheck:
    """A fine-tune to run from the original and from the snapshot.

    ``fine_tune(model_dir, seed)`` fine-tunes the model in ``model_dir`` (a folder
    ``from_pretrained`` loads; the snapshot's decodes on load once hf_dynaquant is imported) and
    returns its metric on held-out data, higher is better (``metric="accuracy"``: a fraction
    in [0, 1], printed in percent). It must be deterministic for a seed, and it should seed
    everything it draws from ``seed`` so that the arms pair. It must not write into
    ``model_dir``: the snapshot's is the folder about to be published. ``task`` and ``metric``
    name them on the model card. The interval needs scipy, checked here rather than after hours
    of fine-tuning.
    """

    fine_tune: Callable[[Path, int], float]
    task: str
    metric: str = "accuracy"
    seeds: Sequence[int] = (0, 1, 2)

    def __post_init__(self) -> None:
        if not callable(self.fine_tune):
            raise InvalidSettingError(f"FineTuneCheck.fine_tune must be callable, got {type(self.fine_tune)}")
        try:
            seeds = tuple(operator.index(seed) for seed in self.seeds)
        except TypeError:
            raise InvalidSettingError(f"FineTuneCheck.seeds: {self.seeds!r}; seeds are integers") from None
        if len(seeds) < 2 or len(set(seeds)) != len(seeds):
            raise InvalidSettingError(
                f"FineTuneCheck.seeds: {seeds}; the paired interval needs two or more distinct seeds"
            )
        if importlib.util.find_spec("scipy") is None:
            raise InvalidSettingError("the fine-tune check's interval needs scipy: pip install scipy")
        object.__setattr__(self, "seeds", seeds)


@dataclass(frozen=True)
class FineTuneResult:
    """Both arms' metric by seed (same order as ``seeds``), and their paired comparison."""

    task: str
    metric: str
    seeds: tuple[int, ...]
    original: tuple[float, ...]
    snapshot: tuple[float, ...]
    difference: float = field(init=False)  # mean of snapshot - original, paired by seed
    interval: float = field(init=False)  # half-width of the difference's 95% t-interval

    def __post_init__(self) -> None:
        if not len(self.seeds) == len(self.original) == len(self.snapshot) >= 2:
            raise InvalidSettingError(
                f"FineTuneResult: {len(self.seeds)} seeds, {len(self.original)} original and "
                f"{len(self.snapshot)} snapshot results; the same number, two or more, of each"
            )
        diff, half = paired_interval([s - o for s, o in zip(self.snapshot, self.original)])
        object.__setattr__(self, "difference", diff)
        object.__setattr__(self, "interval", half)

    def summary(self, arm: str) -> tuple[float, float]:
        """Mean and standard deviation of ``arm`` (``"original"`` or ``"snapshot"``) over the seeds."""
        if arm not in ARMS:
            raise InvalidSettingError(f"FineTuneResult.summary: arm {arm!r}, not one of {ARMS}")
        values = getattr(self, arm)
        return statistics.mean(values), statistics.stdev(values)


def paired_interval(differences: Sequence[float]) -> tuple[float, float]:
    """Mean and 95% t-interval half-width of paired differences (infinite for one)."""
    n = len(differences)
    if n == 0:
        raise InvalidSettingError("a paired interval needs at least one difference")
    if n < 2:
        return float(differences[0]), math.inf
    try:
        from scipy import stats
    except ImportError:
        raise DynaQuantError("the fine-tune check's interval needs scipy: pip install scipy") from None
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return statistics.mean(differences), float(half)


def run_fine_tune_check(
    original: str | Path, snapshot: str | Path, check: FineTuneCheck, *, progress: bool = True
) -> FineTuneResult:
    """Run ``check`` from the ``original`` model folder and from the ``snapshot`` folder, seed by
    seed (the snapshot first, so that a snapshot this environment cannot load fails in its first
    minutes), and pair the two. Any failure of the user's fine-tune is a :class:`DynaQuantError`
    naming the task, arm, folder and seed (one of ours keeps its class); so is a metric that is
    not a finite number, or an accuracy outside [0, 1]."""
    from tqdm.auto import tqdm

    folders = {"original": Path(original), "snapshot": Path(snapshot)}
    results: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tqdm(total=2 * len(check.seeds), desc="fine-tune check", unit="run", disable=not progress) as bar:
        for seed in check.seeds:
            for arm in reversed(ARMS):
                bar.set_postfix_str(f"seed {seed}, {arm}")
                where = f"fine-tune check '{check.task}', {arm} ({folders[arm]}), seed {seed}"
                results[arm].append(_run_one(check, folders[arm], seed, where))
                bar.update()
    return FineTuneResult(
        check.task, check.metric, tuple(check.seeds), tuple(results["original"]), tuple(results["snapshot"])
    )


def _run_one(check: FineTuneCheck, folder: Path, seed: int, where: str) -> float:
    """One fine-tune of ``check`` from ``folder``: its metric, checked; failures say ``where``."""
    try:
        value = check.fine_tune(folder, seed)
    except DynaQuantError as exc:
        try:
            error = type(exc)(f"{where}: {exc}")
        except TypeError:  # a class of ours with other arguments: the base class, same message
            error = DynaQuantError(f"{where}: {type(exc).__name__}: {exc}")
        raise error from exc
    except Exception as exc:
        raise DynaQuantError(f"{where}: {type(exc).__name__}: {exc}") from exc
    try:
        number = math.nan if isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (check.metric == "accuracy" and not 0 <= number <= 1):
        wanted = "an accuracy in [0, 1]" if check.metric == "accuracy" else f"a finite {check.metric}"
        raise DynaQuantError(f"{where}: the fine-tune returned {value!r}, not {wanted}")
    return number


def topic_classification(
    seeds: Sequence[int] = (0, 1, 2),
    *,
    splits: tuple[int, int, int] = (240, 40, 100),
    epochs: int = 3,
    lr: float = 1e-4,
) -> FineTuneCheck:
    """A ready fine-tune check for text encoders: which of six areas of the standard library a
    docstring sentence comes from (:func:`~hf_dynaquant.pretrained.corpus.docstring_topics` with
    ``splits`` per area; trained on its train and validation sentences, scored by accuracy on its
    test sentences). ``AutoModelForSequenceClassification`` with a new head, AdamW (``lr``,
    weight decay 0.01), batches of 16 for ``epochs`` epochs, on the CPU. Caveat: a snapshot
    calibrated on docstrings (the default) sees this task's kind of text during its search."""
    from .corpus import docstring_topics

    if len(splits) != 3 or min(splits) < 0 or splits[0] < 1 or splits[2] < 1:
        raise InvalidSettingError(
            f"topic_classification: splits={splits}; (train, validation, test) per area, train and test at least 1"
        )
    if epochs < 1 or not lr > 0:
        raise InvalidSettingError(f"topic_classification: epochs={epochs}, lr={lr}; at least 1 epoch, lr > 0")
    try:
        topics = docstring_topics(tuple(splits))
    except ValueError as exc:
        raise InvalidSettingError(f"topic_classification: splits={splits}: {exc}") from None
    train = {k: topics["train"][k] + topics["validation"][k] for k in ("text", "label")}
    test = topics["test"]

    def fine_tune(model_dir: Path, seed: int) -> float:
        return _fine_tune_classifier(model_dir, train, test, len(topics["labels"]), seed, epochs=epochs, lr=lr)

    sizes = f"{len(topics['labels'])} classes, {len(train['text'])} train / {len(test['text'])} test sentences"
    task = f"docstring topics ({sizes}, {epochs} epochs)"
    return FineTuneCheck(fine_tune, task=task, metric="accuracy", seeds=seeds)


def _fine_tune_classifier(
    model_dir: str | Path, train: dict, test: dict, labels: int, seed: int, *, epochs: int, lr: float
) -> float:
    """Fine-tune a sequence classifier from ``model_dir`` on ``train`` (``{"text", "label"}``
    lists) on the CPU; its accuracy on ``test``. Everything random is drawn from ``seed``: the
    CPU generator, seeded under a fork (the caller's random state is as it was, and no other
    device's generator is touched), and a generator of its own for the batches' order."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return _fine_tune(model_dir, train, test, labels, seed, epochs=epochs, lr=lr)


def _fine_tune(
    model_dir: str | Path, train: dict, test: dict, labels: int, seed: int, *, epochs: int, lr: float
) -> float:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=labels)

    def encode(split: dict) -> tuple[dict, torch.Tensor]:
        enc = tokenizer(list(split["text"]), padding=True, truncation=True, max_length=64, return_tensors="pt")
        return enc, torch.tensor(list(split["label"]))

    (x_train, y_train), (x_test, y_test) = encode(train), encode(test)

    def rows(x: dict, idx: Any) -> dict:
        """The examples ``idx``, cut to their longest (padding is on the right): the same model
        inputs in fewer positions."""
        length = int(x["attention_mask"][idx].sum(1).max())
        return {k: v[idx, :length] for k, v in x.items()}

    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y_train), generator=gen)
        for i in range(0, len(order), 16):
            idx = order[i : i + 16]
            loss = model(**rows(x_train, idx), labels=y_train[idx]).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
    model.eval()
    with torch.no_grad():
        pred = torch.cat(
            [model(**rows(x_test, slice(i, i + 64))).logits.argmax(-1) for i in range(0, len(y_test), 64)]
        )
    return float((pred == y_test).float().mean())
