"""Plain PyTorch: keep every checkpoint of a training loop in a CheckpointStore.

Trains a small MLP on sklearn's digits for a few hundred steps, saving model + AdamW state every
50 steps as a delta on the previous save (lossless codec), then restores the last checkpoint
into a fresh model and optimizer and checks it is bit-exact. Run:

    python examples/plain_pytorch_store.py [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import tempfile

import torch

from hf_dynaquant import CheckpointStore


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 1,797 real 8x8 digit images if sklearn is installed, else random data."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        return torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)
    except ImportError:
        g = torch.Generator().manual_seed(0)
        return torch.rand(1797, 64, generator=g), torch.randint(0, 10, (1797,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="store directory (default: a temporary one)")
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y = digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(args.out or tmp)
        prev = None
        for step in range(1, 301):
            idx = torch.randint(0, len(x), (64,))
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 50 == 0:
                rng = io.BytesIO()
                torch.save(torch.get_rng_state(), rng)  # our own bytes; the store never unpickles
                prev = store.write(
                    {"model": model.state_dict()},
                    trees={"optimizer": opt.state_dict()},
                    extras={"rng": rng.getvalue()},
                    metadata={"step": step, "loss": loss.item()},
                    base=prev,
                    ref=f"step-{step}",
                )
                info = store.info(prev)
                print(
                    f"step {step}: loss {loss.item():.3f}, checkpoint {info.raw_nbytes / 1e3:.0f} kB -> "
                    f"{info.nbytes / 1e3:.0f} kB ({info.ratio:.2f}x, {'keyframe' if info.base is None else 'delta'})"
                )
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        with store.open("step-300") as entry:
            fresh.load_state_dict(entry.load_section("model"))
            fresh_opt.load_state_dict(entry.tree("optimizer"))
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        print(f"restored step 300 (chain of {len(store.chain('step-300'))}): {'bit-exact' if same else 'MISMATCH'}")


if __name__ == "__main__":
    main()
