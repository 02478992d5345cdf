"""A 2-process FSDP2 job for tests/test_sharded.py (run with torch.distributed.run, gloo on CPU).

``python -m torch.distributed.run --nproc_per_node 2 fsdp_job.py OUT PHASE``:

* ``save``: train a small model sharded with ``fully_shard`` for a few steps, check that the
  plan from merged shard sketches equals the plan of the full tensors, and write two sharded
  checkpoints (a keyframe, then a delta); dump the full weights, sensitivity and optimizer state
  for the test's single-process references.
* ``load`` / ``load-plain``: restore ``step-5`` (or the plain single-process checkpoint ``plain``)
  onto a fresh sharded model and dump what every rank decoded; then take one training step (the
  optimizer state must be usable).
* ``search``: compress with a threshold: the ranks search in lockstep.
* ``replicated``: the optimizer also holds a parameter outside the FSDP model, whose state every
  rank holds whole: its encoding must count it once.
* ``background``: the same three checkpoints written in the foreground and by a
  ``CheckpointManager`` on its background thread, while training goes on.

Each rank writes ``OUT/rank<r>-<phase>.json`` and tensors as safetensors (never pickle).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from hf_dynaquant.core.quantizer import QuantConfig, plan_quantization, quantize
from hf_dynaquant.search import ConfigurationSearch, mean_loss
from hf_dynaquant.training.optimizer_state import MomentQuant, encode_optimizer_state
from hf_dynaquant.training.sharded import ShardedCompressor, _layer_types, local_tensor, plan_sharded

THRESHOLD = 0.02
CONFIG = QuantConfig(bins=8, prune=0.2, protect=0.01, prune_by="sensitivity", min_numel=1024)
# pruned updates: one threshold over all the moment tensors, which a copy counted twice would move
MOMENTS = MomentQuant(min_numel=256)  # the moments of the three weight matrices are quantized, the rest lossless
PRUNED_MOMENTS = MomentQuant(prune=0.2, min_numel=256)


class Net(torch.nn.Module):
    """An embedding and two Linear layers with row counts that 2 ranks split unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.hidden = torch.nn.Linear(32, 97)
        self.head = torch.nn.Linear(97, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.emb(x))))


def net(sharded: bool = True) -> Net:
    torch.manual_seed(0)
    model = Net()
    if sharded:
        for module in (model.emb, model.hidden, model.head):
            fully_shard(module)
        fully_shard(model)
    return model


def extra_param() -> torch.nn.Parameter:
    """A parameter outside the FSDP model (the same on every rank)."""
    return torch.nn.Parameter(torch.randn(40, 32, generator=torch.Generator().manual_seed(1)))


def extra_loss(extra: torch.Tensor) -> torch.Tensor:
    """A loss term whose gradient is the same on every rank (it does not depend on the data)."""
    return 1e-2 * (extra.sin() * torch.arange(32)).sum()


def batches(rank: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches (different on every rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (16,), generator=g)
        out.append((x, (x * 7 + 3) % 64))
    return out


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list, comp: ShardedCompressor | None) -> None:
    for x, y in data:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if comp is not None:
            comp.on_backward_pass_end()
        optimizer.step()
        if comp is not None:
            comp.before_gradient_flush()
        optimizer.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gathered_rows(local: torch.Tensor) -> torch.Tensor:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return torch.cat(parts, dim=0)


def plans_equal(a, b) -> dict:
    """Field-by-field comparison of two QuantPlans (exact)."""
    out = {"names": sorted(a.tensors) == sorted(b.tensors)}
    for n in a.tensors:
        x, y = a.tensors[n], b.tensors[n]
        out[n] = {
            "centres": bool(torch.equal(torch.from_numpy(x.centres), torch.from_numpy(y.centres))),
            "protect_magnitude": x.protect_magnitude == y.protect_magnitude,
            "protect_sensitivity": x.protect_sensitivity == y.protect_sensitivity,
            "prune_threshold": x.prune_threshold == y.prune_threshold,
            "layer_type": x.layer_type == y.layer_type,
        }
    return out


def dump(out: Path, rank: int, phase: str, model: torch.nn.Module, report: dict) -> None:
    state = {n: full(t).detach().contiguous() for n, t in model.state_dict().items()}
    local = {n: local_tensor(t).detach().clone().contiguous() for n, t in model.state_dict().items()}
    save_file(local, str(out / f"rank{rank}-{phase}-local.safetensors"))
    if rank == 0:
        save_file(state, str(out / f"{phase}-full.safetensors"))
    (out / f"rank{rank}-{phase}.json").write_text(json.dumps(report))


def sampled_moments(comp: ShardedCompressor, rank: int) -> dict:
    """A large Adam state (its decisions read a sample of its values) cut between the ranks
    mid-block: each rank decides, and plans, what one process decides for the whole."""
    pid = int(next(p for p, keys in comp._optimizer_sharded.items() if keys))  # a sharded parameter's id
    g = torch.Generator().manual_seed(12)
    n, cut = 1_100_000, 557_003
    sigma = torch.exp(torch.randn(n, generator=g)) * 1e-3
    g1, g2 = (torch.randn(n, generator=g) * sigma for _ in range(2))
    m, v = 0.1 * (g2 + 0.9 * g1), 0.001 * (g2.square() + 0.999 * g1.square())
    rows = slice(0, cut) if rank == 0 else slice(cut, n)

    def state(m: torch.Tensor, v: torch.Tensor) -> dict:
        entry = {"step": torch.tensor(2.0), "exp_avg": m, "exp_avg_sq": v}
        return {"state": {pid: entry}, "param_groups": [{"params": [pid], "eps": 1e-8, "lr": 1e-3}]}

    mine = encode_optimizer_state(state(m[rows], v[rows]), settings=MOMENTS, reductions=comp.optimizer_reductions())
    whole = encode_optimizer_state(state(m, v), settings=MOMENTS)
    gains = [(mine.tree["state"][pid][k], whole.tree["state"][pid][k]) for k in ("dq_gain", "dq_scale_gain")]
    return {
        "bins": mine.report["bins"] == whole.report["bins"] == {str(pid): mine.report["bins"][str(pid)]},
        "centres": mine.plans.keys() == whole.plans.keys()
        and all(np.array_equal(mine.plans[k].centres, tp.centres) for k, tp in whole.plans.items()),
        "gains": all(abs(a / b - 1) < 1e-9 for a, b in gains),
    }


def main(out: Path, phase: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = out / "store"
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report: dict = {"rank": rank}
    if phase == "save":
        comp = ShardedCompressor(model, store, CONFIG, optimizer=optimizer, moment_quant=MOMENTS)
        train(model, optimizer, batches(rank)[:3], comp)
        comp.compress(3)
        train(model, optimizer, batches(rank)[3:], comp)
        snap = comp.snapshot(5)
        weights, sens = comp._planning(snap)
        shapes = {n: v["shape"] for n, v in comp.layout.tensors.items()}
        merged = plan_sharded(weights, CONFIG, shapes=shapes, types=snap.types, sensitivity=sens)
        full_w = {n: gathered_rows(t) for n, t in weights.items()}
        full_s = {n: gathered_rows(t) for n, t in sens.items()}
        reference = plan_quantization(full_w, CONFIG, types=snap.types, sensitivity=full_s)
        report["plan"] = plans_equal(merged, reference)
        # stochastic rounding (after a restore): a shard's codes are the rows of the full tensor's
        sr = replace(CONFIG, rounding="stochastic", rounding_seed=3)
        merged_sr = plan_sharded(weights, sr, shapes=shapes, types=snap.types, sensitivity=sens)
        reference_sr = plan_quantization(full_w, sr, types=snap.types, sensitivity=full_s)
        report["stochastic_rows"] = {
            n: bool(
                torch.equal(
                    gathered_rows(torch.from_numpy(quantize(weights[n], tp)[0]).view(weights[n].shape)),
                    torch.from_numpy(quantize(full_w[n], reference_sr.tensors[n])[0]).view(full_w[n].shape),
                )
            )
            for n, tp in merged_sr.tensors.items()
        }
        # a tensor large enough that its sketches read a sample, cut between the ranks at a row that
        # is not a block edge: each shard samples what the whole tensor does
        g = torch.Generator().manual_seed(5)
        big = torch.randn(1100, 1000, generator=g) * torch.logspace(-2, 0, 1000)
        big_sens = big.abs() * torch.rand(1100, 1000, generator=g)
        rows = slice(0, 557) if rank == 0 else slice(557, 1100)
        report["sampled_plan"] = plans_equal(
            plan_sharded({"big": big[rows]}, CONFIG, shapes={"big": (1100, 1000)}, sensitivity={"big": big_sens[rows]}),
            plan_quantization({"big": big}, CONFIG, sensitivity={"big": big_sens}),
        )
        report["sampled_moments"] = sampled_moments(comp, rank)
        report["types"] = snap.types
        state = {n: full(t).detach().contiguous() for n, t in model.state_dict().items()}
        moments = {  # the full optimizer state at the snapshot (for the test's single-process reference)
            f"{pid}.{key}": full(v).detach().contiguous()
            for pid, entry in optimizer.state_dict()["state"].items()
            for key, v in entry.items()
        }
        if rank == 0:  # the full weights and sensitivity, for the test's single-process reference
            save_file(state, str(out / "save-full.safetensors"))
            save_file({n: t.contiguous() for n, t in full_s.items()}, str(out / "sensitivity.safetensors"))
            save_file(moments, str(out / "save-optimizer.safetensors"))
        written = comp.write(snap)
        report["entry"] = written.entry
        report["keyframe"] = written.keyframe
        report["optimizer_state"] = written.optimizer_state  # this rank's encoding decisions
    elif phase in ("load", "load-plain"):
        comp = ShardedCompressor(model, store, CONFIG, optimizer=optimizer)
        meta = comp.restore("step-5" if phase == "load" else "plain")
        report["step"] = int(meta["step"])
        report["same_split"] = bool(meta["_same_split"])
        dump(out, rank, phase, model, report)
        train(model, optimizer, batches(rank)[:1], None)  # the restored optimizer state works
        report["trained"] = True
    elif phase == "replicated":
        # an optimized tensor outside the FSDP model: every rank holds (and encodes) the same copy
        extra = extra_param()
        optimizer = torch.optim.AdamW([*model.parameters(), extra], lr=1e-2)
        comp = ShardedCompressor(model, store, CONFIG, optimizer=optimizer, moment_quant=PRUNED_MOMENTS)
        for x, y in batches(rank)[:3]:
            (torch.nn.functional.cross_entropy(model(x), y) + extra_loss(extra)).backward()
            comp.on_backward_pass_end()
            optimizer.step()
            comp.before_gradient_flush()
            optimizer.zero_grad()
        moments = {
            f"{pid}.{key}": full(v).detach().contiguous()
            for pid, entry in optimizer.state_dict()["state"].items()
            for key, v in entry.items()
        }
        weights = {n: full(t).detach().contiguous() for n, t in model.state_dict().items()}  # collective
        if rank == 0:
            save_file(moments, str(out / "replicated-optimizer.safetensors"))
            save_file(weights, str(out / "replicated-full.safetensors"))
        written = comp.write(comp.snapshot(3))
        report["optimizer_state"] = written.optimizer_state
    elif phase == "search":
        comp = ShardedCompressor(
            model,
            store,
            CONFIG,
            optimizer=optimizer,
            threshold=THRESHOLD,
            eval_data=batches(rank, 2),
            optimizer_state="drop",
        )
        comp.search.z = 0.0  # see the single-process search below
        train(model, optimizer, batches(rank)[:2], comp)
        # the same choice made for the unsharded model, on every rank's data together
        params = dict(model.named_parameters())
        unsharded = net(sharded=False)
        unsharded.load_state_dict({n: full(t) for n, t in model.state_dict().items()})
        weights = {n: p.detach().clone() for n, p in unsharded.named_parameters()}
        sens = {
            n: (gathered_rows(comp.ema.get(n).view(local_tensor(params[n]).shape)) * weights[n]).abs() for n in weights
        }
        data = batches(0, 2) + batches(1, 2)
        # z=0: the standard errors differ (per-rank batches pooled vs all batches), the walk must not
        single = ConfigurationSearch(mean_loss(data), THRESHOLD, config=CONFIG, z=0.0)
        result = single.search(unsharded, weights, types=_layer_types(model), sensitivity=sens)
        report["unsharded_chosen"] = result.config.to_dict() if result.config else None
        comp.compress(2)
        from accelerate import Accelerator

        from hf_dynaquant.errors import UnsupportedSetupError
        from hf_dynaquant.integrations.accelerate import DynaQuantPlugin

        try:
            DynaQuantPlugin(threshold=None).attach(Accelerator(cpu=True), model, optimizer)
        except UnsupportedSetupError as exc:
            report["plugin_refusal"] = str(exc)
        report["chosen"] = comp.last_search.config.to_dict() if comp.last_search.config else None
        report["degradation"] = comp.last_search.degradation
        report["evaluations"] = comp.last_search.evaluations
        dump(out, rank, phase, model, report)
    elif phase == "background":
        # the same checkpoints written in the foreground (store "foreground") and by a
        # CheckpointManager on its background thread (store "store"), whose collectives go on
        # while the training thread's FSDP collectives and the foreground saves' go on too
        from hf_dynaquant import CheckpointManager

        fg = ShardedCompressor(model, out / "foreground", CONFIG, optimizer=optimizer, moment_quant=MOMENTS)
        bg = ShardedCompressor(model, store, CONFIG, optimizer=optimizer, moment_quant=MOMENTS)
        manager = CheckpointManager(bg)
        report["own_group"] = manager.group is not None
        for step, (x, y) in enumerate(batches(rank, 6), 1):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            fg.on_backward_pass_end()
            bg.on_backward_pass_end()
            optimizer.step()
            fg.before_gradient_flush()
            bg.before_gradient_flush()
            optimizer.zero_grad()
            if step % 2 == 0:
                fg.compress(step)
                manager.save(step)
        manager.close()
        report["reports"] = [[r.step, r.entry, r.keyframe] for r in manager.reports]
    (out / f"rank{rank}-{phase}.json").write_text(json.dumps(report))
    dist.barrier()  # without it a rank may tear the process group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    # Everything is written and the process group is gone; skip the interpreter's teardown, where
    # a gloo thread still being destroyed rarely aborts the process ("terminate called without an
    # active exception") after the job has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
