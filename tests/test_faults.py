"""The fault suite (issue 14): damaged files, processes killed mid-save, a full disk.

* Fuzz: byte flips and truncations of keyframes, delta entries, optimizer trees and compressed
  model folders. Each trial loads a damaged copy in a worker process (tests/fault_worker.py)
  and is classified as a clear error (a DynaQuantError), another exception, silently wrong data
  (it loads and differs from the clean decode) or a hang (no answer within the timeout: the
  worker is killed and restarted). Only clear errors may happen; a damaged byte that changes
  nothing that is decoded (``unchanged``) is counted too. The counts are printed (``-s``) and
  recorded in benchmarks/RESULTS.md ("Reliability").
* kill -9: a process writing checkpoints in a loop is killed at random times, again and again;
  after every kill each checkpoint written before must load bit-identical.
* Disk full: saves into a small tmpfs fail with a clear error, cost no earlier checkpoint, and the
  store works again once there is room.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_worker import digest  # tests/ is on sys.path (rootdir conftest)

from hf_dynaquant import CheckpointStore, Compressor, QuantConfig
from hf_dynaquant.errors import DynaQuantError, StoreWriteError
from hf_dynaquant.store.manifest import MANIFEST
from hf_dynaquant.training.compressor import read_checkpoint

WORKER = Path(__file__).with_name("fault_worker.py")
TRIAL_TIMEOUT = 60.0  # seconds without an answer before a trial counts as a hang
_PATH = [str(WORKER.parents[1]), str(WORKER.parent), os.environ.get("PYTHONPATH", "")]
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in _PATH if p)}


# -- the fuzz harness ------------------------------------------------------------------------------


def _start(kind: str, clean: Path, refs: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "load", kind, str(clean), *refs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    assert json.loads(_readline(proc, 300.0) or "{}").get("ready"), "the fuzz worker did not start"
    return proc


def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


def run_trials(kind: str, clean: Path, refs: list[str], trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each trial's outcome (``clear``, ``other``, ``silent``, ``unchanged`` or ``hang``)."""
    results: list[dict[str, Any]] = []
    proc = _start(kind, clean, refs)
    try:
        for trial in trials:
            proc.stdin.write(json.dumps(trial) + "\n")
            proc.stdin.flush()
            line = _readline(proc, TRIAL_TIMEOUT)
            if line:
                results.append({**trial, **json.loads(line)})
                continue
            results.append({**trial, "outcome": "hang", "detail": f"no answer in {TRIAL_TIMEOUT:.0f} s"})
            proc.kill()
            proc.wait()
            proc = _start(kind, clean, refs)
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    return results


def _payload_regions(payload: Path) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of a payload file: its header, and the blobs of each section."""
    data = payload.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    regions: dict[str, list[tuple[int, int]]] = {"header": [(0, 8 + header_len)]}
    for key, info in json.loads(data[8 : 8 + header_len]).items():
        if key != "__metadata__":
            start, end = info["data_offsets"]
            if end > start:
                regions.setdefault(key.split("/")[0], []).append((8 + header_len + start, 8 + header_len + end))
    return regions


def _flips(rng: random.Random, rel: str, ranges: list[tuple[int, int]], n: int, region: str) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        start, end = rng.choice(ranges)
        offset, mask = rng.randrange(start, end), 1 << rng.randrange(8)
        out.append({"file": rel, "region": region, "op": "flip", "offset": offset, "mask": mask})
    return out


def _truncations(rng: random.Random, root: Path, rel: str, n: int, region: str) -> list[dict[str, Any]]:
    size = (root / rel).stat().st_size
    lengths = {0, size - 1} | {rng.randrange(size) for _ in range(max(0, n - 2))}
    return [{"file": rel, "region": region, "op": "truncate", "length": n} for n in sorted(lengths)[:n]]


def entry_trials(rng: random.Random, root: Path, store_rel: str, eid: str, label: str, n: int) -> list[dict[str, Any]]:
    """Flips in each section's blobs, in the payload header and in the manifest, and
    truncations of both files, of one entry."""
    entry = f"{store_rel}/entries/{eid}" if store_rel else f"entries/{eid}"
    regions = _payload_regions(root / entry / "payload.safetensors")
    trials = []
    for region, ranges in regions.items():
        trials += _flips(rng, f"{entry}/payload.safetensors", ranges, n, f"{label} {region}")
    size = (root / entry / MANIFEST).stat().st_size
    trials += _flips(rng, f"{entry}/{MANIFEST}", [(0, size)], n, f"{label} manifest")
    trials += _truncations(rng, root, f"{entry}/payload.safetensors", 4, f"{label} payload truncated")
    trials += _truncations(rng, root, f"{entry}/{MANIFEST}", 4, f"{label} manifest truncated")
    return trials


def store_file_trials(rng: random.Random, root: Path, store_rel: str, ref: str, n: int) -> list[dict[str, Any]]:
    trials = []
    for rel, region in (("store.json", "store marker"), (f"refs/{ref}.json", "reference")):
        rel = f"{store_rel}/{rel}" if store_rel else rel
        trials += _flips(rng, rel, [(0, (root / rel).stat().st_size)], n, region)
        trials += _truncations(rng, root, rel, 3, f"{region} truncated")
    return trials


def summarize(name: str, results: list[dict[str, Any]]) -> Counter:
    counts = Counter(r["outcome"] for r in results)
    by_region: dict[str, Counter] = {}
    for r in results:
        by_region.setdefault(r["region"], Counter())[r["outcome"]] += 1
    print(f"\n[faults] {name}: {len(results)} trials: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for region, c in sorted(by_region.items()):
        print(f"[faults]   {region:<32} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return counts


def assert_only_clear(results: list[dict[str, Any]]) -> None:
    bad = [r for r in results if r["outcome"] not in ("clear", "unchanged")]
    assert not bad, "\n".join(f"{r['region']} {r['op']} {r}" for r in bad[:10])
    unchanged = [r for r in results if r["outcome"] == "unchanged"]
    assert len(unchanged) <= len(results) // 20, unchanged[:5]  # damage is found, not ignored


# -- fuzz: training checkpoints (keyframe, delta, optimizer trees) --------------------------------


def _train_store(path: Path) -> CheckpointStore:
    """A store with a keyframe and a delta on it, each with AdamW state compressed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comp = Compressor(model, path, QuantConfig(bins=16), optimizer=opt, optimizer_state="compress")
    for step in (1, 2):
        for _ in range(3):
            x = torch.randn(16, 64)
            (model(x) - x).pow(2).mean().backward()
            comp.on_backward_pass_end()
            opt.step()
            comp.before_gradient_flush()
            opt.zero_grad()
        comp.compress(step)
    return comp.store


@pytest.mark.slow
def test_fuzz_training_checkpoints(tmp_path: Path) -> None:
    store = _train_store(tmp_path / "clean")
    keyframe, delta = store.resolve("step-1"), store.resolve("step-2")
    assert store.info("step-2").base == keyframe and "optimizer" in store.open("step-2").trees
    rng = random.Random(14)
    trials = entry_trials(rng, store.path, "", keyframe, "keyframe", 14)
    trials += entry_trials(rng, store.path, "", delta, "delta", 14)
    trials += store_file_trials(rng, store.path, "", "step-2", 8)
    results = run_trials("checkpoint", store.path, ["step-1", "step-2"], trials)
    counts = summarize("training checkpoints (keyframe + delta, AdamW state compressed)", results)
    assert {r["region"] for r in results} >= {"keyframe optimizer", "delta optimizer", "keyframe model", "delta model"}
    assert counts["clear"] >= 0.95 * len(results)
    assert_only_clear(results)


# -- fuzz: compressed model folders (pre-trained snapshots) ----------------------------------------


@pytest.mark.slow
def test_fuzz_compressed_model_folder(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    from hf_dynaquant.pretrained.folder import compress_folder

    torch.manual_seed(0)
    src = tmp_path / "tiny-bert"
    config = BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    BertModel(config).save_pretrained(str(src))
    out = compress_folder(src, tmp_path / "packed", codec="dynaquant", config=QuantConfig(bins=8), progress=False)
    rng = random.Random(15)
    trials = entry_trials(rng, out.path, "dynaquant", out.entry, "snapshot", 20)
    trials += store_file_trials(rng, out.path, "dynaquant", "model", 8)
    results = run_trials("folder", out.path, [], trials)
    counts = summarize("compressed model folder (dynaquant codec, tiny BERT)", results)
    assert counts["clear"] >= 0.95 * len(results)
    assert_only_clear(results)


# -- kill -9 at random points of a save loop -------------------------------------------------------


@pytest.mark.slow
def test_sigkill_at_random_points_of_a_save_loop(tmp_path: Path) -> None:
    path = tmp_path / "store"
    recorded: dict[str, str] = {}  # ref -> digest of its decode, as first seen
    rng = random.Random(9)
    kills = mid_save = 0
    last = None
    for round_ in range(8):
        args = [sys.executable, str(WORKER), "save", str(path), f"r{round_}"] + ([last] if last else [])
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=_ENV)
        assert _readline(proc, 300.0).strip() == "ready"
        durations = [0.5]
        for _ in range(rng.randrange(3)):  # let it write 0-2 checkpoints ...
            started = time.perf_counter()
            assert _readline(proc, 300.0).startswith("writing")
            _, ref, dig = _readline(proc, 300.0).split()
            recorded[ref], durations = dig, [time.perf_counter() - started]
        assert _readline(proc, 300.0).startswith("writing")
        time.sleep(rng.uniform(0.0, 1.2 * durations[-1]))  # ... then kill it at a random point of the next save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        for line in proc.stdout.read().splitlines():
            if line.startswith("saved"):
                _, ref, dig = line.split()
                recorded.setdefault(ref, dig)
        store = CheckpointStore(path, create=False)
        refs = {r for r in store.refs() if r.startswith("r")}
        for ref in sorted(refs):  # every earlier checkpoint: bit-identical to when it was written
            got = digest(read_checkpoint(store, ref)[:2])
            assert recorded.setdefault(ref, got) == got, f"checkpoint {ref} changed after kill {kills}"
        assert set(recorded) == refs, "a checkpoint reported saved is missing"
        problems = store.verify()
        assert all("leftover of an interrupted write" in p for p in problems), problems
        mid_save += bool(problems)
        last = max(refs, key=lambda r: (int(r[1:].split("-")[0]), int(r.split("-")[1])), default=last)
    store.gc()
    assert store.verify() == [] and not list((path / "entries").glob(".tmp-*"))
    print(
        f"\n[faults] kill -9: {kills} kills ({mid_save} mid-save, leaving a temporary entry), "
        f"{len(recorded)} checkpoints, all bit-identical after every kill"
    )
    assert len(recorded) >= 3  # (a kill in the middle of a write, for certain: tests/test_integrity.py)


# -- disk full ---------------------------------------------------------------------------------------


def _tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0:
        return False
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    return subprocess.run(mount, capture_output=True).returncode == 0


_FILL_UNTIL_FULL = """
import resource, signal, sys, torch
sys.path.insert(0, sys.argv[3])
from fault_worker import digest
from hf_dynaquant import CheckpointStore
from hf_dynaquant.training.compressor import read_checkpoint
from hf_dynaquant.errors import StoreWriteError
if sys.argv[2] != "tmpfs":  # no tmpfs to fill: the kernel's file-size limit gives a real EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
store = CheckpointStore(sys.argv[1])
torch.manual_seed(0)
for i in range(100):
    try:
        store.write({"model": {"w": torch.randn(60_000 * (i + 1))}}, ref=f"c{i}")
    except StoreWriteError as exc:
        print("FAILED", exc.errno, str(exc).replace(chr(10), " "), flush=True)
        break
    print("saved", f"c{i}", flush=True)
"""


@pytest.mark.slow
def test_disk_full_fails_clearly_and_loses_nothing(tmp_path: Path) -> None:
    mount = tmp_path / "small-disk"
    tmpfs = _tmpfs(mount, "4m")
    try:
        # tmpfs: a real full file system (ENOSPC). Without the right to mount one (not root),
        # the kernel's per-process file-size limit (EFBIG) stands in: also a real failed write.
        limit = "tmpfs" if tmpfs else str(1_500_000)
        run = subprocess.run(
            [sys.executable, "-c", _FILL_UNTIL_FULL, str(mount / "store"), limit, str(WORKER.parent)],
            capture_output=True,
            text=True,
            env=_ENV,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        lines = run.stdout.splitlines()
        failed = [line for line in lines if line.startswith("FAILED")]
        saved = [line.split()[1] for line in lines if line.startswith("saved")]
        assert failed and saved, run.stdout
        code = int(failed[0].split()[1])
        assert code == (28 if tmpfs else 27), failed[0]  # ENOSPC / EFBIG
        assert "cannot write" in failed[0] and "earlier ones are intact" in failed[0] and str(mount) in failed[0]
        print(f"\n[faults] disk full ({'tmpfs ENOSPC' if tmpfs else 'RLIMIT_FSIZE EFBIG'}): {failed[0]}")

        store = CheckpointStore(mount / "store", create=False)
        assert sorted(store.refs()) == sorted(saved)  # nothing lost, nothing half-written visible
        assert store.verify(deep=True) == [] and not list((store.path / "entries").glob(".tmp-*"))
        torch.manual_seed(0)
        for i, ref in enumerate(saved):  # bit-identical to what was written
            assert torch.equal(store.open(ref).tensor("model", "w"), torch.randn(60_000 * (i + 1)))
        for ref in saved[:-1]:  # make room: the store works again
            store.delete_ref(ref)
        store.gc()
        store.write({"model": {"w": torch.ones(1000)}}, ref="after")
        assert store.verify() == [] and torch.equal(store.open("after").tensor("model", "w"), torch.ones(1000))
    finally:
        if tmpfs:
            subprocess.run(["umount", str(mount)], check=True)


def test_store_write_error_is_a_dynaquant_error_and_an_os_error(tmp_path: Path) -> None:
    """A write that the file system refuses (here: a read-only reference folder) is a
    StoreWriteError naming the store; the entry itself stays for gc."""
    store = CheckpointStore(tmp_path / "s")
    (store.path / "refs").rename(store.path / "refs-moved")
    (store.path / "refs").write_text("not a folder")
    with pytest.raises(StoreWriteError) as err:
        store.write({"model": {"w": torch.randn(10)}}, ref="x")
    assert isinstance(err.value, DynaQuantError) and isinstance(err.value, OSError)
    assert f"store {store.path} (reference 'x')" in str(err.value) and "[Errno" not in str(err.value)
