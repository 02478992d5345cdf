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


@pytest.mark.slow
def test_gpu_bench_runs_every_arm_on_a_toy_model(tmp_path):
    """``bench_gpu.py`` (run on a lent GPU, whose time is short) end to end at toy size on the
    CPU: each arm in its own process, the stalls, the DCP writes and the decoded checkpoint."""
    import json
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"
    out = tmp_path / "gpu.json"
    argv = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--batch", "4", "--steps", "20",
            "--save-steps", "10", "--eval-blocks", "8", "--json", str(out), "--plot", str(tmp_path / "gpu.png")]
    done = subprocess.run([sys.executable, str(bench), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["arm"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"plain", "dynaquant", "dcp"}, done.stdout[-3000:]
    assert all(len(r["stalls"]) == 2 and sorted(r["eval_at_save"]) == ["10", "20"] for r in results.values())
    assert results["plain"]["weights_bytes"] > 0 and len(results["dcp"]["background"]) == 2
    dq = results["dynaquant"]
    assert dq["compressed_steps"] and dq["decoded_step"] in dq["compressed_steps"] and dq["total_bytes"] > 0
    assert "| dynaquant |" in done.stdout and (tmp_path / "gpu.png").is_file()
    # every step timed; the steps beside a background save marked, for the arms that save in the background
    assert all(len(r["step_seconds"]) == 20 for r in results.values())
    assert len(dq["busy_steps"]) == 20 and len(results["dcp"]["busy_steps"]) == 20
    # on the CPU nothing is staged on a device, so no snapshot moves; the gradient window is reported
    assert dq["settle_seconds"] == [] and dq["ema_steps"] == 50 and "in the gradient window / not" in done.stdout


def test_settle_bench_runs_every_variant(tmp_path):
    """``bench_settle.py`` (for a lent GPU, whose time is short) end to end at toy size on the
    CPU: every variant timed and checked against the tensors it copies, the table and the plot."""
    import json
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_settle.py"
    out = tmp_path / "settle.json"
    argv = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--rounds", "2", "--json", str(out),
            "--plot", str(tmp_path / "settle.png")]
    done = subprocess.run([sys.executable, str(bench), *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seconds = json.loads(out.read_text())["seconds"]
    assert set(seconds) == {"to_cpu", "prefault", "reused", "pinned", "threads"}
    assert all(len(s) == 2 for s in seconds.values()) and (tmp_path / "settle.png").is_file()
    assert "| to_cpu |" in done.stdout


@pytest.mark.slow
def test_chain_bench_restores_every_entry_of_its_chain(tmp_path):
    """``bench_chain.py`` end to end at its smallest size, with ``--restore-depth 2``: a keyframe,
    two deltas each on the entry before, then an anchor on the keyframe; each entry restored (the
    deltas it replays in its row), and the ``keyframe_every`` trade derived from them."""
    import json
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chain.py"
    out = tmp_path / "chain.json"
    argv = ["--size", "7M", "--entries", "4", "--restore-depth", "2", "--json", str(out)]
    argv += ["--plot", str(tmp_path / "chain.png")]
    done = subprocess.run([sys.executable, str(bench), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert len(r["restore"]) == len(r["stored_mb"]) == len(r["peak"]) == 4 and r["torch_load"] > 0
    assert r["stored_mb"][0] > r["stored_mb"][1] > 0  # a keyframe, then a delta smaller than it
    assert r["depth"] == [0, 1, 2, 1] and r["restore_depth"] == 2
    assert "| 2 | 2 |" in done.stdout and "| 3 | 1 |" in done.stdout
    assert "| 4 | " in done.stdout.split("keyframe_every")[-1]
    assert (tmp_path / "chain.png").is_file()


def test_chain_trade_reads_a_chain_of_k_as_its_first_k_entries():
    """``bench_chain.trade``: for each ``keyframe_every`` K, the mean bytes and mean and slowest
    restore of the measured chain's first K entries."""
    import bench_chain

    r = {"stored_mb": [90.0, 30.0, 20.0, 20.0], "restore": [1.0, 2.0, 4.0, 3.0]}
    assert bench_chain.trade(r) == [
        (1, 90.0, 1.0, 1.0),
        (2, 60.0, 1.5, 2.0),
        (3, 140 / 3, 7 / 3, 4.0),
        (4, 40.0, 2.5, 4.0),
    ]


def test_gpu_session_script_names_what_exists():
    """``benchmarks/gpu_session.sh`` (one call of a lent GPU, whose time is short: a slip costs
    the call) parses, names test files that exist, and passes each benchmark only options it
    takes (an option's name checked against the benchmark's ``--help``)."""
    import re
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "gpu_session.sh"
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(script)], capture_output=True, text=True).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    tests = re.findall(r"tests/test_\w+\.py", text)
    assert tests and all((root / t).is_file() for t in tests)
    runs = re.findall(r"python3 (benchmarks/\w+\.py)([^|\n]*)", text)
    assert {b for b, _ in runs} == {"benchmarks/bench_settle.py", "benchmarks/bench_gpu.py"}
    for bench, args in runs:
        usage = subprocess.run([sys.executable, str(root / bench), "--help"], capture_output=True, text=True)
        assert usage.returncode == 0, usage.stderr[-2000:]
        for option in re.findall(r"(--[a-z][a-z-]*)", args):
            assert option in usage.stdout, f"{bench} takes no {option}"
