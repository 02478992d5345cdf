"""A hand-written Accelerate training loop with DynaQuant checkpoints (``DynaQuantPlugin``).

Trains a small GPT-2 on the standard library's docstrings (offline). ``accelerator.save_state()``
every ``--save-steps`` optimizer steps writes compressed checkpoints (weights through the searched
configuration, Adam moments compressed, delta chains between keyframes) into
``<output-dir>/dynaquant/``, while ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=3)`` rotates the ``checkpoints/checkpoint_<i>`` folders; ``--resume`` continues from
the newest complete checkpoint with ``accelerator.load_state()``. Run with one process or several:

    python examples/accelerate_loop.py --output-dir /tmp/dq-acc [--steps 60] [--save-steps 10]
    accelerate launch --num_processes 2 --cpu examples/accelerate_loop.py --output-dir /tmp/dq-acc
    ... --resume                                   # after an interruption

Each process writes ``<output-dir>/rank<r>-train.json`` (or ``-resume``): what it chose, wrote
and restored (the tests read them). ``--replicate-batches`` feeds every process the same batches, so the run is the same
for any number of processes (a check of the plugin, not a way to train).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from transformers import GPT2Config, GPT2LMHeadModel

from hf_dynaquant import DynaQuantPlugin
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.search import SearchSpace


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the model's weights and the optimizer's tensors (equal on every rank after a load)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
    for pid, state in sorted(optimizer.state_dict()["state"].items()):
        for key, t in sorted(state.items()):
            h.update(f"{pid}.{key}".encode() + t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.02)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (several processes: gloo)")
    parser.add_argument("--replicate-batches", action="store_true")
    args = parser.parse_args()

    project = ProjectConfiguration(str(args.output_dir), automatic_checkpoint_naming=True, total_limit=3)
    # one scheduler step per optimizer step, whatever the number of processes
    accelerator = Accelerator(project_config=project, step_scheduler_with_optimizer=False, cpu=args.cpu)
    set_seed(0)
    train, held = docstring_lm_datasets(block=32, eval_blocks=16, max_blocks=1600)
    config = GPT2Config(
        vocab_size=CharTokenizer().vocab_size, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    loader = torch.utils.data.DataLoader(train, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    eval_batches = [held[i : i + 8] for i in range(0, 16, 8)]  # the same on every rank
    if args.replicate_batches:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)

    plugin = DynaQuantPlugin(
        threshold=args.threshold,
        eval_data=eval_batches,
        checkpoint_every=args.save_steps,
        ema_steps=min(20, args.save_steps),
        keyframe_every=4,
        search_space=SearchSpace(bins=(4, 6, 8, 16), prune=(0.0, 0.1, 0.2, 0.3), protect=(0.005,)),
    )
    dq = plugin.attach(accelerator, model, optimizer)

    record: dict = {"rank": accelerator.process_index}
    step = 0
    if args.resume:
        accelerator.load_state()  # the newest complete checkpoint
        step = dq.compressor.step
        record.update(resumed_step=step, resumed_digest=digest(dq.model, optimizer))
    while step < args.steps:
        skip = step % len(loader)  # a resumed run starts mid-epoch where the saved one was
        batches = accelerator.skip_first_batches(loader, skip) if skip and not args.replicate_batches else loader
        for i, batch in enumerate(batches):
            if args.replicate_batches and i < skip:
                continue
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()  # the plugin's optimizer hooks record the gradient EMA before saves
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.save_steps == 0:
                accelerator.save_state()
                accelerator.print(f"step {step}: loss {loss.item():.4f}, saved")
            if step == args.steps:
                break
    dq.wait()
    for report in dq.reports:
        accelerator.print(
            f"step {report.step:>4}: {'keyframe' if report.keyframe else 'delta':>8} {report.raw / 1e6:.2f} MB -> "
            f"{report.stored / 1e3:.1f} kB ({report.raw / report.stored:.1f}x)"
        )
    record.update(
        final_step=step,
        chosen=dq.chosen,
        written=[{"step": r.step, "entry": r.entry, "stored": r.stored} for r in dq.reports],
    )
    phase = "resume" if args.resume else "train"
    (args.output_dir / f"rank{accelerator.process_index}-{phase}.json").write_text(json.dumps(record))
    # Free the DDP wrapper (its reducer holds the gloo process group) on every rank together,
    # then end: left to interpreter exit, a rank whose peer is gone can hang for good in gloo's
    # destructor, joining a worker thread that waits on that peer.
    dq.detach()
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    del model, optimizer, scheduler, loader, dq
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
