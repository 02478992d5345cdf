"""The checkpoint store: round trips, trees, extras, tied weights, chains, gc, compaction."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hf_dynaquant import CheckpointStore, EntryNotFoundError, UnsupportedTensorError
from hf_dynaquant.store.manifest import MANIFEST, read_manifest_bytes
from hf_dynaquant.store.safetensors_io import StreamingWriter
from hf_dynaquant.store.tree import DeferredTensor, flatten_tree, unflatten_tree


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)), k


def adam_after_steps(model: torch.nn.Module, steps: int = 3) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for _ in range(steps):
        model(torch.randint(0, 50, (4, 6))).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_full_checkpoint_roundtrip(store, tiny_net) -> None:
    opt = adam_after_steps(tiny_net)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    eid = store.write(
        {"model": tiny_net.state_dict()},
        trees={"optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
        extras={"rng.bin": b"\x00\x01" * 1000, "empty": b""},
        metadata={"step": 3, "loss": 0.5, "note": "héllo"},
        ref="step-3",
    )
    assert store.refs() == {"step-3": eid}
    info = store.info(eid)
    assert set(info.sections) == {"model", "optimizer"}  # the scheduler tree holds no tensors
    assert info.sections["model"][0] == sum(
        t.numel() * t.element_size() for n, t in tiny_net.state_dict().items() if n != "out.weight"
    )  # the tied weight counts once
    with store.open("step-3") as entry:
        model_sd = entry.load_section("model")
        assert_state_equal(model_sd, tiny_net.state_dict())
        assert model_sd["out.weight"] is model_sd["emb.weight"]  # tied weight stored once, shared on load
        assert entry.record("model", "out.weight")["alias_of"] == "emb.weight"
        opt_sd = entry.tree("optimizer")
        assert entry.tree("scheduler") == sched.state_dict()
        assert entry.extra("rng.bin") == b"\x00\x01" * 1000 and entry.extra("empty") == b""
        assert entry.metadata == {"step": 3, "loss": 0.5, "note": "héllo"}
    # the optimizer state loads into a fresh optimizer and matches exactly
    fresh = torch.optim.AdamW(tiny_net.parameters(), lr=1.0)
    fresh.load_state_dict(opt_sd)
    ref_sd, got = opt.state_dict(), fresh.state_dict()
    assert got["param_groups"] == ref_sd["param_groups"]
    for idx, st in ref_sd["state"].items():
        for key, val in st.items():
            assert torch.equal(got["state"][idx][key], val), (idx, key)


def test_tree_encoding_edge_cases(store) -> None:
    tree = {
        "ints": {0: torch.ones(2), 5: (1, 2.5, None)},
        "__weird": [float("nan"), float("inf"), -float("inf"), True, "s"],
        "nested": {"a/b": torch.zeros(3), "a": {"b": torch.ones(3)}},
    }
    store.write(trees={"t": tree}, ref="t")
    got = store.open("t").tree("t")
    assert torch.equal(got["ints"][0], torch.ones(2)) and got["ints"][5] == (1, 2.5, None)
    nan, inf, ninf, flag, s = got["__weird"]
    assert nan != nan and inf == float("inf") and ninf == -float("inf") and flag is True and s == "s"
    assert torch.equal(got["nested"]["a/b"], torch.zeros(3)) and torch.equal(got["nested"]["a"]["b"], torch.ones(3))


def test_tree_encoding_holds_no_reference_cycle() -> None:
    """Flattening and rebuilding a tree leave nothing that only the cyclic garbage collector
    frees: a recursive closure did, and kept a whole optimizer state's tensors (0.66x of a
    checkpoint) alive between checkpoints until a collection happened to run."""
    moment = torch.zeros(8)
    alive = weakref.ref(moment)
    gc.disable()
    try:
        skeleton, tensors = flatten_tree({"state": {0: {"exp_avg": moment, "step": 3}}, "groups": [(1, 2.0)]})
        rebuilt = unflatten_tree(skeleton, tensors.__getitem__)
        assert rebuilt["state"][0]["exp_avg"] is moment and rebuilt["groups"] == [(1, 2.0)]
        del moment, tensors, rebuilt
        assert alive() is None
    finally:
        gc.enable()


def test_deferred_tree_leaves_are_made_when_encoded_and_never_taken_for_tied(store) -> None:
    """A tree's :class:`DeferredTensor` leaves are made once each as the store encodes them
    (none before the write), and each is stored as itself: fresh tensors of one shape may reuse
    a freed one's memory, which must not make them aliases of each other. A leaf that makes
    another dtype or shape than it declared is refused, naming it."""
    values = [torch.full((300, 300), float(i)) for i in range(6)]
    made: list[int] = []

    def maker(i: int):
        def make() -> torch.Tensor:
            made.append(i)
            return values[i].clone()  # new memory each time, freed once encoded

        return make

    tree = {"state": {i: {"x": DeferredTensor((300, 300), maker(i)), "step": i} for i in range(6)}, "lr": 0.1}
    with pytest.raises(ValueError):
        store.write({"opt": {}}, trees={"opt": tree})  # (a tree and a section of one name: refused first)
    assert made == []
    store.write(trees={"opt": tree}, ref="d")
    assert made == list(range(6))
    for declared in (DeferredTensor((300, 300), maker(0), torch.float64), DeferredTensor((90000,), maker(0))):
        with pytest.raises(UnsupportedTensorError, match="opt//state/0/x: a deferred tensor declared"):
            store.write(trees={"opt": {"state": {0: {"x": declared}}}}, ref="bad")
    assert "bad" not in store.refs()
    with store.open("d") as entry:
        back = entry.tree("opt")
        assert not any("alias_of" in rec for rec in entry.manifest["sections"]["opt"].values())
    for i in range(6):
        assert torch.equal(back["state"][i]["x"], values[i]) and back["state"][i]["step"] == i
    assert back["lr"] == 0.1


def test_deferred_leaves_made_in_parts_are_filled_for_a_codec_that_reads_parts(store) -> None:
    """A :class:`DeferredTensor` with ``fill`` is never made whole for a codec that reads parts
    (DynaQuant's: the same record and codes as the whole tensor coded so), and is made with
    ``make`` for one that does not (lossless); ``fill`` is float32 only."""
    from hf_dynaquant.codecs.dynaquant import DynaQuantCodec
    from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization

    values = torch.randn(300, 300, generator=torch.Generator().manual_seed(3))
    plan = plan_quantization({"x": values}, QuantConfig(bins=6, prune=0.1, protect=0.01, min_numel=1)).tensors["x"]
    calls: list[str] = []

    def make() -> torch.Tensor:
        calls.append("make")
        return values.clone()

    def fill(start: int, stop: int, out: np.ndarray) -> None:
        calls.append("fill")
        out[...] = values.reshape(-1)[start:stop].numpy()

    deferred = DeferredTensor((300, 300), make, fill=fill)
    store.write(trees={"opt": {"x": deferred}}, codecs=lambda section, name: DynaQuantCodec(plan), ref="parts")
    assert calls and set(calls) == {"fill"}
    store.write(trees={"opt": {"x": values}}, codecs=lambda section, name: DynaQuantCodec(plan), ref="whole")
    with store.open("parts") as parts, store.open("whole") as whole:
        assert parts.manifest["sections"]["opt"] == whole.manifest["sections"]["opt"]
        assert torch.equal(parts.tree("opt")["x"], whole.tree("opt")["x"])
    calls.clear()
    store.write(trees={"opt": {"x": deferred}}, ref="lossless")
    assert calls == ["make"]
    with store.open("lossless") as entry:
        assert torch.equal(entry.tree("opt")["x"], values)
    with pytest.raises(ValueError, match="made in parts is float32"):
        DeferredTensor((300, 300), make, torch.bfloat16, fill=fill)


def test_unpicklable_tree_values_refused(store) -> None:
    from hf_dynaquant import UnsupportedTensorError

    with pytest.raises(UnsupportedTensorError, match="cannot be stored without pickle"):
        store.write(trees={"t": {"obj": object()}})
    assert store.entries() == []


def test_decode_one_tensor_reads_only_its_blobs(store, monkeypatch) -> None:
    tensors = {f"w{i}": torch.randn(1000) for i in range(5)}
    store.write({"model": tensors}, ref="m")
    entry = store.open("m")
    seen = []
    real = entry.read_checked
    monkeypatch.setattr(entry, "read_checked", lambda info, t, b: seen.append(t) or real(info, t, b))
    assert torch.equal(entry.tensor("model", "w3"), tensors["w3"])
    assert seen == ["model/w3"]


def test_payload_is_a_plain_safetensors_file(store) -> None:
    eid = store.write({"model": {"a": torch.randn(10)}})
    with safe_open(str(store.path / "entries" / eid / "payload.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["model/a/c0"]
        assert f.get_tensor("model/a/c0").dtype == torch.uint8
    manifest = json.loads(read_manifest_bytes(store.path / "entries" / eid / MANIFEST))
    assert manifest["format_version"] == 1 and manifest["base"] is None


def test_streaming_writer_grows_header_when_reservation_too_small(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    w = StreamingWriter(path, header_reserve=0)
    tensors = {f"tensor-{i}": torch.arange(i + 3, dtype=torch.float32) for i in range(20)}
    for k, t in tensors.items():
        w.add(k, "F32", tuple(t.shape), t.numpy())
    w.close({"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t)


@pytest.mark.parametrize("pread", ["preadv", "seek and read"])
def test_payload_blobs_are_read_without_mapping_the_file(tmp_path, monkeypatch, pread) -> None:
    """A payload file is validated by ``safe_open`` and its blobs read at the header's offsets,
    each into memory of its own: the file is never left mapped (a restore keeps every entry of
    its chain open, and the mapped pages it had read stayed resident, 1.14x a pure-bf16 124M
    checkpoint after nine deltas). A blob past the end of a file cut short, or a key the file
    does not hold, is a CorruptCheckpointError naming the file. The same where the platform
    has no ``preadv`` (a seek and a read under a lock)."""
    import os

    from hf_dynaquant.errors import CorruptCheckpointError
    from hf_dynaquant.store.safetensors_io import PayloadFile, read_blob

    if pread != "preadv":
        monkeypatch.delattr(os, "preadv", raising=False)

    path = tmp_path / "p.safetensors"
    w = StreamingWriter(path, header_reserve=64)
    blobs = {f"b{i}": np.random.default_rng(i).integers(0, 256, 1000 * i + 7).astype(np.uint8) for i in range(5)}
    for key, data in blobs.items():
        w.add(key, "U8", (data.size,), data)
    w.close({})
    handle = PayloadFile(path)
    for key, data in blobs.items():
        got = read_blob(handle, key, "t")
        assert np.array_equal(got, data) and got.flags.writeable
    if Path("/proc/self/maps").exists():
        assert str(path) not in Path("/proc/self/maps").read_text()
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        read_blob(handle, "absent", "t")
    handle.close()
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        read_blob(handle, "b1", "t")  # (closed)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes())
    handle = PayloadFile(cut)
    with open(cut, "r+b") as f:  # cut short after it was opened
        f.truncate(cut.stat().st_size - 10)
    with pytest.raises(CorruptCheckpointError, match="cut.safetensors.*cannot be read.*ends"):
        read_blob(handle, "b4", "t")
    with pytest.raises(CorruptCheckpointError, match="payload file is missing"):
        PayloadFile(tmp_path / "nowhere.safetensors")


def make_chain(store: CheckpointStore, n: int = 4) -> list[tuple[str, dict]]:
    torch.manual_seed(0)
    w = {"a": torch.randn(50_000) * 0.02, "b": torch.randn(300, 40), "i": torch.arange(10)}
    out, prev = [], None
    for step in range(n):
        w = {"a": w["a"] + torch.randn(50_000) * 1e-6, "b": w["b"] + 1e-4 * torch.randn(300, 40), "i": w["i"] + 1}
        prev = store.write({"model": w}, base=prev, ref=f"step-{step}", metadata={"step": step})
        out.append((prev, {k: v.clone() for k, v in w.items()}))
    return out


def test_chain_replay_and_delta_savings(store) -> None:
    chain = make_chain(store)
    infos = [store.info(eid) for eid, _ in chain]
    assert infos[0].base is None and all(i.base == chain[k][0] for k, i in enumerate(infos[1:]))
    assert infos[-1].nbytes < 0.8 * infos[0].nbytes  # deltas are smaller than the keyframe
    assert store.chain("step-3") == [eid for eid, _ in reversed(chain)]
    for k, (_, expected) in enumerate(chain):
        assert_state_equal(store.open(f"step-{k}").load_section("model"), expected)
    assert store.verify() == [] and store.verify("step-3", deep=True) == []


def test_gc_keeps_chain_bases_and_removes_garbage(store) -> None:
    chain = make_chain(store)
    store.delete_ref("step-0")
    store.delete_ref("step-1")
    assert store.gc() == []  # still bases of step-2 and step-3
    store.delete_ref("step-3")
    assert store.gc() == [chain[3][0]]
    assert_state_equal(store.open("step-2").load_section("model"), chain[2][1])
    store.delete_ref("step-2")
    assert sorted(store.gc()) == sorted(eid for eid, _ in chain[:3])
    assert store.entries() == []


def test_compact_turns_delta_into_keyframe(store) -> None:
    chain = make_chain(store)
    new = store.compact("step-3")
    assert store.refs()["step-3"] == new and store.info(new).base is None
    for k in range(3):
        store.delete_ref(f"step-{k}")
    store.gc()
    assert store.entries() == [new]
    assert_state_equal(store.open("step-3").load_section("model"), chain[3][1])
    assert store.open("step-3").metadata == {"step": 3}


def test_resolve_by_prefix_and_clear_errors(store) -> None:
    eid = store.write({"m": {"x": torch.ones(3)}})
    assert store.resolve(eid[:10]) == eid
    with pytest.raises(EntryNotFoundError, match="no reference or entry 'nope'"):
        store.open("nope")
    with pytest.raises(EntryNotFoundError, match="no section 'model'"):
        store.open(eid).load_section("model")
    with pytest.raises(ValueError, match="invalid reference name"):
        store.set_ref("../evil", eid)


def test_identical_content_is_stored_once(store) -> None:
    sd = {"x": torch.arange(100.0)}
    assert store.write({"m": sd}) == store.write({"m": sd})
    assert len(store.entries()) == 1
