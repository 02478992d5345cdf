"""The benchmark harness's own logic (benchmarks/_runs.py): where the restores fall and how
``--callback`` settings are read, so a full benchmark run does not fail (or silently measure
the wrong thing) after many minutes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _runs  # noqa: E402


def test_restore_points_spread_over_the_run():
    assert _runs.restore_points(1200, 100, 10) == [100, 200, 300, 400, 500, 700, 800, 900, 1000, 1100]
    assert _runs.restore_points(96, 8, 3) == [8, 48, 88]
    assert _runs.restore_points(40, 10, 10) == [10, 20, 30]  # never after the last checkpoint


def test_callback_settings_parsed_and_checked():
    assert _runs.callback_settings("threshold=0.02 eval_batches=8 background=False delta_coding=rle") == {
        "threshold": 0.02,
        "eval_batches": 8,
        "background": False,
        "delta_coding": "rle",
    }
    assert _runs.callback_settings("") == {}
    with pytest.raises(SystemExit, match="takes no 'no_such_setting'"):
        _runs.callback_settings("no_such_setting=1")
    with pytest.raises(SystemExit, match="not key=value"):
        _runs.callback_settings("threshold")
