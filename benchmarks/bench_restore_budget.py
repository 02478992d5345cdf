"""Do restores add up? A tiny from-scratch GPT-2 (2 layers, width 128, docstring corpus, no
dropout) trained T steps with AdamW, a checkpoint every K; fixed configurations, no search.

Run it with::

    python benchmarks/bench_restore_budget.py 200 20     # T K: 10 restores, ~5 min on one core

For each configuration and optimizer-state mode: the final eval loss of the run resumed from
every checkpoint (weights and optimizer state decoded, as a Trainer resume loads them) against
the uncompressed run on the same data order, and the mean relative L2 error of the decoded
weights. ``--spread`` prints the uncompressed run's final loss for other data orders instead.
Findings (issue 15) are in hf_dynaquant/search.py's module docstring ("Restores").
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_dynaquant import Compressor
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_lm_datasets
from hf_dynaquant.training.compressor import read_checkpoint

CONFIGS = [
    (32, 0.0, "lossless"),
    (8, 0.0, "lossless"),
    (3, 0.3, "lossless"),
    (32, 0.0, "compress"),
    (8, 0.0, "compress"),
]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=CharTokenizer().vocab_size, n_positions=32, n_embd=128, n_layer=2, n_head=2,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("every", type=int)
    parser.add_argument("--spread", type=int, default=0, help="uncompressed runs with this many other data orders")
    a = parser.parse_args()
    torch.set_num_threads(1)
    train, held = docstring_lm_datasets(block=32, eval_blocks=64, max_blocks=2000)
    evals = [collate([held[i] for i in range(j, min(j + 16, len(held)))]) for j in range(0, len(held), 16)]

    @torch.no_grad()
    def eval_loss(m: torch.nn.Module) -> float:
        m.eval()
        value = float(np.mean([m(**b).loss.item() for b in evals]))
        m.train()
        return value

    def run(seed: int, config: QuantConfig | None = None, optimizer_state: str = "lossless") -> tuple[float, float]:
        order = torch.randint(0, len(train), (a.steps, 16), generator=torch.Generator().manual_seed(seed))
        m = tiny_gpt2()
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
        comp = None
        if config is not None:
            comp = Compressor(
                m, tempfile.mkdtemp(), config=config, optimizer=opt, checkpoint_every=a.every, ema_steps=2,
                optimizer_state=optimizer_state,
            )  # fmt: skip
        errors = []
        for step, row in enumerate(order):
            m(**collate([train[int(i)] for i in row])).loss.backward()
            if comp:
                comp.on_backward_pass_end()
            opt.step()
            if comp:
                comp.before_gradient_flush()
            opt.zero_grad()
            if comp and (step + 1) % a.every == 0:
                exact = {n: p.detach().clone() for n, p in m.named_parameters()}
                comp.compress(step + 1)
                decoded, _, _ = read_checkpoint(comp.store, f"step-{step + 1}")
                big = [n for n, w in exact.items() if w.dim() >= 2 and w.numel() >= config.min_numel]
                num = sum(float((decoded[n] - exact[n]).pow(2).sum()) for n in big)
                errors.append(math.sqrt(num / sum(float(exact[n].pow(2).sum()) for n in big)))
                comp.restore(step + 1)  # weights and optimizer state decoded, as a resume loads them
        return eval_loss(m), float(np.mean(errors)) if errors else 0.0

    plain, _ = run(0)
    print(json.dumps({"plain": plain}), flush=True)
    for seed in range(1, a.spread + 1):
        print(json.dumps({"seed": seed, "plain": run(seed)[0]}), flush=True)
    if a.spread:
        return
    for bins, prune, mode in CONFIGS:
        final, error = run(0, QuantConfig(bins=bins, prune=prune, protect=0.005), mode)
        row = {"bins": bins, "prune": prune, "optimizer_state": mode, "restores": a.steps // a.every}
        print(json.dumps({**row, "final_vs_plain": final / plain - 1, "weight_error": error}), flush=True)


if __name__ == "__main__":
    main()
