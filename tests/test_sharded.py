"""Sharded (FSDP2) checkpoints with real processes: 2 gloo ranks on CPU (tests/fsdp_job.py).

The plan from merged shard sketches equals the plan of the full tensors; a 2-rank save restores
bit-identically on 2 ranks and in 1 process, and equals a single-process compression of the
same full model with the same plan; the optimizer state decodes to what a single-process
encoding of the full optimizer state decodes to; a plain single-process checkpoint loads onto 2
ranks; a missing or damaged shard is named; the configuration search runs in lockstep."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fsdp_job import CONFIG, MOMENTS, PRUNED_MOMENTS, batches, extra_param, net, train
from safetensors.torch import load_file
from test_accelerate import torchrun

from hf_dynaquant import CheckpointStore, Compressor
from hf_dynaquant.core.kmeans import approximate_kmeans
from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization
from hf_dynaquant.core.sketch import LogSketch
from hf_dynaquant.errors import CheckpointError, CorruptCheckpointError, MissingShardError
from hf_dynaquant.pipeline import compress_state_dict
from hf_dynaquant.training.compressor import read_checkpoint
from hf_dynaquant.training.optimizer_state import encode_optimizer_state
from hf_dynaquant.training.sharded import load_sharded, merge_sketches, plan_sharded, shard_ref

JOB = Path(__file__).with_name("fsdp_job.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_sharded.py"
MAGNITUDE = replace(CONFIG, prune_by="magnitude")  # for single-process runs that record no gradients


def _ranks(out: Path, phase: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"rank*-{phase}.json"))]


# ---------------------------------------------------------------------------------------------
# in one process


def test_shard_sketches_merge_to_the_full_sketch() -> None:
    """Sketches are bucket counts: the merged sketches of row shards are the full tensor's
    sketch exactly, so thresholds and K-means codebooks from them are the same too."""
    torch.manual_seed(0)
    full = torch.randn(97, 64) * torch.logspace(-3, 0, 64)
    shards = torch.tensor_split(full, 3, dim=0)
    for alpha in (0.01, 0.001):
        merged = LogSketch(alpha)
        for shard in shards:
            merged.merge(LogSketch(alpha).add(shard))
        whole = LogSketch(alpha).add(full)
        for a, b in zip(merged.buckets(), whole.buckets()):
            assert np.array_equal(a, b)
        assert np.array_equal(merged.quantiles([0.1, 0.5, 0.99]), whole.quantiles([0.1, 0.5, 0.99]))
        assert np.array_equal(approximate_kmeans(merged, 8), approximate_kmeans(whole, 8))
    # a single process: merging over one rank changes nothing, and plan_sharded is plan_quantization
    assert merge_sketches({"x": whole})["x"].count == whole.count
    config = QuantConfig(bins=6, prune=0.3, protect=0.01, min_numel=1024)
    a = plan_sharded({"w": full}, config, shapes={"w": full.shape}).tensors["w"]
    b = plan_quantization({"w": full}, config).tensors["w"]
    assert np.array_equal(a.centres, b.centres) and a.prune_threshold == b.prune_threshold
    # plan_sharded asks plan_quantization for the thresholds only, and clusters the merged sketches itself
    c = plan_quantization({"w": full}, config, codebooks=False).tensors["w"]
    assert c.centres.size == 0
    assert (c.protect_magnitude, c.protect_sensitivity, c.prune_threshold) == (
        b.protect_magnitude,
        b.protect_sensitivity,
        b.prune_threshold,
    )


@pytest.mark.filterwarnings("ignore:no gradients were recorded")
def test_plain_checkpoint_loads_through_the_sharded_path(tmp_path) -> None:
    """load_sharded reads a plain Compressor checkpoint into a plain model (one process)."""
    model = net(sharded=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, batches(0, 2), None)
    Compressor(model, tmp_path, MAGNITUDE, optimizer=optimizer).compress(2)
    stored, opt_state, _ = read_checkpoint(CheckpointStore(tmp_path), "step-2")
    fresh = net(sharded=False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_sharded(tmp_path, "step-2", fresh, fresh_opt)["step"] == 2
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in stored.items())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt_state["state"][0]["exp_avg"])
    with pytest.raises(CheckpointError, match="has shape"):
        load_sharded(tmp_path, "step-2", _other())


def _other() -> torch.nn.Module:
    """A model whose tensors have the right names and the wrong shapes."""
    model = net(sharded=False)
    model.hidden = torch.nn.Linear(32, 5)
    return model


# ---------------------------------------------------------------------------------------------
# real processes


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-rank FSDP2 run that wrote sharded checkpoints step-3 (keyframe) and step-5 (delta)."""
    out = tmp_path_factory.mktemp("fsdp")
    torchrun(2, JOB, str(out), "save")
    return out


@pytest.mark.slow
def test_merged_plan_equals_the_full_tensor_plan(saved) -> None:
    ranks = _ranks(saved, "save")
    assert len(ranks) == 2
    for r in ranks:
        plan = r["plan"]
        assert plan.pop("names") is True and set(plan) == {"emb.weight", "hidden.weight", "head.weight"}
        assert all(all(checks.values()) for checks in plan.values()), plan  # thresholds and codebooks, exactly
        assert r["stochastic_rows"] and all(r["stochastic_rows"].values()), r["stochastic_rows"]
        sampled = r["sampled_plan"]  # sketches of a sample (2^20 values or more), shards cut mid-block
        assert sampled.pop("names") is True and all(sampled["big"].values()), sampled
    assert ranks[0]["entry"] == ranks[1]["entry"]  # every rank knows the index entry
    store = CheckpointStore(saved / "store")
    index = store.info("step-5").metadata["sharded"]
    assert index["world"] == 2 and index["tensors"]["hidden.weight"]["rows"] == [49, 48]  # uneven rows
    for rank in range(2):
        assert store.info(shard_ref("step-5", rank, 2)).base == store.resolve(shard_ref("step-3", rank, 2))  # delta
    assert store.verify() == []


@pytest.mark.slow
def test_two_ranks_save_and_load_bit_identical_to_one_process(saved, tmp_path) -> None:
    """2 ranks save, 2 ranks load, 1 process loads: every copy of the decoded state is the same,
    and the same as one process compressing the full model with the same plan."""
    full = load_file(str(saved / "save-full.safetensors"))
    sensitivity = load_file(str(saved / "sensitivity.safetensors"))
    types = _ranks(saved, "save")[0]["types"]
    ref_store = CheckpointStore(tmp_path / "reference")
    compress_state_dict(ref_store, full, CONFIG, types=types, sensitivity=sensitivity, ref="reference")
    reference = read_checkpoint(ref_store, "reference")[0]
    assert not torch.equal(reference["hidden.weight"], full["hidden.weight"])  # really quantized

    torchrun(2, JOB, str(saved), "load")
    ranks = _ranks(saved, "load")
    assert [r["step"] for r in ranks] == [5, 5] and all(r["same_split"] and r["trained"] for r in ranks)
    gathered = load_file(str(saved / "load-full.safetensors"))
    for name, t in reference.items():
        assert torch.equal(gathered[name], t), name
    offsets = {n: 0 for n in reference}
    for rank in range(2):  # each rank decoded exactly its rows of the reference
        local = load_file(str(saved / f"rank{rank}-load-local.safetensors"))
        for name, t in local.items():
            assert torch.equal(t, reference[name][offsets[name] : offsets[name] + t.shape[0]]), (rank, name)
            offsets[name] += t.shape[0]

    model = net(sharded=False)  # 2 ranks -> 1 process: re-assembled from both shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = load_sharded(saved / "store", "step-5", model, optimizer)
    assert meta["step"] == 5 and not meta["_same_split"]
    for name, t in reference.items():
        assert torch.equal(model.state_dict()[name], t), name
    moments = optimizer.state_dict()["state"]
    assert moments[1]["exp_avg"].shape == (97, 32) and moments[1]["exp_avg_sq"].min() >= 0
    x, y = batches(0)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()  # the re-assembled optimizer state is usable


def _full_optimizer(
    saved: Path, phase: str = "save", extra: list[torch.Tensor] = ()
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A plain model and AdamW (over its parameters and ``extra``) holding the full weights and
    optimizer state that the 2-rank run's ``phase`` dumped at its snapshot."""
    model = net(sharded=False)
    model.load_state_dict(load_file(str(saved / f"{phase}-full.safetensors")))
    optimizer = torch.optim.AdamW([*model.parameters(), *extra], lr=1e-2)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(saved / f"{phase}-optimizer.safetensors")).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = t
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return model, optimizer


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:no gradients were recorded")
def test_sharded_optimizer_state_equals_one_process_encoding(saved, tmp_path) -> None:
    """The Adam moments of a 2-rank save decode, row for row, to what one process compressing
    the full optimizer state decodes to: codebooks from merged sketches, the bins-or-lossless
    decision from dot products and norms summed over the ranks, the scale grid from the maximum
    over the ranks. Both ranks take the single process's decisions."""
    model, optimizer = _full_optimizer(saved)
    full_state = optimizer.state_dict()
    compressor = Compressor(model, tmp_path / "reference", MAGNITUDE, optimizer=optimizer, moment_quant=MOMENTS)
    written = compressor.write(compressor.snapshot(5), ref="reference")
    reference = read_checkpoint(CheckpointStore(tmp_path / "reference"), "reference")[1]
    decisions = json.loads(json.dumps(written.optimizer_state))
    assert decisions["quantized"] == 3 and set(decisions["bins"]) == {"0", "1", "3"}, decisions  # the 3 matrices
    for pid in (0, 1, 3):  # really quantized: the decoded moments are not the originals
        assert not torch.equal(reference["state"][pid]["exp_avg"], full_state["state"][pid]["exp_avg"])
        assert not torch.equal(reference["state"][pid]["exp_avg_sq"], full_state["state"][pid]["exp_avg_sq"])

    # every rank decided what the single process decided (the index keeps rank 0's report)
    assert [r["optimizer_state"] for r in _ranks(saved, "save")] == [decisions, decisions]
    for r in _ranks(saved, "save"):  # a large state's decisions, read from a sample cut mid-block
        assert all(r["sampled_moments"].values()), r["sampled_moments"]
    assert CheckpointStore(saved / "store").info("step-5").metadata["optimizer_state"] == decisions

    fresh = net(sharded=False)  # the 2-rank save re-assembled in one process
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_sharded(saved / "store", "step-5", fresh, fresh_opt)
    decoded = fresh_opt.state_dict()["state"]
    assert set(decoded) == set(reference["state"])
    for pid, entry in reference["state"].items():
        for key, t in entry.items():
            assert torch.equal(decoded[pid][key], t), (pid, key)  # bit-identical, every row

    # the test can tell: a shard encoded on its own gets other codebooks than the full tensor
    full_plans = encode_optimizer_state(full_state, settings=MOMENTS).plans
    shard = {  # rank 0's rows (FSDP2 gives rank 0 the larger half)
        "state": {
            pid: {k: (v[: (len(v) + 1) // 2] if v.dim() else v) for k, v in entry.items()}
            for pid, entry in full_state["state"].items()
        },
        "param_groups": full_state["param_groups"],
    }
    own = encode_optimizer_state(shard, settings=MOMENTS).plans
    assert any(not np.array_equal(own[k].centres, full_plans[k].centres) for k in own if k in full_plans)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:no gradients were recorded")
def test_replicated_optimizer_state_is_counted_once(tmp_path) -> None:
    """A parameter outside the FSDP model has the same state on every rank; only rank 0's copy
    enters the merged sketches and sums, so the decisions and the decoded state are still those
    of one process encoding the full optimizer state (with pruned updates, whose one threshold
    over all the moment tensors a copy counted twice would move)."""
    torchrun(2, JOB, str(tmp_path), "replicated")
    extra = extra_param()
    model, optimizer = _full_optimizer(tmp_path, "replicated", [extra])
    compressor = Compressor(model, tmp_path / "reference", MAGNITUDE, optimizer=optimizer, moment_quant=PRUNED_MOMENTS)
    decisions = json.loads(json.dumps(compressor.write(compressor.snapshot(3), ref="ref").optimizer_state))
    reference = read_checkpoint(CheckpointStore(tmp_path / "reference"), "ref")[1]
    assert decisions["bins"].keys() == {"0", "1", "3", "5"}, decisions  # the extra parameter (5) is quantized
    assert [r["optimizer_state"] for r in _ranks(tmp_path, "replicated")] == [decisions, decisions]
    assert CheckpointStore(tmp_path / "store").info("step-3").metadata["sharded"]["optimizer"]["5"] == []
    fresh = net(sharded=False)
    fresh_opt = torch.optim.AdamW([*fresh.parameters(), extra_param()], lr=1e-2)
    load_sharded(tmp_path / "store", "step-3", fresh, fresh_opt)
    decoded = fresh_opt.state_dict()["state"]
    for pid, entry in reference["state"].items():
        for key, t in entry.items():
            assert torch.equal(decoded[pid][key], t), (pid, key)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:no gradients were recorded")
def test_plain_checkpoint_onto_two_ranks(saved, tmp_path) -> None:
    """A single-process checkpoint of the full model restores onto 2 FSDP2 ranks."""
    out = tmp_path / "plain"
    shutil.copytree(saved / "store", out / "store")
    model = net(sharded=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, batches(0, 2), None)
    compressor = Compressor(model, out / "store", MAGNITUDE, optimizer=optimizer)
    compressor.write(compressor.snapshot(2), ref="plain")
    stored = read_checkpoint(CheckpointStore(out / "store"), "plain")[0]
    torchrun(2, JOB, str(out), "load-plain")
    ranks = _ranks(out, "load-plain")
    assert [r["step"] for r in ranks] == [2, 2] and all(r["trained"] for r in ranks)
    gathered = load_file(str(out / "load-plain-full.safetensors"))
    for name, t in stored.items():
        assert torch.equal(gathered[name], t), name


@pytest.mark.slow
def test_missing_or_damaged_shard_is_named(saved, tmp_path) -> None:
    store_dir = tmp_path / "store"
    shutil.copytree(saved / "store", store_dir)
    store = CheckpointStore(store_dir)
    shard = store.resolve(shard_ref("step-5", 1, 2))
    payload = store_dir / "entries" / shard / "payload.safetensors"
    data = bytearray(payload.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0xFF  # a byte of some blob
    payload.write_bytes(bytes(data))
    model = net(sharded=False)
    with pytest.raises(CorruptCheckpointError, match=r"shard 1 of 2 of checkpoint 'step-5'.*payload\.safetensors"):
        load_sharded(store, "step-5", model, torch.optim.AdamW(model.parameters()))
    shutil.rmtree(store_dir / "entries" / shard)
    with pytest.raises(MissingShardError, match=f"shard 1 of 2 of checkpoint 'step-5' \\(entry {shard}"):
        load_sharded(store, "step-5", net(sharded=False))


@pytest.mark.slow
def test_search_in_lockstep(tmp_path) -> None:
    """With a threshold the ranks search together (each on its own data) and agree."""
    torchrun(2, JOB, str(tmp_path), "search")
    ranks = _ranks(tmp_path, "search")
    assert len(ranks) == 2 and ranks[0]["chosen"] is not None
    assert ranks[0]["chosen"] == ranks[1]["chosen"] and ranks[0]["degradation"] == ranks[1]["degradation"]
    assert ranks[0]["evaluations"] == ranks[1]["evaluations"] >= 1
    assert ranks[0]["chosen"] == ranks[0]["unsharded_chosen"]  # what a search of the unsharded model chooses
    assert "ShardedCompressor" in ranks[0]["plugin_refusal"]  # the Accelerate plugin points here
    meta = CheckpointStore(tmp_path / "store").info("step-2").metadata
    assert meta["search"]["config"] == ranks[0]["chosen"] and meta["sharded"]["optimizer"] is None


def test_background_saves_equal_foreground_saves(tmp_path) -> None:
    """CheckpointManager(ShardedCompressor).save on every rank: each rank's shard is encoded on
    the background thread (its collectives on a gloo group of its own) while the training
    thread's FSDP collectives and foreground saves go on; the checkpoints decode to exactly what
    the foreground saves of the same steps decode to, a keyframe then deltas."""
    torchrun(2, JOB, str(tmp_path), "background")
    ranks = _ranks(tmp_path, "background")
    assert len(ranks) == 2 and all(r["own_group"] for r in ranks)
    assert ranks[0]["reports"] == ranks[1]["reports"]  # each report names the index entry
    assert [(step, keyframe) for step, _, keyframe in ranks[0]["reports"]] == [(2, True), (4, False), (6, False)]
    for step in (2, 4, 6):
        decoded = []
        for folder in ("foreground", "store"):
            model = net(sharded=False)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            assert load_sharded(tmp_path / folder, f"step-{step}", model, optimizer)["step"] == step
            decoded.append((model.state_dict(), optimizer.state_dict()["state"]))
        (fg_weights, fg_moments), (bg_weights, bg_moments) = decoded
        for name, t in fg_weights.items():
            assert torch.equal(bg_weights[name], t), (step, name)
        for pid, entry in fg_moments.items():
            for key, t in entry.items():
                assert torch.equal(bg_moments[pid][key], t), (step, pid, key)


@pytest.mark.slow
def test_example_trains_saves_and_restores_onto_one_process(tmp_path) -> None:
    """examples/fsdp_sharded.py: 2 ranks train and save sharded checkpoints, then one process
    restores the last into a plain model, close to the trained one, and trains on."""
    torchrun(2, EXAMPLE, "--out", str(tmp_path), "--steps", "40", "--every", "20")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world"] == 2 and summary["restored_step"] == 40
    assert [c["keyframe"] for c in summary["checkpoints"]] == [True, False]
    assert all(c["stored"] * 4 < c["raw"] for c in summary["checkpoints"])
    assert summary["store_bytes"] * 4 < summary["raw_bytes"]
    assert summary["optimizer_state"]["quantized"] >= 4  # the Adam moments of the matrices are compressed
    assert 0 < summary["relative_error"] < 0.3
    assert abs(summary["restored_loss"] - summary["live_loss"]) < 0.05 * summary["live_loss"]
    index = CheckpointStore(tmp_path / "store").info("step-40").metadata["sharded"]
    assert index["world"] == 2 and len(index["shards"]) == 2
