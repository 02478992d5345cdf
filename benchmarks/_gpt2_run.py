"""A real training run shared by the checkpoint benchmarks: ten checkpoints of a small GPT-2.

A character-level GPT-2 (4 layers, 4 heads, width 128, context 128; 0.82 M parameters) is
trained from scratch (no dropout) with AdamW on :func:`hf_dynaquant.pretrained.corpus.docstring_corpus` (the standard
library's docstrings, ~1.1 MB of text, nothing downloaded), seeded, on the CPU. The text is cut
in blocks of 128 characters; 20 batches of 16 blocks are held out as evaluation data, the
others are reshuffled every epoch for training. A ``model.state_dict()`` is saved every
``steps / checkpoints`` optimizer steps, ten in all, evenly spaced over the run.

The run is cached in ``benchmarks/out/gpt2_run/`` (``ckpt-<i>.safetensors``, ``eval.safetensors``
and ``run.json``) and reused by every benchmark that needs it; it is trained again when it is
missing, when its settings differ from :data:`SETTINGS`, or with ``--retrain``. GPT-2 ties
``lm_head.weight`` to ``transformer.wte.weight`` and safetensors refuses tensors that share
memory, so the files hold the embedding once and loading puts the very same tensor object back
under both names (as ``model.state_dict()`` has them, which is what the store aliases).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from hf_dynaquant.core.quantizer import layer_types
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_corpus, lm_batches

RUN_DIR = Path(__file__).resolve().parent / "out" / "gpt2_run"
TIED = {"lm_head.weight": "transformer.wte.weight"}  # tied name -> the name stored

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Settings:
    """Everything that determines the run; a cached run with other settings is retrained."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block: int = 128
    batch: int = 16
    steps: int = 1000
    checkpoints: int = 10
    eval_batches: int = 20
    lr: float = 3e-3
    warmup: int = 50
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0

    @property
    def every(self) -> int:
        return self.steps // self.checkpoints


SETTINGS = Settings()


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: StateDict  # as model.state_dict() gives it: tied names share one tensor
    train_loss: float  # mean training loss over the steps since the previous checkpoint
    eval_loss: float  # mean loss on the held-out batches


@dataclass
class GPT2Run:
    settings: Settings
    checkpoints: list[Checkpoint]
    eval_data: torch.Tensor  # (n_batches, batch, block) token ids, never trained on
    train_seconds: float
    cached: bool

    def __post_init__(self) -> None:
        self._model = new_model(self.settings)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self._model.parameters())

    def layer_types(self) -> dict[str, str]:
        """Layer types of the model's tensors, for ``compress_state_dict(types=...)``."""
        return layer_types(self._model)

    def eval_loss(self, state: StateDict) -> float:
        """Mean loss of the model with weights ``state`` on the held-out batches."""
        self._model.load_state_dict(state)
        return evaluate(self._model, self.eval_data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--retrain",
        action="store_true",
        help=f"train the GPT-2 run again even if {RUN_DIR.relative_to(RUN_DIR.parents[2])}/ holds it",
    )


def new_model(settings: Settings) -> GPT2LMHeadModel:
    hf_logging.set_verbosity_error()  # GPT2Config's defaults warn about GPT-2's own token ids
    config = GPT2Config(
        n_layer=settings.n_layer,
        n_head=settings.n_head,
        n_embd=settings.n_embd,
        n_positions=settings.block,
        vocab_size=CharTokenizer().vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


@torch.inference_mode()
def evaluate(model: GPT2LMHeadModel, batches: torch.Tensor) -> float:
    """Mean next-character loss over ``batches`` (equal-sized, so this is the per-token mean)."""
    return sum(float(model(input_ids=b, labels=b).loss) for b in batches) / len(batches)


def _split(settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(evaluation batches, training blocks), disjoint."""
    ids = CharTokenizer().encode(docstring_corpus())
    batches = lm_batches(ids, settings.block, settings.batch, seed=settings.seed)
    return batches[: settings.eval_batches].clone(), batches[settings.eval_batches :].reshape(-1, settings.block)


def _lr_factor(settings: Settings, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_fraction`` of the peak."""
    if step < settings.warmup:
        return (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.min_lr_fraction + (1 - settings.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def train(settings: Settings, log: bool = True) -> GPT2Run:
    torch.manual_seed(settings.seed)
    eval_data, blocks = _split(settings)
    model = new_model(settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(settings, step))
    shuffle = torch.Generator().manual_seed(settings.seed + 1)
    epochs = math.ceil(settings.steps * settings.batch / blocks.shape[0])
    order = torch.cat([torch.randperm(blocks.shape[0], generator=shuffle) for _ in range(epochs)])
    checkpoints: list[Checkpoint] = []
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(settings.steps):
        batch = blocks[order[step * settings.batch : (step + 1) * settings.batch]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if (step + 1) % settings.every == 0:
            state = {n: t.detach().clone() for n, t in model.state_dict().items() if n not in TIED}
            state.update({tied: state[src] for tied, src in TIED.items()})
            ckpt = Checkpoint(step + 1, state, sum(losses) / len(losses), evaluate(model, eval_data))
            checkpoints.append(ckpt)
            losses.clear()
            if log:
                print(
                    f"  step {ckpt.step:5d}: train loss {ckpt.train_loss:.4f}, eval loss {ckpt.eval_loss:.4f} "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    return GPT2Run(settings, checkpoints, eval_data, time.perf_counter() - start, cached=False)


def save(run: GPT2Run, folder: Path = RUN_DIR) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".gitignore").write_text("# cached training run, rebuilt by benchmarks/_gpt2_run.py\n*\n")
    for i, ckpt in enumerate(run.checkpoints):
        save_file({n: t for n, t in ckpt.state.items() if n not in TIED}, str(folder / f"ckpt-{i}.safetensors"))
    save_file({"eval_data": run.eval_data}, str(folder / "eval.safetensors"))
    meta = {
        "settings": asdict(run.settings),
        "train_seconds": run.train_seconds,
        "checkpoints": [
            {"step": c.step, "train_loss": c.train_loss, "eval_loss": c.eval_loss} for c in run.checkpoints
        ],
    }
    (folder / "run.json").write_text(json.dumps(meta, indent=2) + "\n")


def load(folder: Path = RUN_DIR) -> GPT2Run | None:
    """The cached run, or None when it is missing or was made with other settings."""
    try:
        meta = json.loads((folder / "run.json").read_text())
    except FileNotFoundError:
        return None
    if meta["settings"] != asdict(SETTINGS):
        return None
    checkpoints = []
    for i, info in enumerate(meta["checkpoints"]):
        state = load_file(str(folder / f"ckpt-{i}.safetensors"))
        state.update({tied: state[src] for tied, src in TIED.items()})
        checkpoints.append(Checkpoint(info["step"], state, info["train_loss"], info["eval_loss"]))
    eval_data = load_file(str(folder / "eval.safetensors"))["eval_data"]
    return GPT2Run(SETTINGS, checkpoints, eval_data, meta["train_seconds"], cached=True)


def get_run(retrain: bool = False) -> GPT2Run:
    """The cached run, trained (and cached) first if needed."""
    run = None if retrain else load()
    if run is None:
        s = SETTINGS
        print(
            f"Training GPT-2 ({s.n_layer} layers, width {s.n_embd}, context {s.block}) for {s.steps} steps "
            f"of {s.batch} blocks; checkpoint every {s.every} steps -> {RUN_DIR}",
            flush=True,
        )
        run = train(SETTINGS)
        save(run)
    return run


def describe(run: GPT2Run) -> str:
    """One paragraph on the run, for the benchmarks' output."""
    s, first, last = run.settings, run.checkpoints[0], run.checkpoints[-1]
    where = f"cached in {RUN_DIR}" if run.cached else f"trained now, saved to {RUN_DIR}"
    return (
        f"GPT-2 run ({where}): {s.n_layer} layers, {s.n_head} heads, width {s.n_embd}, context {s.block}, "
        f"{run.parameters:,} parameters, char-level on the stdlib docstring corpus; AdamW lr {s.lr:g} "
        f"(warm-up {s.warmup}, cosine to {s.min_lr_fraction:g}x), batch {s.batch}, {s.steps} steps in "
        f"{run.train_seconds:.0f} s; {len(run.checkpoints)} checkpoints every {s.every} steps. Held-out loss "
        f"{first.eval_loss:.4f} at step {first.step} -> {last.eval_loss:.4f} at step {last.step} "
        f"({s.eval_batches} batches x {s.batch} x {s.block} characters)."
    )
