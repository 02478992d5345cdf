"""Residual coding on a small fine-tune (issue 15, item 1): direct vs ``previous`` vs
``pretrained`` at one fixed QuantConfig, on a small GPT-2 (bench_trainer.make_model) pre-trained
briefly on the docstring corpus, saved with save_pretrained, loaded back with from_pretrained and
fine-tuned a few dozen steps. Per checkpoint: stored bits per weight value (quantized tensors and
the rest), mean / max absolute error of the decoded quantized tensors, and the eval loss of the
decoded model against the exact one. A quick check (about a minute on 2 cores), not a benchmark.

    python benchmarks/bench_residual.py [--bins 4 --prune 0.2 --steps 40 --every 10]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).parent))
from bench_trainer import make_model  # noqa: E402

from hf_dynaquant import Compressor, QuantConfig  # noqa: E402
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_corpus, lm_batches  # noqa: E402
from hf_dynaquant.training.compressor import read_checkpoint  # noqa: E402


def train(model: torch.nn.Module, batches: torch.Tensor, steps: int, lr: float, offset: int = 0) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for i in range(steps):
        x = batches[(offset + i) % len(batches)]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches: torch.Tensor) -> float:
    model.eval()
    return float(sum(model(input_ids=x, labels=x).loss for x in batches) / len(batches))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bins", type=int, default=4)
    ap.add_argument("--prune", type=float, default=0.2)
    ap.add_argument("--pretrain", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()
    torch.manual_seed(0)
    ids = CharTokenizer().encode(docstring_corpus())
    batches = lm_batches(ids, 64, 16)
    train_b, eval_b = batches[:-4], batches[-4:]
    work = Path(tempfile.mkdtemp())
    base = make_model()
    train(base, train_b, args.pretrain, 1e-3)
    base.save_pretrained(work / "base")
    model = GPT2LMHeadModel.from_pretrained(work / "base")
    kinds = ("none", "previous", "pretrained")
    comps = {
        k: Compressor(model, work / k, QuantConfig(bins=args.bins, prune=args.prune, residual=k), keyframe_every=10)
        for k in kinds
    }
    decoded_model = copy.deepcopy(model)
    print(f"bins={args.bins} prune={args.prune}; fine-tune {args.steps} steps at lr {args.lr}")
    print("step  residual    bits/value  mean|err|   max|err|   eval loss (exact -> decoded)")
    for step in range(args.every, args.steps + 1, args.every):
        train(model, train_b, args.every, args.lr, offset=step)
        exact = {n: t.detach().clone() for n, t in model.state_dict().items()}
        exact_loss = eval_loss(model, eval_b)
        for k, comp in comps.items():
            comp.compress(step)
            report = comp.last_report
            state, _, meta = read_checkpoint(comp.store, f"step-{step}")
            with comp.store.open(f"step-{step}") as entry:
                quantized = [n for n in entry.names("model") if entry.record("model", n).get("codec") == "dynaquant"]
            err = torch.cat([(state[n] - exact[n]).abs().reshape(-1) for n in quantized])
            values = sum(t.numel() for t in exact.values())
            decoded_model.load_state_dict(state)
            decoded_loss = eval_loss(decoded_model, eval_b)
            print(
                f"{step:4d}  {meta['quant_config']['residual']:10s}  {8 * report.weights_stored / values:9.3f}"
                f"  {float(err.mean()):.3e}  {float(err.max()):.3e}  {exact_loss:.4f} -> {decoded_loss:.4f}"
            )


if __name__ == "__main__":
    main()
