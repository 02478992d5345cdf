"""A hand-written FSDP2 training loop with sharded DynaQuant checkpoints (``ShardedCompressor``).

Two processes (CPU, gloo) train a small character model on the standard library's docstrings
(offline) with its parameters sharded by ``torch.distributed.fsdp.fully_shard``. Every
``--every`` optimizer steps each rank takes a snapshot and, on a background thread (a
``CheckpointManager``), writes its own shard of a compressed checkpoint (weights
quantized with one plan for the full tensors, Adam moments compressed with the decisions one
process would take for the full optimizer state, delta chains per rank between keyframes) and
rank 0 the index that makes it a checkpoint. At the end the processes leave the process group
and rank 0, now a single process, restores the last checkpoint into a plain (unsharded) model
and optimizer, compares it with the trained model and takes a training step from it. Run:

    torchrun --nproc_per_node 2 examples/fsdp_sharded.py [--out DIR] [--steps 60] [--every 20]

Rank 0 prints the sizes of every checkpoint and of the store, and writes ``<out>/summary.json``
(the slow test reads it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_dynaquant import CheckpointManager, QuantConfig
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_corpus, lm_batches
from hf_dynaquant.training.sharded import ShardedCompressor, load_sharded

CONTEXT = 4  # characters the model sees before the one it predicts


class CharModel(torch.nn.Module):
    """Next character from the previous :data:`CONTEXT` ones: an embedding, two hidden layers
    (the blocks each rank shards) and an output layer."""

    def __init__(self, vocab: int, dim: int = 48, hidden: int = 256) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(CONTEXT * dim, hidden), torch.nn.Linear(hidden, hidden)])
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        h = self.emb(context).flatten(1)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def windows(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(contexts, next characters)`` of every position of a ``(batch, block)`` token batch."""
    w = batch.unfold(1, CONTEXT + 1, 1).reshape(-1, CONTEXT + 1)
    return w[:, :CONTEXT], w[:, CONTEXT]


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    x, y = windows(batch)
    return torch.nn.functional.cross_entropy(model(x), y)


def build(vocab: int, sharded: bool) -> CharModel:
    """The model, seeded alike on every rank; with ``sharded`` its parameters become DTensors
    split by rows over the ranks."""
    torch.manual_seed(0)
    model = CharModel(vocab)
    if sharded:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def shared_dir(path: str | None) -> Path:
    """The store's directory, the same on every rank (rank 0 picks a temporary one if none given)."""
    chosen = [path or (tempfile.mkdtemp(prefix="dq-fsdp-") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="checkpoint interval in optimizer steps")
    args = parser.parse_args()
    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = shared_dir(args.out)
    tok = CharTokenizer()
    data = lm_batches(tok.encode(docstring_corpus()), block=64, batch=16)
    train_batches, eval_batch = data[:-1][rank::world], data[-1]  # each rank its own batches

    model = build(tok.vocab_size, sharded=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dq = ShardedCompressor(
        model,
        out / "store",
        QuantConfig(bins=16, prune=0.1, prune_by="sensitivity"),
        optimizer=optimizer,
        checkpoint_every=args.every,
        ema_steps=10,
        keyframe_every=4,
    )
    saves = CheckpointManager(dq)  # every rank encodes its own shard on a background thread
    losses = {}
    for step in range(1, args.steps + 1):
        loss = loss_of(model, train_batches[(step - 1) % len(train_batches)])
        loss.backward()
        dq.on_backward_pass_end()  # gradients for the sensitivity metric (in the window before a checkpoint)
        optimizer.step()
        dq.before_gradient_flush()
        optimizer.zero_grad()
        if step % args.every == 0:
            saves.save(step)  # every rank: the snapshot now; its shard (rank 0: then the index) in the background
            losses[step] = loss.item()
    saves.close()  # waits for the checkpoint in flight
    written = []
    for report in saves.reports:  # every rank has the same reports, in order: gather their sizes
        sizes = [None] * world
        dist.all_gather_object(sizes, (report.raw, report.stored, report.weights_stored, report.optimizer_stored))
        raw, stored = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
        written.append({"step": report.step, "keyframe": report.keyframe, "raw": raw, "stored": stored})
        if rank == 0:
            kind = "keyframe" if report.keyframe else "delta"
            print(
                f"step {report.step:3d}  loss {losses[report.step]:.3f}  checkpoint ({kind}): {raw / 1e3:.0f} kB "
                f"raw -> {stored / 1e3:.1f} kB stored ({raw / stored:.1f}x; weights "
                f"{sum(s[2] for s in sizes) / 1e3:.1f} kB, optimizer {sum(s[3] for s in sizes) / 1e3:.1f} kB)",
                flush=True,
            )
    with torch.no_grad():
        live_loss = loss_of(model, eval_batch).item()  # collective forward, the same batch on every rank
    live = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in model.state_dict().items()}
    dist.barrier()
    dist.destroy_process_group()  # the training job is over; what follows is one process
    if rank != 0:
        return

    last = written[-1]["step"]
    restored = build(tok.vocab_size, sharded=False)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=3e-3)
    meta = load_sharded(out / "store", f"step-{last}", restored, restored_opt)  # 2 shards -> 1 process
    with torch.no_grad():
        restored_loss = loss_of(restored, eval_batch).item()
    decoded = restored.state_dict()
    squares = torch.stack([torch.stack([(decoded[n] - t).square().sum(), t.square().sum()]) for n, t in live.items()])
    error = float(squares[:, 0].sum().sqrt() / squares[:, 1].sum().sqrt())  # relative L2 error of all the weights
    loss = loss_of(restored, train_batches[0])
    loss.backward()
    restored_opt.step()  # training goes on from the restored optimizer state
    on_disk = sum(p.stat().st_size for p in (out / "store").rglob("*") if p.is_file())
    raw_total = sum(w["raw"] for w in written)
    print(
        f"restored step-{meta['step']} from {world} shards into 1 process: eval loss {restored_loss:.4f} "
        f"(trained model {live_loss:.4f}), relative L2 error of the weights {error:.3f}"
    )
    print(
        f"store {out / 'store'}: {len(written)} checkpoints, {on_disk / 1e3:.0f} kB on disk for "
        f"{raw_total / 1e3:.0f} kB of raw state ({raw_total / on_disk:.1f}x); {time.perf_counter() - started:.0f} s"
    )
    summary = {
        "world": world,
        "checkpoints": written,
        "restored_step": int(meta["step"]),
        "live_loss": live_loss,
        "restored_loss": restored_loss,
        "relative_error": error,
        "store_bytes": on_disk,
        "raw_bytes": raw_total,
        "optimizer_state": meta.get("optimizer_state"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
