"""The Trainer on a GPU at 350M+ parameters: what a save costs the training loop (issue 16, item 7).

Run it on a machine with a GPU::

    python benchmarks/bench_gpu.py      # options: --layers 28 --width 1024 --heads 16 --context 512
                                        #   --batch 16 --steps 400 --save-steps 100 --eval-examples 16
                                        #   --search-seconds S --arms plain,dynaquant,dcp
                                        #   --json PATH --plot PATH --package DIR

A character-level GPT-2 (28 blocks x 1024 wide by default: 353 M parameters, built from its
config, nothing downloaded) is trained from scratch in bf16 mixed precision (``bf16=True``: fp32
master weights and AdamW moments, bf16 autocast) on the standard library's docstrings, batch
16 x 512 characters, a checkpoint every ``--save-steps`` steps. Each arm runs in its own process
(so that its peak host memory is its own), from the same seed, one after the other:

* **plain**: ``transformers.Trainer`` and its own checkpoints (``model.safetensors``,
  ``optimizer.pt``, ...);
* **dynaquant**: ``DynaQuantTrainer`` with ``DynaQuantCallback(eval_examples=...)``, its defaults
  otherwise (the configuration search, compressed optimizer state, the background encoder; a
  save that arrives while the encoder is still busy is saved plainly, ``busy_saves="plain"``);
* **dynaquant-host** (not run by default): the same with ``use_accelerator=False``: the snapshot
  copied straight into host memory and the search evaluated on a CPU copy of the model, as
  before session 11;
* **dcp**: ``transformers.Trainer`` whose ``_save_checkpoint`` is
  ``torch.distributed.checkpoint.async_save`` of the model's and optimizer's state dicts
  (``get_state_dict``), the previous save awaited first: PyTorch's own non-blocking checkpoint.

Reported per arm: the **stall per save** (the time ``Trainer._maybe_log_save_evaluate`` blocks the
loop on a save step, the Trainer's save and every ``on_save`` included, after a
``torch.cuda.synchronize()`` so that no queued training kernel is counted), the training's wall
time up to the last optimizer step and the **final wait** after it (``train()`` returns once the
last checkpoint is written: DynaQuant's ``on_train_end`` waits for the encoder; for DCP the
bench awaits the last ``async_save``), the **step time** (each optimizer step's, median: over the
steps that began while a save worked in the background, and over the others; for DynaQuant also
the steps with no save beside them, in the gradient window before a save and outside it), the
**background seconds** per checkpoint (DCP: from ``async_save``'s return until its write is done;
DynaQuant: the encoder's time, and the parts of it that moved the staged snapshot into host
memory and that searched the configuration), the
stored bytes against the plain checkpoint (fp32 weights + AdamW state), the **peak extra host
memory** (the resident set sampled every 20 ms, above its value after the first optimizer step,
in units of the plain checkpoint's bytes), peak GPU memory, the final eval loss and, for
DynaQuant, the eval loss of its last compressed checkpoint decoded into a fresh model against the
live model's at that save (every arm evaluates at its saves; that time is not counted as stall). Prints a markdown
table, writes the JSON and a plot of the stalls (``benchmarks/out/gpu.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

OUT = Path(__file__).resolve().parent / "out"
ARMS = ("plain", "dynaquant", "dcp", "dynaquant-host")
OURS = ("dynaquant", "dynaquant-host")


class Blocks(torch.utils.data.Dataset):
    """Causal-LM examples from rows of token ids (no ``datasets`` needed on a GPU machine)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def datasets(context: int, eval_blocks: int) -> tuple[Blocks, Blocks, int]:
    """``(train, eval, vocabulary size)``: the docstring corpus in blocks of ``context``
    characters, the last ``eval_blocks`` held out."""
    from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_corpus

    tokenizer = CharTokenizer()
    ids = tokenizer.encode(docstring_corpus())
    n = ids.numel() // context
    rows = ids[: n * context].view(n, context)
    return Blocks(rows[: n - eval_blocks]), Blocks(rows[n - eval_blocks :]), tokenizer.vocab_size


def make_model(a: argparse.Namespace, vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(a.seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=a.context,
        n_embd=a.width,
        n_layer=a.layers,
        n_head=a.heads,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class HostMemory(threading.Thread):
    """Samples this process's resident set every 20 ms; :meth:`start_counting` sets the
    baseline, :attr:`peak_extra` is the largest excess over it since."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process, self.baseline, self.peak = psutil.Process(), None, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            rss = self.process.memory_info().rss
            if self.baseline is not None:
                self.peak = max(self.peak, rss)

    def start_counting(self) -> None:
        if self.baseline is None:
            self.baseline = self.peak = self.process.memory_info().rss

    @property
    def peak_extra(self) -> int:
        return max(self.peak - (self.baseline or 0), 0)


class EvalAtSave(TrainerCallback):
    """Evaluates the live model at every save (so that a decoded checkpoint can be compared with
    the model it was taken from); its seconds are left out of the stall."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.losses: dict[int, float] = {}
        self.seconds = 0.0

    def on_save(self, args, state, control, **kwargs):
        started = time.perf_counter()
        self.losses[state.global_step] = self.trainer.evaluate()["eval_loss"]
        self.seconds += time.perf_counter() - started


class StepTimes(TrainerCallback):
    """Each optimizer step's seconds, from ``on_step_begin`` to ``on_step_end`` (the save after
    a step is not in it), with when it began: against the windows in which a save was encoding in
    the background, they tell how much a save slows the steps that run beside it."""

    def __init__(self) -> None:
        self.began: list[float] = []
        self.seconds: list[float] = []
        self._at = float("nan")

    def on_step_begin(self, args, state, control, **kwargs):
        self._at = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.began.append(self._at)
        self.seconds.append(time.perf_counter() - self._at)


class LastStep(TrainerCallback):
    """Records when the last optimizer step ended (before the last save and the final wait)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.at = steps, float("nan")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.steps:
            self.at = time.perf_counter()


class Baseline(TrainerCallback):
    """Sets the memory baseline once the first optimizer step has created AdamW's state."""

    def __init__(self, memory: HostMemory) -> None:
        self.memory = memory

    def on_step_end(self, args, state, control, **kwargs):
        self.memory.start_counting()


def timed(cls: type[Trainer]) -> type[Trainer]:
    """``cls`` recording how long each save step blocks the training loop."""

    class Timed(cls):
        stalls: list[float] = []
        saved_at: dict[int, float] = {}  # step -> when its save returned to the loop
        evaluator = EvalAtSave()

        def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> Any:
            if not self.control.should_save:
                return super()._maybe_log_save_evaluate(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started, evaluating = time.perf_counter(), Timed.evaluator.seconds
            result = super()._maybe_log_save_evaluate(*args, **kwargs)
            Timed.stalls.append(time.perf_counter() - started - (Timed.evaluator.seconds - evaluating))
            Timed.saved_at[self.state.global_step] = time.perf_counter()
            return result

    return Timed


class DCPTrainer(Trainer):
    """Saves with ``torch.distributed.checkpoint.async_save`` (model and optimizer state dicts);
    the previous save is awaited before the next one starts."""

    background: list[float] = []

    def _save_checkpoint(self, model, trial) -> None:
        import inspect

        import torch.distributed as dist
        from torch.distributed.checkpoint import async_save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if getattr(self, "_future", None) is not None:
            self._future.result()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        kwargs: dict[str, Any] = {}
        if not (dist.is_available() and dist.is_initialized()):
            if "no_dist" in inspect.signature(async_save).parameters:
                kwargs["no_dist"] = True
            else:  # an older torch: a one-process group
                dist.init_process_group("gloo", init_method=f"file://{folder.parent}/pg", rank=0, world_size=1)
        self._future = async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder),
                                  **kwargs)
        returned = time.perf_counter()
        self._future.add_done_callback(lambda _: DCPTrainer.background.append(time.perf_counter() - returned))

    def wait(self) -> None:
        if getattr(self, "_future", None) is not None:
            self._future.result()


def training_args(a: argparse.Namespace, out: Path, cuda: bool) -> TrainingArguments:
    return TrainingArguments(
        str(out),
        max_steps=a.steps,
        save_steps=a.save_steps,
        logging_steps=a.save_steps,
        eval_strategy="no",
        per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=16,
        learning_rate=3e-4,
        warmup_steps=min(20, a.steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        bf16=cuda,
        use_cpu=not cuda,
        report_to=[],
        seed=a.seed,
        disable_tqdm=True,
        log_level="error",
    )


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def run_arm(a: argparse.Namespace) -> dict[str, Any]:
    """One arm, in this process."""
    cuda = torch.cuda.is_available()
    train, held, vocab = datasets(a.context, a.eval_blocks)
    memory = HostMemory()
    memory.start()
    out = Path(a.workdir) / a.arm
    shutil.rmtree(out, ignore_errors=True)
    last_step, step_times = LastStep(a.steps), StepTimes()
    callbacks: list[TrainerCallback] = [Baseline(memory), last_step, step_times]  # (the evaluation at saves goes last)
    search_seconds: list[float] = []
    search_devices: list[str] = []
    settle_seconds: list[float] = []
    if a.arm in OURS:
        from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
        from hf_dynaquant.search import ConfigurationSearch
        from hf_dynaquant.training.snapshot import Snapshot

        search, settle = ConfigurationSearch.search, Snapshot.settle

        def timed_settle(self) -> None:  # the move of a snapshot staged on the device into host memory
            staged, started = self.staged is not None, time.perf_counter()
            try:
                settle(self)
            finally:
                if staged:
                    settle_seconds.append(time.perf_counter() - started)

        Snapshot.settle = timed_settle

        def timed_search(self, model, *args: Any, **kwargs: Any) -> Any:  # the search's share of the background
            search_devices.append(str(next(model.parameters()).device))
            started = time.perf_counter()
            try:
                return search(self, model, *args, **kwargs)
            finally:
                search_seconds.append(time.perf_counter() - started)

        ConfigurationSearch.search = timed_search
        callback = DynaQuantCallback(
            eval_examples=a.eval_examples, search_seconds=a.search_seconds, use_accelerator=a.arm == "dynaquant"
        )
        callbacks.append(callback)
        cls = timed(DynaQuantTrainer)
    else:
        cls = timed(DCPTrainer if a.arm == "dcp" else Trainer)
    model = make_model(a, vocab)
    params = sum(p.numel() for p in model.parameters())
    trainer = cls(model=model, args=training_args(a, out, cuda), train_dataset=train, eval_dataset=held,
                  callbacks=[*callbacks, cls.evaluator])
    cls.evaluator.trainer = trainer
    started = time.perf_counter()
    trainer.train()
    if a.arm == "dcp":
        trainer.wait()
    train_seconds = time.perf_counter() - started
    memory.done.set()
    result: dict[str, Any] = {
        "arm": a.arm,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "package": str(Path(sys.modules["hf_dynaquant"].__file__).parent) if "hf_dynaquant" in sys.modules else None,
        "params": params,
        "checkpoint_bytes": 12 * params,  # fp32 weights + two fp32 AdamW moments
        "stalls": list(cls.stalls),
        "train_seconds": train_seconds,
        "steps_seconds": last_step.at - started,  # up to the end of the last optimizer step
        "final_wait_seconds": train_seconds - (last_step.at - started),
        "eval_loss": trainer.evaluate()["eval_loss"],
        "peak_extra_host_bytes": memory.peak_extra,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "disk_bytes": folder_bytes(out),
        "saves": len(cls.stalls),
        "eval_at_save": cls.evaluator.losses,
        "step_seconds": list(step_times.seconds),
    }
    if a.arm == "dcp":
        result["background"] = list(DCPTrainer.background)
        windows = [(cls.saved_at[s], cls.saved_at[s] + b) for s, b in zip(sorted(cls.saved_at), DCPTrainer.background)]
        result["busy_steps"] = busy(step_times, windows)
    if a.arm in OURS:
        from _runs import load_final_checkpoint, store_figures

        reports = callback.reports
        result.update(
            background=[r["dynaquant/background_seconds"] for r in reports],
            callback_stalls=[r["dynaquant/stall_seconds"] for r in reports],
            search_seconds=search_seconds,
            search_devices=search_devices,
            settle_seconds=settle_seconds,
            ema_steps=callback.settings.ema_steps,
            evaluations=[r.get("dynaquant/search_evaluations", 0) for r in reports],
            plain_steps=callback.plain_steps,
            compressed_steps=[r["step"] for r in reports],
            busy_steps=busy(
                step_times,
                [(cls.saved_at[r["step"]], cls.saved_at[r["step"]] + r["dynaquant/background_seconds"])
                 for r in reports],
            ),
            **{k: v for k, v in store_figures(out).items() if k != "per_checkpoint"},
        )
        fresh = make_model(a, vocab).to(trainer.model.device)
        ref = load_final_checkpoint(out, fresh)
        trainer.model = trainer.model_wrapped = fresh
        result["decoded_step"] = int(ref.rsplit("-", 1)[1])
        result["decoded_eval_loss"] = trainer.evaluate()["eval_loss"]
    if a.arm == "plain":
        from _runs import plain_sizes

        result.update(plain_sizes(out))
    shutil.rmtree(out, ignore_errors=True)
    return result


def busy(steps: StepTimes, windows: list[tuple[float, float]]) -> list[bool]:
    """For each step, whether it began while a save was encoding in the background (a window
    from the save's return to the loop until its background work ended)."""
    return [any(lo <= t < hi for lo, hi in windows) for t in steps.began]


def step_ms(r: dict[str, Any]) -> str:
    """Median step in ms; where saves worked in the background, beside one / with none."""
    steps, flags = r.get("step_seconds", []), r.get("busy_steps")
    if not flags or not any(flags):
        return median_ms(steps)
    return (f"{median_ms(steps)} ({median_ms([s for s, f in zip(steps, flags) if f])} / "
            f"{median_ms([s for s, f in zip(steps, flags) if not f])})")


def window_ms(r: dict[str, Any], save_steps: int) -> str:
    """Median step in ms of the steps with no save working beside them: those in the gradient
    window (the ``ema_steps`` steps up to each save, where DynaQuant records the gradient EMA) /
    the others."""
    steps, flags = r.get("step_seconds", []), r.get("busy_steps") or [False] * len(r.get("step_seconds", []))
    window = [-(i + 1) % save_steps < r["ema_steps"] for i in range(len(steps))]  # (step i + 1 of the run)
    free = [(s, w) for s, w, f in zip(steps, window, flags) if not f]
    return f"{median_ms([s for s, w in free if w])} / {median_ms([s for s, w in free if not w])} ms"


def median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f}" if xs else "-"


def report(results: list[dict[str, Any]], a: argparse.Namespace) -> None:
    first = results[0]
    ckpt = first["checkpoint_bytes"]
    print(
        f"\n{first['device']}: GPT-2 {a.layers}x{a.width}, {first['params'] / 1e6:.0f} M parameters, "
        f"{'fp32 on the CPU' if first['device'] == 'cpu' else 'bf16 mixed precision'}, {a.steps} steps, a save every {a.save_steps}; checkpoint (fp32 weights + AdamW) "
        f"{ckpt / 1e9:.2f} GB; hf_dynaquant from {first.get('package')}\n"
    )
    header = ("arm", "stall/save ms (median)", "stall max ms", "train s (steps + final wait)",
              "step ms (median; beside a background save / not)", "background s/ckpt", "stored GB", "ratio",
              "peak extra host (x ckpt)", "peak GPU GB", "eval loss")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    plain = next((r for r in results if r["arm"] == "plain"), None)
    for r in results:
        stored = r.get("total_bytes") or r["disk_bytes"]
        raw = (plain["weights_bytes"] + plain["optimizer_bytes"]) * len(r.get("compressed_steps", [])) / max(
            plain["saves"], 1) if plain and r["arm"] in OURS else None
        row = (
            r["arm"],
            median_ms(r["stalls"]),
            f"{max(r['stalls']) * 1e3:.0f}" if r["stalls"] else "-",
            f"{r['train_seconds']:.1f} ({r['steps_seconds']:.1f} + {r['final_wait_seconds']:.1f})",
            step_ms(r),
            f"{statistics.median(r['background']):.1f}" if r.get("background") else "-",
            f"{stored / 1e9:.3f}",
            f"{raw / stored:.1f}x" if raw else "-",
            f"{r['peak_extra_host_bytes'] / 1e9:.2f} GB ({r['peak_extra_host_bytes'] / ckpt:.2f}x)",
            f"{r['peak_gpu_bytes'] / 1e9:.1f}",
            f"{r['eval_loss']:.4f}",
        )
        print("| " + " | ".join(row) + " |")
    for r in results:
        if r["arm"] in OURS:
            live = r["eval_at_save"][str(r["decoded_step"])]
            print(
                f"\n{r['arm']}: compressed steps {r['compressed_steps']} (stalls "
                f"{[round(r['stalls'][s // a.save_steps - 1] * 1e3) for s in r['compressed_steps']]} ms), "
                f"saved plainly (encoder busy) "
                f"{r['plain_steps']}; search seconds per checkpoint {[round(s, 1) for s in r['search_seconds']]} "
                f"(evaluated on {sorted(set(r['search_devices']))}), "
                f"evaluations {r['evaluations']}; background seconds {[round(s, 1) for s in r['background']]} "
                f"(moving the staged snapshot to host memory {[round(s, 1) for s in r['settle_seconds']]}); "
                f"steps with no save beside them, in the gradient window / not: {window_ms(r, a.save_steps)}; "
                f"weights {r['weights_bytes'] / 1e6:.1f} MB, optimizer {r['optimizer_bytes'] / 1e6:.1f} MB; "
                f"last compressed checkpoint (step {r['decoded_step']}) decoded: eval loss "
                f"{r['decoded_eval_loss']:.4f} ({(r['decoded_eval_loss'] - live) / live * 100:+.2f}% against the "
                f"model it was taken from, {live:.4f})"
            )


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r["stalls"]) + 1), [s * 1e3 for s in r["stalls"]], marker="o", label=r["arm"])
    ax.set_yscale("log")
    ax.set_xlabel("save")
    ax.set_ylabel("stall per save (ms)")
    ax.set_title(f"{results[0]['device']}: {results[0]['params'] / 1e6:.0f} M parameters")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--eval-examples", type=int, default=16, help="the configuration search's examples")
    parser.add_argument("--search-seconds", type=float, default=None, help="bound on each checkpoint's search")
    parser.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks of the final evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="plain,dynaquant,dcp", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--arm-timeout", type=float, default=600, help="seconds an arm may take")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=str(OUT / "gpu.json"))
    parser.add_argument("--plot", default=str(OUT / "gpu.png"))
    parser.add_argument(
        "--package", default=None, help="import hf_dynaquant from this folder (another commit's: compare on one machine)"
    )
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # run one arm here, print its JSON
    a = parser.parse_args()
    if a.arm:
        print("RESULT " + json.dumps(run_arm(a)), flush=True)
        return
    results = []
    here = Path(__file__).resolve().parent
    package = str(Path(a.package).resolve()) if a.package else str(here.parent)
    paths = [str(here), package, *filter(None, [os.environ.get("PYTHONPATH")])]
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for arm in a.arms.split(","):
            argv = [arg for arg in sys.argv[1:] if not arg.startswith("--workdir")]
            cmd = [sys.executable, __file__, *argv, "--arm", arm, "--workdir", tmp]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.arm_timeout,
                                      env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
            except subprocess.TimeoutExpired as e:
                print(f"{arm}: timed out after {a.arm_timeout:.0f} s\n{(e.stderr or b'')[-3000:]!r}", flush=True)
                continue
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{arm}: failed (exit {done.returncode})\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}", flush=True)
                continue
            results.append(json.loads(line[len("RESULT "):]))
            print(f"{arm}: done ({results[-1]['train_seconds']:.0f} s of training)", flush=True)
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    if results:
        report(results, a)
        plot(results, a.plot)


if __name__ == "__main__":
    main()
