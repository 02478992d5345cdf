"""The Trainer integration, end to end with the real transformers.Trainer: compressed saves,
resume (DynaQuantTrainer and plain Trainer + materialize), optimizer-state modes, rotation,
background errors, refusals, kill-and-resume and two processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_args import args_for  # tests/ is on sys.path (rootdir conftest)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

import hf_dynaquant
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.errors import BackgroundCompressionError, CheckpointError, MissingOptimizerStateError
from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.search import SearchSpace
from hf_dynaquant.training.checkpoint_dir import MARKER, checkpoint_store, last_complete_checkpoint, read_marker
from hf_dynaquant.training.compressor import read_checkpoint
from hf_dynaquant.training.optimizer_state import MomentQuant

FIXED = QuantConfig(bins=8, prune=0.1, min_numel=1024)
SMALL_SPACE = SearchSpace(bins=(4, 8, 16), prune=(0.2, 0.0), protect=(0.005,), prune_by=("magnitude",))


@pytest.fixture(scope="module")
def data():
    return docstring_lm_datasets(block=32, eval_blocks=16, max_blocks=400)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=CharTokenizer().vocab_size, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


class LogRecorder(TrainerCallback):
    """What the reporting integrations (TensorBoard, W&B, ...) receive through ``on_log``."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_compressed_saves_and_resume_with_dynaquant_trainer(tmp_path, data) -> None:
    train, held = data
    cb, rec = DynaQuantCallback(None, config=FIXED, ema_steps=2, keyframe_every=2, busy_saves="wait"), LogRecorder()
    trainer = DynaQuantTrainer(model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[cb, rec])
    trainer.train()
    for step in (4, 8, 12):
        folder = tmp_path / f"checkpoint-{step}"
        assert read_marker(folder)["ref"] == folder.name and read_marker(folder)["step"] == step
        names = set(os.listdir(folder))
        assert not names & {"model.safetensors", "optimizer.pt"}  # never written uncompressed
        assert {"trainer_state.json", "scheduler.pt", "rng_state.pth", "config.json"} <= names
    store = checkpoint_store(tmp_path)
    assert [store.info(f"checkpoint-{s}").base is None for s in (4, 8, 12)] == [True, False, True]  # keyframes
    assert [r["step"] for r in cb.reports] == [4, 8, 12]
    logged = [h for h in rec.logs if "dynaquant/ratio" in h]
    assert len(logged) == 3  # one per checkpoint to the integrations, the last one at the end of training
    assert logged[-1]["dynaquant/cumulative_ratio"] > 3 and "dynaquant/optimizer_ratio" in logged[-1]
    assert not any("dynaquant/ratio" in h for h in trainer.state.log_history)  # timing-dependent: kept out

    # resume from checkpoint-8: weights = decoded weights, optimizer = decoded state, step 8
    weights, opt_state, _ = read_checkpoint(store, "checkpoint-8")
    resumed_cb = DynaQuantCallback(None, config=FIXED, ema_steps=2, keyframe_every=3, busy_saves="wait")
    loaded = {}

    class Probe(DynaQuantTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            loaded["model"] = {k: v.clone() for k, v in self.model.state_dict().items()}
            state = self.optimizer.state_dict()["state"]  # live tensors: copied before training moves them
            loaded["optimizer"] = {pid: {k: v.clone() for k, v in st.items()} for pid, st in state.items()}

    fresh = Probe(model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[resumed_cb])
    fresh.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    for name, t in weights.items():
        assert torch.equal(loaded["model"][name], t), name
    for pid, st in opt_state["state"].items():
        assert torch.equal(loaded["optimizer"][pid]["exp_avg_sq"], st["exp_avg_sq"])
    assert [r["step"] for r in resumed_cb.reports] == [12]
    assert store.info("checkpoint-12").base == store.resolve("checkpoint-8")  # the chain went on


def test_restore_depth_anchors_a_trainer_run_and_its_resume(tmp_path, data) -> None:
    """``restore_depth=1`` through the Trainer: every save after the first delta is coded on the
    keyframe (each restore replays one delta at most), and a run resumed from an anchor goes on
    anchoring on the same keyframe until ``keyframe_every`` starts a new chain."""
    train, _ = data
    settings = dict(config=FIXED, ema_steps=2, keyframe_every=4, restore_depth=1, busy_saves="wait")
    trainer = DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[DynaQuantCallback(None, **settings)]
    )
    trainer.train()
    store = checkpoint_store(tmp_path)
    chains = {s: [store.open(e).metadata["step"] for e in store.chain(f"checkpoint-{s}")] for s in (4, 8, 12)}
    assert chains == {4: [4], 8: [8, 4], 12: [12, 4]}
    resumed = DynaQuantTrainer(
        model=tiny_gpt2(),
        args=args_for(tmp_path, max_steps=20),
        train_dataset=train,
        callbacks=[DynaQuantCallback(None, **settings)],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-12"))
    chains = {s: [store.open(e).metadata["step"] for e in store.chain(f"checkpoint-{s}")] for s in (16, 20)}
    assert chains == {16: [16, 4], 20: [20]}  # the fourth entry of the chain, then a keyframe
    assert store.verify(deep=True) == []


@pytest.mark.parametrize("codec", ["qd", "cnr", "nf4"])
def test_a_peer_codes_the_weights_and_the_run_resumes(tmp_path, data, codec) -> None:
    """DynaQuantCallback(codec=<peer>, threshold=None): the weights go through the peer (qd's
    deltas on the previous checkpoint's codes too), the optimizer state through optimizer_state's
    coding, and a resume loads exactly what the store decodes."""
    train, _ = data
    cb = DynaQuantCallback(None, codec=codec, keyframe_every=2, busy_saves="wait")
    trainer = DynaQuantTrainer(model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[cb])
    trainer.train()
    store = checkpoint_store(tmp_path)
    entry = store.open("checkpoint-8")
    assert entry.metadata["codec"] == codec and "quant_config" not in entry.metadata
    records = {n: entry.record("model", n) for n in entry.names("model")}
    quantized = {n for n, r in records.items() if r.get("codec") == codec and r["params"]["mode"] == codec}  # (not aliases)
    assert "transformer.h.0.mlp.c_fc.weight" in quantized and "transformer.h.0.ln_1.weight" not in quantized
    assert all(records[n]["uses_base"] == (codec == "qd") for n in quantized)  # only qd has deltas
    weights, _, _ = read_checkpoint(store, "checkpoint-8")
    loaded = {}

    class Probe(DynaQuantTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            loaded.update({k: v.clone() for k, v in self.model.state_dict().items()})

    resumed = Probe(
        model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train,
        callbacks=[DynaQuantCallback(None, codec=codec, busy_saves="wait")],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    assert all(torch.equal(loaded[n], t) for n, t in weights.items())


def test_a_peer_is_searched_as_the_paper_searched_its_baselines(tmp_path, data) -> None:
    """DynaQuantCallback(codec="qd") with a threshold: every checkpoint stores the fewest bits
    whose decoded checkpoint passed the threshold (the candidates before it failed), the records
    hold those bits, and a resumed run's search starts at the stored choice."""
    train, held = data
    cb = DynaQuantCallback(codec="qd", keyframe_every=2, busy_saves="wait")
    trainer = DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, eval_dataset=held, callbacks=[cb]
    )
    trainer.train()
    store = checkpoint_store(tmp_path)
    for step in (4, 8, 12):
        entry = store.open(f"checkpoint-{step}")
        search = entry.metadata["search"]
        assert search["codec"] == "qd" and search["candidates"][-1]["passed"]
        assert not any(c["passed"] for c in search["candidates"][:-1])
        bits = search["config"]["bits"]
        record = entry.record("model", "transformer.h.0.mlp.c_fc.weight")
        assert record["codec"] == "qd" and record["params"]["levels"] == 2**bits
    assert store.open("checkpoint-4").metadata["search"]["mode"] == "exhaustive"
    chosen = store.open("checkpoint-8").metadata["search"]["config"]
    resumed_cb = DynaQuantCallback(codec="qd", busy_saves="wait")
    resumed = DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, eval_dataset=held, callbacks=[resumed_cb]
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    after = store.open("checkpoint-12").metadata["search"]
    assert after["mode"] == "neighbourhood" and after["candidates"][0]["options"] == chosen


def test_excp_codes_weights_with_the_moments_and_the_run_resumes(tmp_path, data) -> None:
    """DynaQuantCallback(codec="excp"): a keyframe stores the weights exactly; the next
    checkpoint codes their residual on it (as restored) with ExCP, and Adam's moments shrunk by
    the same joint rule and K-means coded; a resume loads exactly what the store decodes, and the
    chain goes on."""
    train, _ = data
    cb = DynaQuantCallback(None, codec="excp", keyframe_every=3, busy_saves="wait")
    trainer = DynaQuantTrainer(model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[cb])
    trainer.train()
    store = checkpoint_store(tmp_path)
    first, second = store.open("checkpoint-4"), store.open("checkpoint-8")
    assert first.metadata["optimizer_state"]["keyframe"] and not second.metadata["optimizer_state"]["keyframe"]
    assert second.metadata["codec"] == "excp" and store.info("checkpoint-8").base == store.resolve("checkpoint-4")
    name = "transformer.h.0.mlp.c_fc.weight"
    assert first.record("model", name)["codec"] == "lossless"  # ExCP's first checkpoint: the weights exactly
    record = second.record("model", name)
    assert record["codec"] == "excp" and record["params"]["residual"] == "previous" and record["uses_base"]
    assert second.record("model", "lm_head.weight").get("alias_of") == "transformer.wte.weight"  # tied: stored once
    assert second.record("model", "transformer.wte.weight")["codec"] == "excp"
    moments = [k for k in second.names("optimizer") if k.endswith("exp_avg") or k.endswith("exp_avg_sq")]
    assert moments and all(second.record("optimizer", k)["codec"] == "excp" for k in moments)
    weights, opt_state, _ = read_checkpoint(store, "checkpoint-8")
    live = dict(trainer.model.state_dict())
    change = sum(float((weights[n] - first.tensor("model", n)).norm()) for n in weights)
    error = sum(float((weights[n] - live[n]).norm()) for n in weights)
    assert 0 < error < change  # the residual is coded, not dropped (the live model is 4 steps on)
    exp_avg = [st["exp_avg"] for st in opt_state["state"].values()]
    assert all(0 < (m != 0).float().mean() < 1 for m in exp_avg if m.numel() > 100)  # shrunk, not emptied
    loaded = {}

    class Probe(DynaQuantTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            loaded["model"] = {k: v.clone() for k, v in self.model.state_dict().items()}
            state = self.optimizer.state_dict()["state"]
            loaded["optimizer"] = {pid: {k: v.clone() for k, v in st.items()} for pid, st in state.items()}

    resumed_cb = DynaQuantCallback(None, codec="excp", keyframe_every=3, busy_saves="wait")
    resumed = Probe(model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[resumed_cb])
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    assert all(torch.equal(loaded["model"][n], t) for n, t in weights.items())
    for pid, st in opt_state["state"].items():
        assert torch.equal(loaded["optimizer"][pid]["exp_avg"], st["exp_avg"])
    assert store.info("checkpoint-12").base == store.resolve("checkpoint-8")  # the chain went on


class StopAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_every_checkpoint_is_logged_even_between_log_calls(tmp_path, data) -> None:
    """With no log call between saves, each checkpoint's figures still reach the integrations
    (a later checkpoint's figures never overwrite an earlier one's)."""
    train, _ = data
    cb, rec = DynaQuantCallback(None, config=FIXED, ema_steps=2, busy_saves="wait"), LogRecorder()
    args = args_for(tmp_path, logging_steps=1000)
    trainer = DynaQuantTrainer(model=tiny_gpt2(), args=args, train_dataset=train, callbacks=[cb, rec])
    trainer.train()
    logged = [h for h in rec.logs if "dynaquant/ratio" in h]
    assert len(logged) == 3 and len({h["dynaquant/background_seconds"] for h in logged}) == 3


def test_lossless_restores_reproduce_the_uninterrupted_run_exactly(tmp_path, data) -> None:
    """With every tensor lossless, two kills and resumes end on the very weights of one
    uninterrupted run: the resume restores weights, optimizer, scheduler, RNG and data order."""
    train, _ = data
    lossless = dict(config=QuantConfig(min_numel=10**12), optimizer_state="lossless")
    whole = DynaQuantTrainer(
        model=tiny_gpt2(),
        args=args_for(tmp_path / "a"),
        train_dataset=train,
        callbacks=[DynaQuantCallback(None, **lossless, busy_saves="wait")],
    )
    whole.train()
    for i, stop in enumerate((4, 8, 12)):
        part = DynaQuantTrainer(
            model=tiny_gpt2(),
            args=args_for(tmp_path / "b"),
            train_dataset=train,
            callbacks=[DynaQuantCallback(None, **lossless, busy_saves="wait"), StopAfter(stop)],
        )
        part.train(resume_from_checkpoint=True if i else None)
    for name, t in whole.model.state_dict().items():
        assert torch.equal(part.model.state_dict()[name], t), name


def test_search_runs_on_eval_dataset_and_is_recorded(tmp_path, data) -> None:
    train, held = data
    cb = DynaQuantCallback(
        0.02, search_space=SMALL_SPACE, config=QuantConfig(min_numel=1024), ema_steps=2, busy_saves="wait"
    )
    trainer = DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path, max_steps=8), train_dataset=train, eval_dataset=held, callbacks=[cb]
    )
    trainer.train()
    with checkpoint_store(tmp_path).open("checkpoint-8") as entry:
        search = entry.metadata["search"]
    assert search["evaluations"] >= 1 and search["degradation"] <= 0.02
    assert cb.reports[-1]["dynaquant/search_evaluations"] == search["evaluations"]


def test_plain_trainer_with_callback_then_materialize(tmp_path, data) -> None:
    train, _ = data
    cb = DynaQuantCallback(None, config=FIXED, ema_steps=2, background=False)
    trainer = Trainer(model=tiny_gpt2(), args=args_for(tmp_path, max_steps=8), train_dataset=train, callbacks=[cb])
    trainer.train()
    folder = tmp_path / "checkpoint-8"
    assert (folder / MARKER).is_file() and not (folder / "model.safetensors").exists()  # removed once stored
    assert not (folder / "optimizer.pt").exists()
    assert cb.reports and not any("dynaquant/ratio" in h for h in trainer.state.log_history)
    path = hf_dynaquant.materialize(tmp_path)  # the newest complete checkpoint
    assert path == folder and (folder / "model.safetensors").is_file() and (folder / "optimizer.pt").is_file()
    again = Trainer(
        model=tiny_gpt2(),
        args=args_for(tmp_path, max_steps=12),
        train_dataset=train,
        callbacks=[DynaQuantCallback(None, config=FIXED, background=False)],
    )
    again.train(resume_from_checkpoint=str(path))
    assert again.state.global_step == 12
    weights, _, _ = read_checkpoint(checkpoint_store(tmp_path), "checkpoint-8")
    assert weights.keys() == tiny_gpt2().state_dict().keys()


@pytest.mark.parametrize("mode", ["lossless", "drop"])
def test_optimizer_state_modes(tmp_path, data, mode) -> None:
    train, _ = data
    cb = DynaQuantCallback(None, config=FIXED, optimizer_state=mode, ema_steps=2, busy_saves="wait")
    trainer = DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path, max_steps=4), train_dataset=train, callbacks=[cb]
    )
    trainer.train()
    live = trainer.optimizer.state_dict()
    _, stored, meta = read_checkpoint(checkpoint_store(tmp_path), "checkpoint-4")
    assert meta["optimizer_state"]["mode"] == mode
    if mode == "lossless":
        for pid, st in live["state"].items():
            for key, t in st.items():
                assert torch.equal(stored["state"][pid][key], t)
        return
    assert stored is None
    with pytest.raises(MissingOptimizerStateError, match="drop"):
        hf_dynaquant.materialize(tmp_path / "checkpoint-4")
    resumed = DynaQuantTrainer(
        model=tiny_gpt2(),
        args=args_for(tmp_path, max_steps=6),
        train_dataset=train,
        callbacks=[DynaQuantCallback(None, config=FIXED, busy_saves="wait")],
    )
    with pytest.warns(UserWarning, match="FRESH optimizer"):
        resumed.train(resume_from_checkpoint=True)


def test_compressed_adam_state_passes_fidelity(tmp_path, data) -> None:
    train, _ = data
    cb = DynaQuantCallback(None, config=FIXED, ema_steps=2, busy_saves="wait")
    trainer = DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path, max_steps=4), train_dataset=train, callbacks=[cb]
    )
    trainer.train()
    live = trainer.optimizer.state_dict()
    _, stored, meta = read_checkpoint(checkpoint_store(tmp_path), "checkpoint-4")
    with checkpoint_store(tmp_path).open("checkpoint-4") as entry:
        trees = entry.tree("optimizer")["state"]
    report = meta["optimizer_state"]
    settings = MomentQuant()  # the defaults the callback used
    assert report["mode"] == "compress" and report["quantized"] >= 8
    eps = live["param_groups"][0]["eps"]
    for pid, st in live["state"].items():
        got = stored["state"][pid]
        assert torch.equal(got["step"], st["step"])
        upd = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + eps)
        upd_dec = got["exp_avg"] / (got["exp_avg_sq"].sqrt() + eps)
        cos = torch.nn.functional.cosine_similarity(upd.flatten(), upd_dec.flatten(), dim=0)
        assert cos >= settings.min_cosine, pid  # the fidelity every stored update is checked for
        assert float(upd_dec.norm()) == pytest.approx(float(upd.norm()), rel=1e-4), pid  # and its length kept
        # sqrt(v) is the rounded one times the scale gain (the grid's mean shortfall, about 1.04)
        scale_gain = trees[pid]["dq_scale_gain"]
        assert abs(math.log(scale_gain)) <= settings.scale_step / 2, pid  # a mean of exp(rounding error)
        ratio = (got["exp_avg_sq"].sqrt() / scale_gain + eps) / (st["exp_avg_sq"].sqrt() + eps)
        assert float((ratio - 1).abs().max()) <= math.exp(settings.scale_step / 2) - 1 + 1e-4  # the grid's bound


def test_rotation_keeps_every_chain_restorable(tmp_path, data) -> None:
    train, _ = data
    cb = DynaQuantCallback(None, config=FIXED, ema_steps=1, keyframe_every=3, busy_saves="wait")
    args = args_for(tmp_path, max_steps=16, save_steps=2, save_total_limit=2)
    DynaQuantTrainer(model=tiny_gpt2(), args=args, train_dataset=train, callbacks=[cb]).train()
    folders = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert folders == ["checkpoint-14", "checkpoint-16"]
    store = checkpoint_store(tmp_path)
    assert set(store.refs()) == set(folders)  # rotated folders released their references
    assert set(store.entries()) == store.reachable()  # and what nothing reaches was collected
    assert len(store.entries()) <= 3  # at most one chain back to its keyframe
    for name in folders:
        read_checkpoint(store, name)  # every surviving checkpoint decodes
    assert store.verify() == []


def test_crash_windows_are_repaired_from_the_store(tmp_path, data) -> None:
    """A crash between the entry and the marker, or one that lost every folder (an early
    rotation), still resumes from the newest entry the store holds."""
    train, _ = data
    cb = DynaQuantCallback(None, config=FIXED, ema_steps=2, busy_saves="wait")
    DynaQuantTrainer(
        model=tiny_gpt2(), args=args_for(tmp_path, max_steps=8), train_dataset=train, callbacks=[cb]
    ).train()
    (tmp_path / "checkpoint-8" / MARKER).unlink()  # the entry is durable, the marker never came
    assert last_complete_checkpoint(tmp_path, repair=False) == tmp_path / "checkpoint-4"
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-8"  # repaired
    assert read_marker(tmp_path / "checkpoint-8")["entry"] == checkpoint_store(tmp_path).resolve("checkpoint-8")
    for folder in tmp_path.glob("checkpoint-*"):
        shutil.rmtree(folder)
    resumed = DynaQuantTrainer(
        model=tiny_gpt2(),
        args=args_for(tmp_path, max_steps=10),
        train_dataset=train,
        callbacks=[DynaQuantCallback(None, config=FIXED, busy_saves="wait")],
    )
    resumed.train(resume_from_checkpoint=True)  # checkpoint-8 rebuilt from the store's copy of its files
    assert resumed.state.global_step == 10
    assert json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8


def test_background_error_reaches_the_training_loop(tmp_path, data) -> None:
    train, _ = data
    calls = []

    def failing_metric(model) -> float:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("metric exploded")
        return 1.0

    cb = DynaQuantCallback(
        0.01, metric=failing_metric, search_space=SMALL_SPACE, config=QuantConfig(min_numel=1024), busy_saves="wait"
    )
    trainer = DynaQuantTrainer(model=tiny_gpt2(), args=args_for(tmp_path), train_dataset=train, callbacks=[cb])
    with pytest.raises(BackgroundCompressionError, match="checkpoint-4") as info:
        trainer.train()
    assert "metric exploded" in str(info.value.__cause__)


def test_refusals_are_clear(tmp_path, data) -> None:
    train, held = data
    args = args_for(tmp_path, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="me/x")
    with pytest.raises(CheckpointError, match="hub_strategy='end'"):  # refused before any Hub request
        DynaQuantTrainer(model=tiny_gpt2(), args=args, train_dataset=train, callbacks=[DynaQuantCallback(None)])
    args = args_for(tmp_path, eval_strategy="steps", eval_steps=4, load_best_model_at_end=True)
    plain = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=train, eval_dataset=held, callbacks=[DynaQuantCallback(None)]
    )
    with pytest.raises(CheckpointError, match="DynaQuantTrainer"):
        plain.train()


def test_load_best_model_at_end_from_the_store(tmp_path, data) -> None:
    train, held = data
    args = args_for(tmp_path, eval_strategy="steps", eval_steps=4, load_best_model_at_end=True)
    cb = DynaQuantCallback(None, config=FIXED, busy_saves="wait")
    trainer = DynaQuantTrainer(model=tiny_gpt2(), args=args, train_dataset=train, eval_dataset=held, callbacks=[cb])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    weights, _, _ = read_checkpoint(checkpoint_store(tmp_path), Path(best).name)
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(t, weights[name]), name


# ---------------------------------------------------------------------------------------------
# real processes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trainer_callback.py"


@pytest.mark.slow
def test_kill_and_resume(tmp_path) -> None:
    """SIGKILL a training process after a checkpoint, then resume from the newest complete one."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--output-dir",
        str(out),
        "--steps",
        "60",
        "--save-steps",
        "10",
        "--phase",
        "train",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300

    def newest_complete() -> int:  # compressed, or the Trainer's own when the encoder was busy
        found = last_complete_checkpoint(out) if out.is_dir() else None
        return int(found.name.split("-")[1]) if found is not None else 0

    while time.time() < deadline and newest_complete() < 20:
        if proc.poll() is not None:
            pytest.fail(f"training ended early: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    found = last_complete_checkpoint(out)
    assert found is not None and int(found.name.split("-")[1]) >= 20
    resumed = subprocess.run(cmd[:-1] + ["resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == found.name and summary["global_step"] == 60
    assert checkpoint_store(out).verify() == []


@pytest.mark.slow
def test_two_processes_write_once_and_resume(tmp_path) -> None:
    """torchrun with 2 CPU processes (gloo): the search uses both ranks, rank 0 writes, resume works."""
    script = Path(__file__).with_name("ddp_trainer_job.py")
    out = tmp_path / "ddp"
    for phase in ("train", "resume"):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                str(_free_port()),
                str(script),
                str(out),
                phase,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(reports) == 2
    assert reports[0]["written"] and not reports[1]["written"]  # only rank 0 wrote
    assert reports[0]["configs"] == reports[1]["configs"]  # both ranks chose the same configurations
    assert reports[0]["resumed_step"] == reports[1]["resumed_step"] == 8
    assert reports[0]["weights_digest"] == reports[1]["weights_digest"]  # restored identically
    # only rank 0 read the stored configuration; both go on searching from it, alike
    assert reports[0]["search_from"] is not None and reports[0]["search_from"] == reports[1]["search_from"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
