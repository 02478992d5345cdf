"""The Trainer integration over a real training run (the paper's 9.1, at small scale).

Run it with::

    python benchmarks/bench_trainer.py      # options: --steps 480 --save-steps 40 --restores 10
                                            #   --modes compress,lossless,drop --seeds 0,1,2
                                            #   --json PATH --plot PATH
                                            #   --width 128 --layers 2 (the model)
                                            #   --bins 4,6,... (the search's bin counts)
                                            #   --moments 'key=value ...' (MomentQuant settings)

One job, run from several seeds (``--seeds``, default 0,1,2: the model's initialisation and the
Trainer's seed): a character-level GPT-2 (2 layers, 128 wide, 0.43 M parameters) trained with
AdamW (lr 1e-3, warm-up 20 steps, linear decay) on the standard library's docstrings, batch 16 x
64 characters, a checkpoint every ``--save-steps`` steps. It runs several ways, one after the
other in this process, each from the same seed, for every seed:

* **plain**: ``transformers.Trainer``, uncompressed checkpoints (the reference);
* **dynaquant/<mode>** for each optimizer-state mode: ``DynaQuantTrainer`` with the default
  ``DynaQuantCallback(threshold=0.01)`` (``compress@0.05``: the same at a 5% threshold;
  searched configuration, delta chains, keyframe every 10),
  and ``--restores`` restores spread over the run: training stops right after checkpoint k
  (k = 1..restores) and a *new* trainer resumes from that compressed checkpoint
  (``resume_from_checkpoint=True``), so the run ends having restored weights, optimizer state,
  scheduler and RNG from compressed checkpoints ``--restores`` times.

Reported, as mean ± sample standard deviation over the seeds: final eval loss (64 held-out
blocks) relative to the plain run of the same seed (beside the plain runs' own spread over the
seeds, which is the noise a difference must clear to mean anything); the on-disk size of
all checkpoints (weights only, and weights + optimizer state) against the plain Trainer's
``model.safetensors`` and ``optimizer.pt``; and the training stall per save, i.e. the time the
training loop is blocked by a save: ``Trainer._save_checkpoint`` for the plain run, and that plus
``on_save`` (snapshot to the CPU, hand-off to the background worker) for DynaQuant; the
background encoding time is reported apart. A per-checkpoint ratio plot (the paper's Fig. 9) is
written to ``benchmarks/out/trainer_ratios.png`` (first seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from hf_dynaquant.checkpoint_dir import checkpoint_store
from hf_dynaquant.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.optimizer_state import MomentQuant
from hf_dynaquant.search import SearchSpace

OUT = Path(__file__).resolve().parent / "out"


def make_model(width: int = 128, layers: int = 2, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=CharTokenizer().vocab_size,
        n_positions=64,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def training_args(out: Path, steps: int, save_steps: int, seed: int = 0) -> TrainingArguments:
    return TrainingArguments(
        str(out),
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=20,
        save_steps=save_steps,
        logging_steps=save_steps,
        report_to=[],
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        log_level="error",
    )


class StopAfter(TrainerCallback):
    """Ends training right after the checkpoint at ``step`` (a restore point)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step >= self.step:
            control.should_training_stop = True


def timed_saves(cls):
    """A subclass of ``cls`` recording the seconds each ``_save_checkpoint`` blocks training."""

    class Timed(cls):
        save_seconds: list[float] = []

        def _save_checkpoint(self, model, trial):
            started = time.perf_counter()
            super()._save_checkpoint(model, trial)
            Timed.save_seconds.append(time.perf_counter() - started)

    return Timed


def run_plain(
    out: Path, data, steps: int, save_steps: int, make: Callable[[], GPT2LMHeadModel] = make_model, seed: int = 0
) -> dict:
    train, held = data
    cls = timed_saves(Trainer)
    cls.save_seconds = []
    args = training_args(out, steps, save_steps, seed)
    trainer = cls(model=make(), args=args, train_dataset=train, eval_dataset=held)
    trainer.train()
    weights = optimizer = 0
    for folder in sorted(out.glob("checkpoint-*")):
        weights += (folder / "model.safetensors").stat().st_size
        optimizer += (folder / "optimizer.pt").stat().st_size
    return {
        "eval_loss": trainer.evaluate()["eval_loss"],
        "weights_bytes": weights,
        "optimizer_bytes": optimizer,
        "stall": cls.save_seconds,
    }


def run_dynaquant(
    out: Path,
    data,
    steps: int,
    save_steps: int,
    spec: str,
    restores: int,
    space: SearchSpace | None = None,
    moments: MomentQuant | None = None,
    make: Callable[[], GPT2LMHeadModel] = make_model,
    seed: int = 0,
) -> dict:
    """One compressed run; ``spec`` is an optimizer-state mode, optionally ``@threshold``."""
    mode, _, threshold = spec.partition("@")
    train, held = data
    cls = timed_saves(DynaQuantTrainer)
    stops = [save_steps * k for k in range(1, restores + 1) if save_steps * k < steps] + [None]
    reports, stalls, background = [], [], []
    trainer = None
    for i, stop in enumerate(stops):
        cb = DynaQuantCallback(
            threshold=float(threshold or 0.01), optimizer_state=mode, search_space=space, moment_quant=moments
        )
        trainer = cls(
            model=make(),
            args=training_args(out, steps, save_steps, seed),
            train_dataset=train,
            eval_dataset=held,
            callbacks=[cb, StopAfter(stop)],
        )
        trainer.train(resume_from_checkpoint=True if i else None)
        reports += cb.reports
        stalls += [r["dynaquant/stall_seconds"] for r in cb.reports]
        background += [r["dynaquant/background_seconds"] for r in cb.reports]
    store = checkpoint_store(out)
    per_checkpoint = []
    weights = optimizer = total = 0
    for ref in sorted(store.refs(), key=lambda r: int(r.split("-")[1])):
        info = store.info(ref)
        w, o = info.sections.get("model", (0, 0)), info.sections.get("optimizer", (0, 0))
        weights += w[1]
        optimizer += o[1]
        total += info.nbytes
        per_checkpoint.append(
            {
                "step": int(ref.split("-")[1]),
                "keyframe": info.base is None,
                "weights": w[1],
                "optimizer": o[1],
                "total": info.nbytes,
            }
        )
    return {
        "eval_loss": trainer.evaluate()["eval_loss"],
        "weights_bytes": weights,
        "optimizer_bytes": optimizer,
        "total_bytes": total,
        "stall": stalls,
        "background": background,
        "per_checkpoint": per_checkpoint,
        "evaluations": [r.get("dynaquant/search_evaluations", 0) for r in reports],
        "configs": [r.get("config") for r in reports],
        "restores": len(stops) - 1,
    }


def moment_settings(spec: str) -> MomentQuant:
    """``MomentQuant`` from ``key=value`` words (tuples as comma lists), over the defaults."""
    fields = {}
    for word in spec.split():
        key, _, value = word.partition("=")
        default = getattr(MomentQuant(), key)
        if isinstance(default, tuple):
            fields[key] = tuple(type(default[0])(v) for v in value.split(","))
        else:
            fields[key] = type(default)(value)
    return replace(MomentQuant(), **fields)


def mean_spread(values: list[float], fmt: str) -> str:
    """``mean ± sample standard deviation`` (just the value for one seed)."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt.lstrip('+'))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--save-steps", type=int, default=40)
    parser.add_argument("--restores", type=int, default=10)
    parser.add_argument(
        "--modes",
        default="compress,lossless,drop,compress@0.05",
        help="optimizer-state modes, @threshold (default 0.01)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the model initialisation and the Trainer")
    parser.add_argument(
        "--bins",
        default=None,
        help="bin counts the search may choose, e.g. 2,3,4,6,8,12,16,32 (default: SearchSpace's)",
    )
    parser.add_argument(
        "--moments",
        default="",
        help="MomentQuant settings as key=value, e.g. 'bins=2,3,4,6,8,16,32 min_cosine=0.7 scale_step=1.0'",
    )
    parser.add_argument("--width", type=int, default=128, help="the model's width (n_embd)")
    parser.add_argument("--layers", type=int, default=2, help="the model's transformer blocks")
    parser.add_argument("--json", default=str(OUT / "trainer.json"))
    parser.add_argument("--plot", default=str(OUT / "trainer_ratios.png"))
    args = parser.parse_args()
    data = docstring_lm_datasets(block=64, eval_blocks=64)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    space = SearchSpace(bins=tuple(int(b) for b in args.bins.split(","))) if args.bins else None
    moments = moment_settings(args.moments)
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            make = partial(make_model, args.width, args.layers, seed)
            runs = results[seed] = {"plain": run_plain(Path(tmp) / f"{seed}-plain", data, args.steps, args.save_steps, make, seed)}
            for mode in modes:
                folder = Path(tmp) / f"{seed}-{mode.replace('@', '_')}"
                runs[mode] = run_dynaquant(
                    folder, data, args.steps, args.save_steps, mode, args.restores, space, moments, make, seed
                )
                print(f"seed {seed}, {mode}: done", flush=True)
    report(results, args, seeds, modes)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    plot(results[seeds[0]], args, results[seeds[0]]["plain"])


def report(results: dict[int, dict], args, seeds: list[int], modes: list[str]) -> None:
    """The table: each figure as mean ± spread over the seeds; losses paired by seed."""
    plains = [results[s]["plain"] for s in seeds]
    plain_loss = [p["eval_loss"] for p in plains]
    n_ckpt = args.steps // args.save_steps
    print(
        f"\n{n_ckpt} checkpoints, {args.restores} restores, seeds {args.seeds}; plain Trainer: weights "
        f"{plains[0]['weights_bytes'] / 1e6:.2f} MB, with optimizer state "
        f"{(plains[0]['weights_bytes'] + plains[0]['optimizer_bytes']) / 1e6:.2f} MB, "
        f"eval loss {mean_spread(plain_loss, '.4f')} (spread over seeds: "
        f"{statistics.stdev(plain_loss) / statistics.mean(plain_loss) * 100 if len(seeds) > 1 else 0:.2f}%), "
        f"median stall per save {statistics.median([x for p in plains for x in p['stall']]) * 1e3:.0f} ms\n"
    )
    header = (
        "optimizer_state@threshold",
        "eval loss",
        "vs plain (same seed)",
        "weights ratio",
        "whole ratio",
        "stall/save ms",
        "background ms",
        "evals/ckpt",
    )
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for mode in modes:
        runs = [results[s][mode] for s in seeds]
        pairs = list(zip(runs, plains))
        row = (
            mode,
            mean_spread([r["eval_loss"] for r in runs], ".4f"),
            mean_spread([(r["eval_loss"] - p["eval_loss"]) / p["eval_loss"] * 100 for r, p in pairs], "+.2f") + "%",
            mean_spread([p["weights_bytes"] / r["weights_bytes"] for r, p in pairs], ".1f") + "x",
            mean_spread([(p["weights_bytes"] + p["optimizer_bytes"]) / r["total_bytes"] for r, p in pairs], ".1f") + "x",
            f"{statistics.median([x for r in runs for x in r['stall']]) * 1e3:.0f}",
            f"{statistics.median([x for r in runs for x in r['background']]) * 1e3:.0f}",
            f"{statistics.median([x for r in runs for x in r['evaluations']]):.0f}",
        )
        print("| " + " | ".join(row) + " |")


def plot(results: dict, args, plain: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = args.steps // args.save_steps
    per_w = plain["weights_bytes"] / n
    per_whole = (plain["weights_bytes"] + plain["optimizer_bytes"]) / n
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in args.modes.split(","):
        pcs = results[mode]["per_checkpoint"]
        steps = [p["step"] for p in pcs]
        ax.plot(steps, [per_w / p["weights"] for p in pcs], marker="o", label=f"weights ({mode})")
        if not mode.startswith("drop"):
            ax.plot(steps, [per_whole / p["total"] for p in pcs], marker="s", ls="--", label=f"whole ({mode})")
    ax.set_xlabel("training step")
    ax.set_ylabel("compression ratio vs plain Trainer")
    ax.set_title("Per-checkpoint ratio (keyframes are the dips)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
