"""The Accelerate plugin with the real accelerate: compressed save_state/load_state, rotation under
automatic checkpoint naming, crash windows, refusals, sizes against the Trainer callback, and
real processes (torchrun with gloo: save with 2, load with 2 and 1, the same as one process;
kill and resume)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from transformers import GPT2Config, GPT2LMHeadModel

import hf_dynaquant
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.errors import (
    BackgroundCompressionError,
    CheckpointError,
    IncompleteCheckpointError,
    InvalidSettingError,
    MissingOptimizerStateError,
    UnsupportedSetupError,
)
from hf_dynaquant.integrations.accelerate import DynaQuantPlugin
from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.training.checkpoint_dir import MARKER, checkpoint_store, last_complete_checkpoint, read_marker
from hf_dynaquant.training.compressor import read_checkpoint

FIXED = QuantConfig(bins=8, prune=0.1, min_numel=1024)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "accelerate_loop.py"


@pytest.fixture(scope="module")
def batches():
    train, _ = docstring_lm_datasets(block=32, eval_blocks=16, max_blocks=400)
    return [train[i : i + 8] for i in range(0, 128, 8)]


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=CharTokenizer().vocab_size, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


class Run:
    """One accelerator with a prepared tiny GPT-2, AdamW and a linear schedule, and the plugin."""

    def __init__(self, project_dir: Path, total_limit: int | None = 2, **plugin: object) -> None:
        project = ProjectConfiguration(str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit)
        self.accelerator = Accelerator(cpu=True, project_config=project, step_scheduler_with_optimizer=False)
        model = tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / 8))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        # every save compressed (what these tests check), even when the encoder is still busy
        settings = {"threshold": None, "config": FIXED, "ema_steps": 2, "checkpoint_every": 4, "busy_saves": "wait"}
        settings.update(plugin)
        self.dq = DynaQuantPlugin(**settings).attach(self.accelerator, self.model, self.optimizer)

    def train(self, batches: list, steps: int, save_every: int = 4) -> None:
        for i in range(steps):
            self.train_step(batches[(self.dq.compressor.step + i) % len(batches)], save_every)
        self.dq.wait()

    def train_step(self, batch: dict, save_every: int = 4) -> None:
        """One optimizer step, and a save_state every ``save_every`` steps."""
        loss = self.model(**batch).loss
        self.accelerator.backward(loss)
        self.accelerator.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        if self.dq.compressor.step % save_every == 0:
            self.accelerator.save_state()


def test_env_defaults_and_invalid_settings(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_THRESHOLD", "none")
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_KEYFRAME_EVERY", "3")
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_BACKGROUND", "false")
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_OPTIMIZER_STATE", "lossless")
    plugin = DynaQuantPlugin()
    assert (plugin.threshold, plugin.keyframe_every, plugin.background, plugin.optimizer_state) == (
        None,
        3,
        False,
        "lossless",
    )
    assert DynaQuantPlugin(keyframe_every=5).keyframe_every == 5  # an argument wins
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_KEYFRAME_EVERY", "many")
    with pytest.raises(InvalidSettingError, match="ACCELERATE_DYNAQUANT_KEYFRAME_EVERY='many'"):
        DynaQuantPlugin()
    monkeypatch.delenv("ACCELERATE_DYNAQUANT_KEYFRAME_EVERY")
    monkeypatch.delenv("ACCELERATE_DYNAQUANT_THRESHOLD")
    with pytest.raises(InvalidSettingError, match="eval_data"):
        DynaQuantPlugin()  # the default threshold needs something to judge configurations by
    with pytest.raises(InvalidSettingError, match="optimizer_state"):
        DynaQuantPlugin(threshold=None, optimizer_state="zip")
    assert hf_dynaquant.DynaQuantPlugin is DynaQuantPlugin  # the lazy export


def test_save_rotate_and_load(tmp_path, batches) -> None:
    run = Run(tmp_path, total_limit=2, keyframe_every=3)
    run.train(batches, 16)  # saves at steps 4, 8, 12, 16 -> checkpoint_0 .. checkpoint_3
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_2", "checkpoint_3"]  # rotated
    for folder in checkpoints.iterdir():
        names = set(os.listdir(folder))
        assert not names & {"model.safetensors", "optimizer.bin"}  # never written uncompressed
        assert {MARKER, "scheduler.bin", "random_states_0.pkl"} <= names
    store = checkpoint_store(tmp_path)  # beside checkpoints/, which Accelerate rotates
    assert set(store.refs()) == {"checkpoint_2", "checkpoint_3"}
    assert set(store.entries()) == store.reachable() and len(store.entries()) == 4  # checkpoint_2's chain kept
    assert store.info("checkpoint_3").base is None and store.verify() == []
    assert [r.step for r in run.dq.reports] == [4, 8, 12, 16]

    weights, opt_state, meta = read_checkpoint(store, "checkpoint_3")
    assert meta["step"] == 16 and meta["framework"] == "accelerate"
    again = Run(tmp_path, total_limit=2, keyframe_every=3)
    again.accelerator.load_state()  # the newest complete checkpoint
    for name, t in weights.items():
        assert torch.equal(again.model.state_dict()[name], t), name
    for pid, st in opt_state["state"].items():
        for key, t in st.items():
            assert torch.equal(again.optimizer.state_dict()["state"][pid][key], t)
    assert again.scheduler.scheduler.last_epoch == 16  # Accelerate's own files load as before
    assert again.dq.compressor.step == 16 and again.accelerator.project_configuration.iteration == 4
    again.train(batches, 4)  # the chain goes on from the loaded entry
    assert store.info("checkpoint_4").base == store.resolve("checkpoint_3")


def test_saves_faster_than_the_encoder_are_accelerates_own(tmp_path, batches) -> None:
    """With busy_saves="plain" (the default), a save_state while the previous checkpoint is still
    encoding is Accelerate's own uncompressed save (no wait), recorded; load_state reads it."""
    run = Run(tmp_path, total_limit=None, busy_saves="plain")
    gate, write = threading.Event(), run.dq.compressor.write
    run.dq.compressor.write = lambda *a, **kw: (gate.wait(timeout=60), write(*a, **kw))[1]  # holds the encoder
    for i in range(8):  # saves at steps 4 (compressed, held) and 8 (arrives while 4 is encoding)
        run.train_step(batches[i % len(batches)])
    gate.set()
    run.dq.wait()
    assert run.dq.plain_steps == [8] and [r.step for r in run.dq.reports] == [4]
    checkpoints = tmp_path / "checkpoints"
    assert read_marker(checkpoints / "checkpoint_0") is not None
    plain = set(os.listdir(checkpoints / "checkpoint_1"))
    assert read_marker(checkpoints / "checkpoint_1") is None and {"model.safetensors", "optimizer.bin"} <= plain
    expected = {n: t.clone() for n, t in run.model.state_dict().items()}
    again = Run(tmp_path, total_limit=None)
    again.accelerator.load_state()  # the newest: Accelerate's own folder
    for name, t in expected.items():
        assert torch.equal(again.model.state_dict()[name], t), name


def test_crash_windows(tmp_path, batches) -> None:
    run = Run(tmp_path, total_limit=None)
    run.train(batches, 8)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint_1" / MARKER).unlink()  # the entry is durable, the marker never came
    (checkpoints / "checkpoint_2").mkdir()  # a save killed before anything of ours was written
    (checkpoints / "checkpoint_2" / "scheduler.bin").write_bytes(b"")
    again = Run(tmp_path, total_limit=None)
    again.accelerator.load_state()
    assert read_marker(checkpoints / "checkpoint_1")["entry"] == checkpoint_store(tmp_path).resolve("checkpoint_1")
    assert again.dq.compressor.step == 8
    assert again.accelerator.project_configuration.iteration == 3  # past the broken folder
    empty = Run(tmp_path / "empty", total_limit=None)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint"):
        empty.accelerator.load_state()


def test_plain_folders_and_other_optimizer_modes(tmp_path, batches) -> None:
    run = Run(tmp_path / "a", optimizer_state="drop", background=False)
    run.train(batches, 4)
    run.dq.detach()  # Accelerate's own save_state again
    plain = Path(run.accelerator.save_state())
    assert read_marker(plain) is None
    assert (plain / "model.safetensors").is_file() and (plain / "optimizer.bin").is_file()
    again = Run(tmp_path / "b")
    again.accelerator.load_state(str(plain))  # no marker: loaded as Accelerate loads it
    assert torch.equal(again.model.lm_head.weight, run.model.lm_head.weight)
    with pytest.warns(UserWarning, match="FRESH optimizer"):
        again.accelerator.load_state(str(tmp_path / "a" / "checkpoints" / "checkpoint_0"))
    store = checkpoint_store(tmp_path / "a")
    entry = store.resolve("checkpoint_0")
    with store.open(entry) as reader:
        assert reader.metadata["optimizer_state"] == {"mode": "drop"}


def test_refusals(tmp_path, batches) -> None:
    run = Run(tmp_path / "a")
    with pytest.raises(UnsupportedSetupError, match="already"):
        DynaQuantPlugin(threshold=None).attach(run.accelerator, run.model, run.optimizer)
    run.train(batches, 4)
    checkpoint = str(tmp_path / "a" / "checkpoints" / "checkpoint_0")

    unprepared = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "b")))
    DynaQuantPlugin(threshold=None).attach(unprepared, tiny_gpt2())
    with pytest.raises(UnsupportedSetupError, match="accelerator.prepare"):
        unprepared.save_state(str(tmp_path / "b" / "x"))

    other = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "c")))
    smaller = other.prepare(GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=1, n_head=2)))
    DynaQuantPlugin(threshold=None).attach(other, smaller)
    with pytest.raises(CheckpointError, match="do not fit the model"):
        other.load_state(checkpoint)

    weights_only = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "d")))
    model = weights_only.prepare(tiny_gpt2())
    DynaQuantPlugin(threshold=None, config=FIXED, background=False).attach(weights_only, model)
    weights_only.save_state(str(tmp_path / "d" / "x"))
    with pytest.raises(MissingOptimizerStateError, match="no optimizer state"):
        Run(tmp_path / "e").accelerator.load_state(str(tmp_path / "d" / "x"))


def test_background_error_reaches_the_loop(tmp_path, batches) -> None:
    def failing_metric(model) -> float:
        raise RuntimeError("metric exploded")

    run = Run(tmp_path, threshold=0.01, metric=failing_metric)
    with pytest.raises(BackgroundCompressionError, match="checkpoint_0") as info:
        run.train(batches, 8)  # raised at an optimizer step or the next save, never swallowed
    assert "metric exploded" in str(info.value.__cause__)


def test_as_small_as_the_trainer_callback(tmp_path, batches) -> None:
    """The same model, configuration and optimizer mode through both integrations: the plugin's
    entries are no larger than the Trainer callback's (the same encoder; only the framework's own
    small files differ)."""
    from transformers import TrainingArguments

    train, _ = docstring_lm_datasets(block=32, eval_blocks=16, max_blocks=400)
    args = TrainingArguments(
        str(tmp_path / "trainer"),
        max_steps=8,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    callback = DynaQuantCallback(None, config=FIXED, ema_steps=2, keyframe_every=10, busy_saves="wait")
    DynaQuantTrainer(model=tiny_gpt2(), args=args, train_dataset=train, callbacks=[callback]).train()
    trainer_store = checkpoint_store(tmp_path / "trainer")
    run = Run(tmp_path / "accelerate", keyframe_every=10)
    run.train(batches, 8)
    plugin_store = checkpoint_store(tmp_path / "accelerate")
    for trainer_ref, plugin_ref in (("checkpoint-4", "checkpoint_0"), ("checkpoint-8", "checkpoint_1")):
        t, p = trainer_store.info(trainer_ref), plugin_store.info(plugin_ref)
        t_tensors = t.sections["model"][1] + t.sections["optimizer"][1]
        p_tensors = p.sections["model"][1] + p.sections["optimizer"][1]
        print(f"{plugin_ref}: plugin {p_tensors} / {p.nbytes} B, Trainer {t_tensors} / {t.nbytes} B (tensors / entry)")
        assert (t.base is None) == (p.base is None)
        assert p_tensors <= 1.05 * t_tensors, (plugin_ref, p_tensors, t_tensors)
        assert p.nbytes <= 1.05 * t.nbytes, (plugin_ref, p.nbytes, t.nbytes)


# ---------------------------------------------------------------------------------------------
# real processes


def torchrun(nproc: int, script: Path, *args: str) -> None:
    """Run ``script`` in ``nproc`` real processes (torch.distributed.run; gloo on CPU) and fail
    the test with the tail of its output unless every process succeeded. Shared with
    tests/test_sharded.py."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(_free_port()), str(script), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _torchrun(nproc: int, *args: str) -> None:
    torchrun(nproc, EXAMPLE, "--cpu", *args)


def _ranks(out: Path, phase: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"rank*-{phase}.json"))]


@pytest.mark.slow
def test_two_processes_save_load_and_match_one_process(tmp_path, monkeypatch) -> None:
    """2 processes save and load (and 1 loads what 2 saved); the 2-process search spreads
    candidates over the ranks and chooses what one process chooses, on bit-identical entries."""
    # several processes always wait for the encoder; the one-process run must too, to compare every save
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_BUSY_SAVES", "wait")
    two, one = tmp_path / "two", tmp_path / "one"
    common = ["--steps", "10", "--save-steps", "5", "--replicate-batches"]
    _torchrun(2, "--output-dir", str(two), *common)
    _torchrun(2, "--output-dir", str(two), *common[:1], "15", *common[2:], "--resume")
    _torchrun(1, "--output-dir", str(one), *common)
    trained, resumed, single = _ranks(two, "train"), _ranks(two, "resume"), _ranks(one, "train")
    assert len(trained) == len(resumed) == 2 and len(single) == 1
    assert trained[0]["written"] and not trained[1]["written"]  # only the main process writes
    assert trained[0]["chosen"] == trained[1]["chosen"] == single[0]["chosen"]  # all agree, as one process
    assert [r["resumed_step"] for r in resumed] == [10, 10]
    assert resumed[0]["resumed_digest"] == resumed[1]["resumed_digest"]  # restored identically
    assert [r["final_step"] for r in resumed] == [15, 15]
    assert resumed[0]["chosen"] == resumed[1]["chosen"]  # both ranks search on from rank 0's stored configuration
    two_store, one_store = checkpoint_store(two), checkpoint_store(one)
    for ref in ("checkpoint_0", "checkpoint_1"):
        a, b = read_checkpoint(two_store, ref), read_checkpoint(one_store, ref)
        for name, t in a[0].items():
            assert torch.equal(t, b[0][name]), (ref, name)  # the same decoded weights as one process
        assert a[2]["search"]["config"] == b[2]["search"]["config"]
    assert two_store.info("checkpoint_2").base == two_store.resolve("checkpoint_1")  # chain continued
    # a checkpoint of 2 data-parallel processes loads into 1 (the weights here)
    solo = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "solo")))
    model = solo.prepare(tiny_gpt2())
    DynaQuantPlugin(threshold=None).attach(solo, model)
    solo.load_state(str(two / "checkpoints" / "checkpoint_1"))
    state = read_checkpoint(two_store, "checkpoint_1")[0]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.slow
def test_kill_and_resume_two_processes(tmp_path) -> None:
    """SIGKILL both training processes after a checkpoint, then resume from the newest complete one."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    cmd += [str(EXAMPLE), "--cpu", "--output-dir", str(out), "--steps", "40", "--save-steps", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "checkpoints" / "checkpoint_1" / MARKER).exists():
        if proc.poll() is not None:
            pytest.fail(f"training ended early: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "rank0-train.json").exists()  # killed mid-run
    cmd[6] = str(_free_port())
    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    ranks = _ranks(out, "resume")
    assert len(ranks) == 2 and ranks[0]["resumed_step"] == ranks[1]["resumed_step"] >= 10
    assert ranks[0]["resumed_digest"] == ranks[1]["resumed_digest"]
    assert [r["final_step"] for r in ranks] == [40, 40]
    assert checkpoint_store(out).verify() == []
    store = checkpoint_store(out)
    newest = max(store.refs(), key=lambda ref: int(ref.split("_")[1]))
    shutil.rmtree(out / "checkpoints")  # every folder lost: the store alone rebuilds the newest
    assert last_complete_checkpoint(out / "checkpoints", store=store) == out / "checkpoints" / newest
    assert read_marker(out / "checkpoints" / newest)["ref"] == newest


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
