"""transformers.Trainer with DynaQuant checkpoints: train, crash, resume, compare sizes.

Trains a small GPT-2 on the standard library's docstrings (a ``datasets.Dataset``, offline) with
``DynaQuantTrainer``: every checkpoint is DynaQuant-compressed (weights through the searched
configuration, Adam moments compressed, delta chains between keyframes). The demo starts the
training in a child process, kills it with SIGKILL once a few checkpoints are on disk, resumes
from the newest complete compressed checkpoint, then runs the same seeded job with the plain
``transformers.Trainer`` (no compression, no kill) and prints both runs' losses side by side,
and the size of every checkpoint. Run:

    python examples/trainer_callback.py [--steps 200] [--save-steps 25] [--output-dir DIR]

``--phase train`` / ``--phase resume`` run one half (the kill-and-resume test uses them);
``--phase plain`` the uncompressed run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_dynaquant import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.training.checkpoint_dir import checkpoint_store, last_complete_checkpoint


def build(output_dir: Path, steps: int, save_steps: int, compressed: bool = True) -> Trainer:
    """The same seeded job for the first run, the resumed one and the plain (uncompressed,
    checkpoint-free) one."""
    train, held = docstring_lm_datasets(block=64, eval_blocks=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=CharTokenizer().vocab_size,
            n_positions=64,
            n_embd=128,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    args = TrainingArguments(
        str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=10,
        save_steps=save_steps,
        save_strategy="steps" if compressed else "no",
        logging_steps=save_steps,
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if not compressed:
        return Trainer(model=model, args=args, train_dataset=train, eval_dataset=held)
    return DynaQuantTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=held,
        callbacks=[DynaQuantCallback(threshold=0.01, ema_steps=min(20, save_steps))],
    )


def run_phase(output_dir: Path, phase: str, steps: int, save_steps: int) -> dict:
    trainer = build(output_dir, steps, save_steps, compressed=phase != "plain")
    resumed_from = None
    if phase == "resume":
        found = last_complete_checkpoint(output_dir)
        resumed_from = found.name if found is not None else None
        trainer.train(resume_from_checkpoint=True)
    else:
        trainer.train()
    summary = {
        "phase": phase,
        "resumed_from": resumed_from,
        "global_step": trainer.state.global_step,
        "eval_loss": trainer.evaluate()["eval_loss"],
        "train_loss": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
    }
    if isinstance(trainer, DynaQuantTrainer):
        summary["reports"] = [{k: v for k, v in r.items() if k != "config"} for r in trainer.dynaquant.reports]
    (output_dir / f"summary{'-plain' if phase == 'plain' else ''}.json").write_text(json.dumps(summary, indent=2))
    return summary


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def demo(output_dir: Path, steps: int, save_steps: int) -> None:
    cmd = [
        sys.executable,
        __file__,
        "--output-dir",
        str(output_dir),
        "--steps",
        str(steps),
        "--save-steps",
        str(save_steps),
        "--phase",
        "train",
    ]
    print(f"training {steps} steps, a compressed checkpoint every {save_steps} (child process)...")
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    # killed once a third checkpoint is complete (compressed, or the Trainer's own when a save came
    # while the encoder was still busy with the one before: busy_saves="plain")
    while child.poll() is None:
        found = last_complete_checkpoint(output_dir) if output_dir.is_dir() else None
        if found is not None and int(found.name.split("-")[1]) >= save_steps * 3:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    found = last_complete_checkpoint(output_dir)
    print(f"killed the training process (SIGKILL); newest complete checkpoint: {found.name if found else None}")
    summary = run_phase(output_dir, "resume", steps, save_steps)
    print(f"resumed from {summary['resumed_from']} and finished at step {summary['global_step']}")
    print("the same job with the plain transformers.Trainer (no compression, no kill)...")
    plain = run_phase(output_dir / "plain", "plain", steps, save_steps)
    print(f"\n{'step':>6} {'train loss, plain':>18} {'with DynaQuant':>15}")
    for step, loss in plain["train_loss"].items():
        print(f"{step:>6} {loss:>18.4f} {summary['train_loss'].get(step, float('nan')):>15.4f}")
    change = summary["eval_loss"] / plain["eval_loss"] - 1
    print(
        f"{'eval':>6} {plain['eval_loss']:>18.4f} {summary['eval_loss']:>15.4f}  "
        f"({change:+.2%}: what compressed checkpoints and a resume from one cost)\n"
    )
    store = checkpoint_store(output_dir)
    print(f"{'checkpoint':>14} {'kind':>9} {'weights':>9} {'optimizer':>10} {'ratio':>7}")
    raw = stored = 0
    for name in sorted(store.refs(), key=lambda r: int(r.split("-")[1])):
        info = store.info(name)
        w, o = info.sections.get("model", (0, 0)), info.sections.get("optimizer", (0, 0))
        raw += w[0] + o[0]
        stored += info.nbytes
        kind = "keyframe" if info.base is None else "delta"
        print(
            f"{name:>14} {kind:>9} {w[0] / max(w[1], 1):>8.1f}x {o[0] / max(o[1], 1):>9.1f}x "
            f"{(w[0] + o[0]) / info.nbytes:>6.1f}x"
        )
    folders = output_dir.glob("checkpoint-*")
    uncompressed = sorted(int(f.name.split("-")[1]) for f in folders if (f / "model.safetensors").exists())
    if uncompressed:  # saves that came while the encoder was still busy (busy_saves="plain")
        print(f"saved uncompressed by the Trainer (the encoder was busy): steps {uncompressed}")
    print(
        f"\nall checkpoints: {raw / 1e6:.1f} MB of weights + optimizer state stored in "
        f"{folder_bytes(store.path) / 1e6:.2f} MB ({raw / max(folder_bytes(store.path), 1):.1f}x); "
        f"output folder {folder_bytes(output_dir) / 1e6:.2f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--phase", choices=("demo", "train", "resume", "plain"), default="demo")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.output_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if args.phase == "demo":
            demo(out, args.steps, args.save_steps)
        else:
            print(json.dumps(run_phase(out, args.phase, args.steps, args.save_steps), indent=2)[:2000])


if __name__ == "__main__":
    main()
