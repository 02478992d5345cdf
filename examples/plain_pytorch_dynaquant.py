"""Plain PyTorch with DynaQuant checkpoints (the paper's Listing 1), on real text, offline.

Trains a small GPT-2 on the standard library's docstrings for a few hundred steps, saving a
DynaQuant checkpoint every 50 steps (deltas between keyframes), then restores the last one into
a fresh model and compares evaluation losses. Run:

    python examples/plain_pytorch_dynaquant.py [--steps 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_dynaquant import Compressor, QuantConfig
from hf_dynaquant.pretrained.corpus import CharTokenizer, docstring_corpus, lm_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50, help="checkpoint interval")
    parser.add_argument("--out", default=None, help="store directory (default: a temporary one)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = CharTokenizer()
    batches = lm_batches(tok.encode(docstring_corpus()), block=64, batch=16)
    train, held_out = batches[:-8], batches[-8:]
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=tok.vocab_size, n_positions=64)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

    def eval_loss(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return sum(m(b, labels=b).loss.item() for b in held_out) / len(held_out)

    with tempfile.TemporaryDirectory() as tmp:
        compressor = Compressor(
            model,
            args.out or tmp,
            QuantConfig(bins=16, prune=0.2, protect=0.005, prune_by="sensitivity"),
            optimizer=optimizer,
            checkpoint_every=args.every,
        )
        for step in range(1, args.steps + 1):
            batch = train[step % len(train)]
            loss = model(batch, labels=batch).loss
            loss.backward()
            compressor.on_backward_pass_end()
            optimizer.step()
            compressor.before_gradient_flush()
            optimizer.zero_grad()
            if step % args.every == 0:
                info = compressor.store.info(compressor.compress(step))
                raw, stored = info.sections["model"]
                print(
                    f"step {step}: train loss {loss.item():.3f}, weights {raw / 1e6:.2f} MB -> {stored / 1e3:.0f} kB "
                    f"({raw / stored:.1f}x, {'keyframe' if info.base is None else 'delta'}); whole checkpoint with "
                    f"lossless optimizer state {info.ratio:.1f}x"
                )
        restored = GPT2LMHeadModel(config)
        compressor.restore(args.steps, restored)
        print(
            f"eval loss: trained {eval_loss(model):.4f}, restored from the compressed checkpoint "
            f"{eval_loss(restored):.4f}"
        )


if __name__ == "__main__":
    main()
