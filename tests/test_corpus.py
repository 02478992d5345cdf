"""The offline labelled task of ``hf_dynaquant.pretrained.corpus.docstring_topics`` (used by
benchmarks/bench_finetune.py): deterministic, balanced, splits disjoint."""

from __future__ import annotations

from collections import Counter

import pytest

from hf_dynaquant.pretrained.corpus import TOPICS, docstring_topics


def test_topics_deterministic_balanced_disjoint():
    built = docstring_topics.__wrapped__()  # built afresh, not the cached copy
    assert built == docstring_topics.__wrapped__()
    assert built["labels"] == list(TOPICS)
    sizes = {"train": 240, "validation": 40, "test": 100}
    texts = {}
    for split, per_label in sizes.items():
        rows = built[split]
        assert len(rows["text"]) == len(rows["label"]) == per_label * len(TOPICS)
        assert Counter(rows["label"]) == dict.fromkeys(range(len(TOPICS)), per_label)
        assert all(30 <= len(t) <= 200 for t in rows["text"])
        texts[split] = set(rows["text"])
        assert len(texts[split]) == len(rows["text"])  # no sentence twice
    assert not (texts["train"] & texts["validation"]) and not (texts["train"] & texts["test"])
    assert not (texts["validation"] & texts["test"])
    other = docstring_topics.__wrapped__(seed=1)
    assert other["test"]["text"] != built["test"]["text"]


def test_topics_refuses_more_than_available():
    with pytest.raises(ValueError, match="splits"):
        docstring_topics.__wrapped__(splits=(400, 40, 100))
