"""A 2-process DynaQuantTrainer job for tests/test_trainer.py (run with torch.distributed.run).

``python -m torch.distributed.run --nproc_per_node 2 ddp_trainer_job.py OUT train|resume``:
trains a tiny GPT-2 with DDP on gloo, compressing checkpoints with the configuration search
spread over both ranks, and writes ``OUT/rank<r>.json`` with what this rank saw."""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.integrations.trainer import DynaQuantCallback, DynaQuantTrainer
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.search import SearchSpace


class Probe(DynaQuantTrainer):
    """Records a digest of the weights right after a resume loaded them."""

    digest = None
    step = None

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
        Probe.digest, Probe.step = h.hexdigest(), self.state.global_step


class SearchStart(TrainerCallback):
    """Records where this rank's configuration search goes on from after the resume."""

    def __init__(self, cb: DynaQuantCallback) -> None:
        self.cb, self.last = cb, None

    def on_train_begin(self, args, state, control, **kwargs):
        last = self.cb.compressor.search.last
        self.last = last.to_dict() if last is not None else None


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    train, held = docstring_lm_datasets(block=32, eval_blocks=16, max_blocks=400)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=CharTokenizer().vocab_size, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        str(out),
        max_steps=8 if phase == "train" else 12,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        disable_tqdm=True,
    )
    space = SearchSpace(bins=(4, 8, 16), prune=(0.2, 0.0), protect=(0.005,), prune_by=("magnitude", "sensitivity"))
    cb = DynaQuantCallback(0.02, search_space=space, config=QuantConfig(min_numel=1024), ema_steps=2)
    start = SearchStart(cb)
    trainer = Probe(model=model, args=args, train_dataset=train, eval_dataset=held, callbacks=[cb, start])
    trainer.train(resume_from_checkpoint=True if phase == "resume" else None)
    rank = trainer.args.process_index
    path = out / f"rank{rank}.json"
    record = json.loads(path.read_text()) if path.exists() else {"written": False, "configs": []}
    record["written"] = record["written"] or bool(cb.reports)
    record["configs"] += [[step, config] for step, config in cb.chosen]
    if phase == "resume":
        record["resumed_step"] = Probe.step
        record["weights_digest"] = Probe.digest
        record["search_from"] = start.last
    path.write_text(json.dumps(record))


def shutdown() -> None:
    """Free the trainer (its DDP wrapper holds the gloo process group) while the interpreter is
    whole, then destroy the group. Left to interpreter finalization, gloo's worker threads can
    drop tensors that need the GIL after Python is gone, and the process aborts ("terminate called
    without an active exception"), one run in ten or so in CI."""
    gc.collect()  # the Trainer sits in reference cycles; main() has returned, so this frees it
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    shutdown()
