"""Damage is detected and named; a failed or killed write never costs an earlier checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_dynaquant import (
    CheckpointStore,
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingBaseError,
    UnsupportedFormatVersionError,
)
from hf_dynaquant.codecs import Codec, register_codec
from hf_dynaquant.codecs.lossless import LosslessCodec
from hf_dynaquant.store import manifest as manifest_mod


def payload(store: CheckpointStore, eid: str) -> Path:
    return store.path / "entries" / eid / "payload.safetensors"


def one_entry(store: CheckpointStore) -> str:
    return store.write({"model": {"w": torch.randn(4000), "v": torch.randn(100)}}, ref="m")


def test_flipped_byte_names_file_and_tensor(store) -> None:
    eid = one_entry(store)
    path = payload(store, eid)
    manifest = json.loads(manifest_mod.read_manifest_bytes(path.parent / manifest_mod.MANIFEST))
    info = manifest["sections"]["model"]["w"]["blobs"]["c0"]
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    offset = json.loads(data[8 : 8 + header_len])[info["key"]]["data_offsets"][0]  # where tensor w's blob starts
    data[8 + header_len + offset + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError) as err:
        store.open("m").tensor("model", "w")
    assert "payload.safetensors" in str(err.value) and "'model/w'" in str(err.value)
    assert torch.equal(store.open("m").tensor("model", "v"), store.open("m").tensor("model", "v"))  # others still read
    problems = store.verify()
    assert len(problems) == 1 and "checksum mismatch" in problems[0]


def test_truncated_payload(store) -> None:
    eid = one_entry(store)
    path = payload(store, eid)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated or damaged"):
        store.open("m").tensor("model", "w")
    assert store.verify()


def test_tampered_manifest(store) -> None:
    eid = one_entry(store)
    mpath = store.path / "entries" / eid / manifest_mod.MANIFEST
    data = manifest_mod.read_manifest_bytes(mpath)
    mpath.write_bytes(manifest_mod.pack_manifest(data.replace(b'"F32"', b'"F16"', 1)))
    with pytest.raises(CorruptCheckpointError, match="does not match its content id"):
        store.open("m")
    mpath.write_bytes(b"\x28\xb5\x2f\xfd garbage")
    with pytest.raises(CorruptCheckpointError, match="not a valid zstd frame"):
        store.open("m")


def test_missing_base(store) -> None:
    base = store.write({"model": {"w": torch.randn(50_000) * 0.02}}, ref="base")
    w2 = store.open("base").tensor("model", "w") + 1e-7
    store.write({"model": {"w": w2}}, base="base", ref="delta")
    assert store.info("delta").base == base
    import shutil

    shutil.rmtree(store.path / "entries" / base)
    with pytest.raises(MissingBaseError, match="missing: the chain is broken"):
        store.open("delta").tensor("model", "w")
    assert any("missing" in p for p in store.verify())


def test_unknown_format_version(store) -> None:
    doc = {
        "format": manifest_mod.ENTRY_FORMAT,
        "format_version": 99,
        "files": [],
        "sections": {},
        "trees": {},
        "extras": {},
        "metadata": {},
        "base": None,
    }
    data = manifest_mod.canonical_json(doc)
    eid = manifest_mod.content_id(data)
    (store.path / "entries" / eid).mkdir()
    (store.path / "entries" / eid / manifest_mod.LEGACY_MANIFEST).write_bytes(data)  # (plain JSON is read too)
    with pytest.raises(UnsupportedFormatVersionError, match="format version 99 is not supported"):
        store.open(eid)
    marker = store.path / "store.json"
    newer = {"format": manifest_mod.STORE_FORMAT, "format_version": 7}
    marker.write_bytes(manifest_mod.canonical_json({**newer, "checksum": manifest_mod._marker_checksum(newer)}))
    with pytest.raises(UnsupportedFormatVersionError, match="version 7.*upgrade"):
        CheckpointStore(store.path)


@pytest.mark.parametrize("version", [b"0", b"3", b"5", b"9", b"11"])
def test_damaged_format_version_is_damage_not_a_newer_format(store, version: bytes) -> None:
    one_entry(store)
    marker = store.path / "store.json"
    marker.write_bytes(marker.read_bytes().replace(b'"format_version":1', b'"format_version":' + version))
    with pytest.raises(CorruptCheckpointError, match="store marker is damaged") as err:
        CheckpointStore(store.path)
    assert "upgrade" not in str(err.value) and "read b'" in str(err.value)
    legacy = b'{"format":"hf_dynaquant.store","format_version":%s}'  # as written before markers had a checksum
    marker.write_bytes(legacy % version)
    with pytest.raises(CorruptCheckpointError, match="without a checksum"):
        CheckpointStore(store.path)
    marker.write_bytes(legacy % b"1")
    assert CheckpointStore(store.path).verify() == []  # an intact legacy marker still opens


def test_verify_reports_damaged_marker_and_refs(store) -> None:
    eid = one_entry(store)
    marker = store.path / "store.json"
    marker.write_bytes(marker.read_bytes()[:-5])
    (store.path / "refs" / "bad.json").write_bytes(b'{"entry":"' + eid[:20].encode() + b'zz"}')
    (store.path / "refs" / "junk.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(CorruptCheckpointError, match="store marker is damaged"):
        CheckpointStore(store.path)  # loading raises
    opened = CheckpointStore(store.path, strict=False)
    problems = opened.verify()  # verify reports
    assert len(problems) == 3, problems
    assert "store marker" in problems[0]
    assert "bad.json" in problems[1] and eid[:20] in problems[1] and "not 64 hex digits" in problems[1]
    assert "junk.json" in problems[2] and "garbage" in problems[2]
    with pytest.raises(CorruptCheckpointError, match="bad.json: damaged reference"):
        opened.refs()


@register_codec
class ExplodingCodec(Codec):
    """Fails on the third tensor, to simulate a crash in the middle of a write."""

    name = "test-exploding"

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, tensor, base=None):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom")
        return LosslessCodec().encode(tensor, base)

    def decode(self, dtype, shape, params, blobs, base=None):
        return LosslessCodec().decode(dtype, shape, params, blobs, base)


def test_failed_write_leaves_store_unchanged(store) -> None:
    eid = one_entry(store)
    with pytest.raises(RuntimeError, match="boom"):
        store.write({"model": {f"t{i}": torch.randn(10) for i in range(5)}}, codecs=ExplodingCodec(), ref="m")
    assert store.entries() == [eid] and store.refs() == {"m": eid}
    assert not list((store.path / "entries").glob(".tmp-*"))
    assert store.verify() == []


_WRITER = """
import sys, torch
from hf_dynaquant import CheckpointStore
store = CheckpointStore(sys.argv[1])
torch.manual_seed(0)
big = {f"w{i}": torch.randn(4_000_000) for i in range(40)}
print("ready", flush=True)
store.write({"model": big}, ref="m")
"""


@pytest.mark.slow
def test_killed_writer_leaves_earlier_checkpoint_intact(store) -> None:
    eid = one_entry(store)
    before = store.open("m").load_section("model")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(store.path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.time() + 120
    while not list((store.path / "entries").glob(".tmp-*/payload.safetensors")) and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert store.entries() == [eid] and store.refs() == {"m": eid}  # no partial entry is visible
    after = store.open("m").load_section("model")
    assert all(torch.equal(before[k], after[k]) for k in before)
    problems = store.verify()
    assert len(problems) == 1 and "leftover of an interrupted write" in problems[0], problems
    store.gc()
    assert not list((store.path / "entries").glob(".tmp-*")) and store.verify() == []


# A writer that stops in the middle of an entry (after two tensors) and waits to be killed: a
# real process holding a real half-written temporary entry, at a known point.
_PAUSED_WRITER = """
import sys, time, torch
from collections.abc import Mapping
from hf_dynaquant import CheckpointStore

class Paused(Mapping):
    def __init__(self):
        self.t = {f"w{i}": torch.randn(200_000) for i in range(5)}
    def __getitem__(self, k):
        if k == "w2":
            print("mid-write", flush=True)
            time.sleep(600)
        return self.t[k]
    def __iter__(self):
        return iter(self.t)
    def __len__(self):
        return len(self.t)
    def numels(self):
        return {k: t.numel() for k, t in self.t.items()}

CheckpointStore(sys.argv[1]).write({"model": Paused()}, ref="paused")
"""


def _start_paused(*args: str, script: str = _PAUSED_WRITER) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "mid-write"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_leftovers_of_a_killed_writer_are_reported_and_removed_but_a_live_writers_never(store) -> None:
    eid = one_entry(store)
    live = _start_paused(str(store.path))
    try:
        (tmp,) = (store.path / "entries").glob(".tmp-*")
        assert f"-{live.pid}-" in tmp.name and (tmp / "payload.safetensors").exists()
        # a live writer's folder: not reported, not collected, not removed by another write
        assert store.verify() == [] and store.leftovers() == []
        store.gc()
        second = store.write({"model": {"x": torch.randn(10)}}, ref="other")
        assert tmp.is_dir() and store.verify() == []
    finally:
        _kill(live)
    # now its writer is dead: reported with its size, and the next write removes it
    problems = store.verify()
    assert len(problems) == 1 and "leftover of an interrupted write" in problems[0] and tmp.name in problems[0]
    assert store.leftovers() == [tmp] and store.verify(leftovers=False) == []  # no damage to any entry
    store.write({"model": {"x": torch.randn(10)}}, ref="third")
    assert not tmp.exists() and store.verify() == []
    assert sorted(store.refs()) == ["m", "other", "third"] and store.refs()["m"] == eid and second in store.entries()


def test_leftover_without_lock_is_judged_by_its_pid(store) -> None:
    """The instant between a writer's mkdir and its lock, or an older version's folder."""
    from hf_dynaquant.store import atomic

    mine = store.path / "entries" / f".tmp-{atomic._HOST}-{os.getpid()}-{'a' * 12}"
    mine.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = store.path / "entries" / f".tmp-{atomic._HOST}-{int(gone.stdout)}-{'b' * 12}"
    dead.mkdir()
    legacy = store.path / "entries" / f".tmp-{'c' * 32}"
    legacy.mkdir()
    assert store.leftovers() == [dead]  # ours is alive; the legacy one is younger than an hour
    old = time.time() - 2 * atomic.STALE_SECONDS
    os.utime(legacy, (old, old))
    store.gc()
    assert mine.is_dir() and not dead.exists() and not legacy.exists()


_PAUSED_COMPRESS = """
import sys, time
from hf_dynaquant.pretrained import folder

get = folder._SafetensorsTensors.__getitem__
def paused(self, key, calls=[]):
    calls.append(key)
    if len(calls) == 2:
        print("mid-write", flush=True)
        time.sleep(600)
    return get(self, key)
folder._SafetensorsTensors.__getitem__ = paused
folder.compress_folder(sys.argv[1], sys.argv[2], progress=False, overwrite=True)
"""


def test_killed_compress_leftover_is_removed_by_the_next_compress(tmp_path) -> None:
    from safetensors.torch import save_file

    from hf_dynaquant.pretrained.folder import compress_folder

    src = tmp_path / "w.safetensors"
    save_file({f"t{i}": torch.randn(50_000) for i in range(4)}, str(src))
    dst = tmp_path / "out"
    unrelated = tmp_path / f".tmp-{'d' * 8}-elsewhere"  # another destination's: never ours to touch
    unrelated.mkdir()
    for _ in range(2):  # each run removes the one before's leftover
        _kill(_start_paused(str(src), str(dst), script=_PAUSED_COMPRESS))
        assert len(list(tmp_path.glob(".tmp-*-out"))) == 1 and not dst.exists()
    live = _start_paused(str(src), str(dst), script=_PAUSED_COMPRESS)
    try:
        compress_folder(src, dst, progress=False)
        (left,) = tmp_path.glob(".tmp-*-out")  # the dead runs' are gone, the live run's stays
        assert f"-{live.pid}-" in left.name and (dst / "dynaquant" / "store.json").exists()
    finally:
        _kill(live)
    compress_folder(src, dst, progress=False, overwrite=True)
    assert not list(tmp_path.glob(".tmp-*-out")) and unrelated.is_dir()
