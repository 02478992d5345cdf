"""Stored bytes per section of a fixed, seeded job: a fixed-configuration training run with AdamW
state (a keyframe and deltas) and a state dict; then (session 28) a chain of residuals on the
previous checkpoint, and a searched run offering that residual with gradients recorded, both
written from detached snapshots as a background save writes them. Run it on two commits
(PYTHONPATH=<checkout>) to check that a refactor leaves the figures as they were (issue 17:
identical on 4b3bc6b and after).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/check_same_figures.py
"""
import json
import tempfile
from pathlib import Path

import torch

import hf_dynaquant as h
from hf_dynaquant import CheckpointStore, Compressor, QuantConfig
from hf_dynaquant.search import SearchSpace, mean_loss

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
out = {}
with tempfile.TemporaryDirectory() as tmp:
    config = QuantConfig(bins=8, prune=0.1, min_numel=1000)
    comp = Compressor(model, Path(tmp) / "s", config, optimizer=opt, keyframe_every=3)
    for step in range(1, 7):
        x = torch.randn(32, 256)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        comp.on_backward_pass_end()
        opt.step()
        comp.before_gradient_flush()
        opt.zero_grad()
        if step % 2 == 0:
            comp.compress(step)
            r = comp.last_report
            out[f"step{step}"] = [r.weights_stored, r.optimizer_stored]
    store = CheckpointStore(Path(tmp) / "d")
    e = h.compress_state_dict(store, model.state_dict(), QuantConfig(bins=6, prune=0.2, min_numel=1000), ref="x")
    out["state_dict"] = store.info(e).sections["model"][1]
    held = [(x, x) for x in (torch.randn(32, 256) for _ in range(3))]
    space = SearchSpace(bins=(4, 8, 16), prune=(0.0, 0.2), protect=(0.0005, 0.005), residuals=("none", "previous"))
    for label, settings in (
        ("previous", {"config": QuantConfig(bins=8, prune=0.1, min_numel=1000, residual="previous")}),
        (
            "searched",
            {
                "config": QuantConfig(min_numel=1000),
                "threshold": 0.05,
                "metric": mean_loss(held, torch.nn.functional.mse_loss),
                "search_space": space,
            },
        ),
    ):
        comp = Compressor(model, Path(tmp) / label, optimizer=opt, keyframe_every=4, **settings)
        for step in range(1, 9):
            x = torch.randn(32, 256)
            (model(x) - x).pow(2).mean().backward()
            comp.on_backward_pass_end()
            opt.step()
            comp.before_gradient_flush()
            opt.zero_grad()
            if step % 2 == 0:
                snap = comp.snapshot(step, detach_model=True, copy=True)
                r = comp.write(snap)
                snap.release()
                out[f"{label} {step}"] = [r.weights_stored, r.optimizer_stored]
print(json.dumps(out))
