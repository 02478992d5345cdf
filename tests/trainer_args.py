"""The small ``TrainingArguments`` the Trainer tests share (tests/ is on sys.path)."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainingArguments


def args_for(out: Path, **kw) -> TrainingArguments:
    """12 CPU steps of batch 8, a save and a log every 4, no reporting; ``kw`` overrides."""
    base = dict(
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_steps=4,
        logging_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(str(out), **base)
