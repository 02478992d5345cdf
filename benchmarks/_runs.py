"""Pieces shared by the Trainer benchmarks (``bench_trainer.py``, ``bench_finetune.py``): a run
restored from its compressed checkpoints several times, the sizes and per-checkpoint choices read
back from the store, the final checkpoint decoded on its own, the callback's settings from the
command line, and the ``mean ± spread`` figures.

A *restore* is a crash and resume: training stops right after checkpoint k (:class:`StopAfter`)
and a *new* trainer, with a new model, resumes from that compressed checkpoint
(``resume_from_checkpoint=True``), so weights, optimizer state, scheduler and RNG all come back
from the store.
"""

from __future__ import annotations

import ast
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.training.checkpoint_dir import checkpoint_store
from hf_dynaquant.training.compressor import load_weights
from hf_dynaquant.training.settings import CheckpointSettings


class StopAfter(TrainerCallback):
    """Ends training right after the checkpoint at ``step`` (a restore point)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step >= self.step:
            control.should_training_stop = True


def timed_saves(cls: type[Trainer]) -> type[Trainer]:
    """A subclass of ``cls`` recording the seconds each ``_save_checkpoint`` blocks training."""

    class Timed(cls):
        save_seconds: list[float] = []

        def _save_checkpoint(self, model, trial):
            started = time.perf_counter()
            super()._save_checkpoint(model, trial)
            Timed.save_seconds.append(time.perf_counter() - started)

    return Timed


def training_args(out: Path, steps: int, save_steps: int, seed: int, **settings: Any) -> TrainingArguments:
    """The benchmarks' ``TrainingArguments``: ``steps`` optimizer steps on the CPU, a checkpoint,
    a log line and an evaluation every ``save_steps``, quiet; ``settings`` add the job's own."""
    return TrainingArguments(
        str(out),
        max_steps=steps,
        eval_strategy="steps",
        eval_steps=save_steps,
        save_steps=save_steps,
        logging_steps=save_steps,
        report_to=[],
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        log_level="error",
        **settings,
    )


def restore_points(steps: int, save_steps: int, restores: int) -> list[int]:
    """The steps after which a run crashes and resumes: ``restores`` checkpoints spread evenly
    over the run (the last checkpoint, at the end of training, is never one)."""
    checkpoints = [save_steps * k for k in range(1, steps // save_steps + 1) if save_steps * k < steps]
    if restores >= len(checkpoints):
        return checkpoints
    picks = torch.linspace(0, len(checkpoints) - 1, restores).round().long().unique().tolist()
    return [checkpoints[i] for i in picks]


def callback_settings(spec: str) -> dict[str, Any]:
    """``DynaQuantCallback`` keyword arguments from ``key=value`` words, e.g.
    ``'threshold=0.01 pretrained=auto eval_batches=8'``. Values are Python literals where they
    parse as one (numbers, ``None``, ``True``, tuples), strings otherwise; a key the callback does
    not take is a ``SystemExit`` naming the keys it does take (so the same script measures the
    settings of newer versions without a change)."""
    named = inspect.signature(DynaQuantCallback.__init__).parameters
    known = [p for p in named if p not in ("self", "settings", "shortcuts")]
    known += [f.name for f in dataclass_fields(CheckpointSettings)]
    settings: dict[str, Any] = {}
    for word in spec.split():
        key, sep, value = word.partition("=")
        if not sep:
            raise SystemExit(f"--callback: {word!r} is not key=value")
        if key not in known:
            raise SystemExit(f"--callback: DynaQuantCallback takes no {key!r} (its settings: {', '.join(known)})")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


def dataclass_settings(cls: type, spec: str) -> Any:
    """An instance of the dataclass ``cls`` (``MomentQuant``, ``SearchSpace``) from ``key=value``
    words over its defaults; a tuple field takes a comma list of values of its first element's type."""
    default = cls()
    fields = {}
    for word in spec.split():
        key, _, value = word.partition("=")
        if not hasattr(default, key):
            raise SystemExit(f"{cls.__name__} has no setting {key!r}")
        current = getattr(default, key)
        if isinstance(current, tuple):
            fields[key] = tuple(type(current[0])(v) for v in value.split(","))
        else:
            fields[key] = type(current)(value)
    return replace(default, **fields)


def run_restored(
    make_trainer: Callable[[list[TrainerCallback]], Trainer],
    stops: list[int],
    settings: dict[str, Any],
) -> tuple[Trainer, list[dict[str, Any]]]:
    """Train with ``DynaQuantCallback(**settings)``, crashing and resuming after each step in
    ``stops``; ``make_trainer(callbacks)`` builds a new ``DynaQuantTrainer`` (a new model) each
    time. Returns the last trainer (its ``state.log_history`` covers the whole run) and the
    callbacks' reports, in order."""
    reports: list[dict[str, Any]] = []
    trainer = None
    for i, stop in enumerate([*stops, None]):
        # every checkpoint compressed, so that the figures do not depend on how fast this machine is
        callback = DynaQuantCallback(**{"busy_saves": "wait", **settings})
        trainer = make_trainer([callback, StopAfter(stop)])
        if not isinstance(trainer, DynaQuantTrainer):
            raise TypeError(f"make_trainer must build a DynaQuantTrainer, got {type(trainer).__name__}")
        trainer.train(resume_from_checkpoint=True if i else None)
        reports += callback.reports
    assert trainer is not None
    return trainer, reports


def checkpoint_choice(metadata: dict[str, Any]) -> dict[str, Any]:
    """What the store's entry metadata says was chosen for one checkpoint: the quantization
    (``residual`` where the format records one, else ``"none"``; a searched peer's knob under
    ``bins``), the search's measured degradation and mode, and the optimizer-state coding."""
    config = metadata.get("quant_config") or {}
    search = metadata.get("search") or {}
    peer = (search.get("config") or {}) if search.get("codec") else {}  # a peer's searched knob (search.peers)
    return {
        "residual": config.get("residual", "none") if config else None,
        "bins": config.get("bins") or ", ".join(f"{k}={v}" for k, v in peer.items()) or None,
        "prune": config.get("prune"),
        "protect": config.get("protect"),
        "degradation": search.get("degradation"),
        "search": search.get("mode"),
        "evaluations": search.get("evaluations"),
        "optimizer_state": (metadata.get("optimizer_state") or {}).get("mode"),
    }


def store_figures(out: Path) -> dict[str, Any]:
    """Sizes (weights, optimizer, whole entry) and choices of every checkpoint in the run
    folder's store, in step order, with their totals."""
    store = checkpoint_store(out, create=False)
    per_checkpoint = []
    for ref in sorted(store.refs(), key=lambda r: int(r.rsplit("-", 1)[1])):
        info = store.info(ref)
        per_checkpoint.append(
            {
                "step": int(ref.rsplit("-", 1)[1]),
                "keyframe": info.base is None,
                "weights": info.sections.get("model", (0, 0))[1],
                "optimizer": info.sections.get("optimizer", (0, 0))[1],
                "total": info.nbytes,
                **checkpoint_choice(info.metadata),
            }
        )
    return {
        "weights_bytes": sum(p["weights"] for p in per_checkpoint),
        "optimizer_bytes": sum(p["optimizer"] for p in per_checkpoint),
        "total_bytes": sum(p["total"] for p in per_checkpoint),
        "disk_bytes": _folder_bytes(out),
        "per_checkpoint": per_checkpoint,
    }


def plain_sizes(out: Path) -> dict[str, int]:
    """Bytes of the plain Trainer's ``model.safetensors`` and ``optimizer.pt`` over all
    checkpoints, and of every file of its checkpoint folders."""
    folders = sorted(out.glob("checkpoint-*"))
    return {
        "weights_bytes": sum((f / "model.safetensors").stat().st_size for f in folders),
        "optimizer_bytes": sum((f / "optimizer.pt").stat().st_size for f in folders),
        "disk_bytes": sum(_folder_bytes(f) for f in folders),
    }


def _folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def ratios(plain: dict[str, Any], compressed: dict[str, Any]) -> dict[str, float]:
    """The plain run's bytes over the compressed run's, counting the same things on both sides:
    ``weights`` (``model.safetensors`` against the store's model sections), ``whole`` (weights +
    optimizer state: with ``optimizer.pt`` against the optimizer sections) and ``disk`` (every
    byte of the run's checkpoints: the plain checkpoint folders against ours, small files, RNG
    and scheduler state and the store included)."""
    whole = compressed["weights_bytes"] + compressed["optimizer_bytes"]
    return {
        "weights": plain["weights_bytes"] / compressed["weights_bytes"],
        "whole": (plain["weights_bytes"] + plain["optimizer_bytes"]) / whole,
        "disk": plain["disk_bytes"] / compressed["disk_bytes"],
    }


def load_final_checkpoint(out: Path, model: torch.nn.Module) -> str:
    """Decode the weights of the run's last compressed checkpoint into ``model`` (as a resume
    would); returns its reference."""
    store = checkpoint_store(out, create=False)
    ref = max(store.refs(), key=lambda r: int(r.rsplit("-", 1)[1]))
    with store.open(ref) as entry:
        load_weights(model, entry, f"{out}/{ref}")
    return ref


def eval_curve(trainer: Trainer, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every evaluation the run logged under ``key`` (e.g. ``eval_loss``)."""
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def mean_spread(values: list[float], fmt: str) -> str:
    """``mean ± sample standard deviation`` (just the value for one seed)."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt.lstrip('+'))}"


def relative_spread(values: list[float]) -> float:
    """Sample standard deviation over the mean, in percent (0 for one value)."""
    return statistics.stdev(values) / abs(statistics.mean(values)) * 100 if len(values) > 1 else 0.0


def choices_table(per_checkpoint: list[dict[str, Any]]) -> str:
    """A markdown table of the per-checkpoint choices of one run."""
    lines = [
        "| step | keyframe | residual | bins | prune | protect | degradation | search | optimizer state "
        "| weights KB | entry KB |",
        "|" + "---|" * 11,
    ]
    for p in per_checkpoint:
        degradation = "" if p["degradation"] is None else f"{p['degradation'] * 100:+.3f}%"
        lines.append(
            f"| {p['step']} | {'yes' if p['keyframe'] else ''} | {p['residual']} | {p['bins']} | {p['prune']} | "
            f"{p['protect']} | {degradation} | {p['search']} | {p['optimizer_state']} | {p['weights'] / 1e3:.1f} | "
            f"{p['total'] / 1e3:.1f} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str, title: str, ylabel: str, key: str = "compressed") -> None:
    """Left: the evaluation curve of the plain and the compressed run, restore points marked;
    right: each checkpoint's weights and whole ratio against the plain Trainer's files. ``result``
    holds ``"plain"`` and ``result[key]`` (the compressed run) as the benchmarks record them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain, compressed = result["plain"], result[key]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run, style in ((plain, "-"), (compressed, "--")):
        steps, values = zip(*run["curve"])
        left.plot(steps, values, style, marker=".", label="plain Trainer" if run is plain else "compressed + restores")
    for i, step in enumerate(compressed["restores"]):
        left.axvline(step, color="grey", lw=0.6, ls=":", label="restore" if i == 0 else None)
    left.set_xlabel("training step")
    left.set_ylabel(ylabel)
    left.set_title(title)
    left.legend(fontsize=8)
    pcs = compressed["per_checkpoint"]
    n = len(pcs)
    steps = [p["step"] for p in pcs]
    right.plot(steps, [plain["weights_bytes"] / n / p["weights"] for p in pcs], marker="o", label="weights")
    whole = (plain["weights_bytes"] + plain["optimizer_bytes"]) / n
    right.plot(
        steps, [whole / (p["weights"] + p["optimizer"]) for p in pcs], marker="s", ls="--", label="weights + optimizer"
    )
    right.set_xlabel("training step")
    right.set_ylabel("ratio vs plain Trainer")
    right.set_title("Per-checkpoint ratio (keyframes are the dips)")
    right.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
