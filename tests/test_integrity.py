"""Damage is detected and named; a failed or killed write never costs an earlier checkpoint."""

from __future__ import annotations

import json
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
