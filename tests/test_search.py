"""The configuration manager: safe evaluation, guided search vs brute force, steady state,
fallbacks, records, and data-parallel agreement across two real processes.

The walk is tested under the plain rule "degradation <= threshold" (``z=0``): the held-out
batches here are few, so their standard error would decide instead (tests/test_quality.py
tests the z rule)."""

from __future__ import annotations

import gc
import hashlib
import itertools
import os
import random
import socket
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from hf_dynaquant import Compressor, QuantConfig
from hf_dynaquant.core.quantizer import plan_quantization
from hf_dynaquant.inspection import inspect_table
from hf_dynaquant.search import (
    ConfigurationSearch,
    QualityMetric,
    SearchSpace,
    accuracy,
    evaluate_plan,
    held_out,
    mean_loss,
    measured_bits,
)

SMALL = SearchSpace(
    bins=(4, 6, 8, 12, 16), prune=(0.5, 0.3, 0.1, 0.0), protect=(0.0005, 0.005), prune_by=("magnitude",)
)
BASE = QuantConfig(min_numel=256)


def digits_mlp(seed: int = 0, steps: int = 150) -> tuple[torch.nn.Module, list, list]:
    """A small MLP trained on sklearn's real 8x8 digits: (model, train batches, eval batches)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    x, y = x[order], y[order]
    train = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 1400, 64)]
    held = [(x[i : i + 128], y[i : i + 128]) for i in range(1400, 1780, 128)]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        xb, yb = train[step % len(train)]
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return model, train, held


def snapshot_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_evaluation_restores_weights_mode_and_rng() -> None:
    model, _, held = digits_mlp()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_quantization(snapshot_of(model), QuantConfig(bins=4, prune=0.5, min_numel=256))
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)

    def noisy_metric(m: torch.nn.Module) -> float:  # consumes RNG and checks it runs in eval mode
        assert not m.training and not torch.is_grad_enabled()
        torch.rand(100), random.random(), np.random.rand(5)
        return mean_loss(held)(m)

    value, bits = evaluate_plan(model, snapshot_of(model), plan, QualityMetric(noisy_metric))
    assert value > mean_loss(held)(model) and 0 < bits < 3  # 4 bins, half pruned: quantized and cheap
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(
            v.view(torch.uint8) if v.dtype == torch.bool else v.view(-1).view(torch.int32),
            before[k].view(-1).view(torch.int32),
        ), k
    assert (
        torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]
    )


def brute_force(model, snapshot, metric, threshold, space) -> tuple[QuantConfig, int]:
    baseline = metric(model)
    best, count = None, 0
    for point in itertools.product(*(range(n) for n in space.shape)):
        config = space.config(point, "magnitude", BASE, space.embedding_bins[-1])
        value, bits = evaluate_plan(model, snapshot, plan_quantization(snapshot, config), metric)
        count += 1
        if metric.degradation(baseline, value) <= threshold and (best is None or bits < best[1]):
            best = (config, bits)
    return best[0], count


@pytest.mark.parametrize("threshold", [0.002, 0.02])
def test_guided_search_reaches_brute_force_with_fewer_evaluations(threshold: float) -> None:
    model, _, held = digits_mlp()
    metric = mean_loss(held)
    snap = snapshot_of(model)
    # z=0: the walk is compared with brute force under the plain rule "degradation <= threshold"
    search = ConfigurationSearch(metric, threshold, search_space=SMALL, config=BASE, z=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = search.search(model, snap)
    after = model.state_dict()
    assert all(torch.equal(before[k].view(torch.int32), after[k].view(torch.int32)) for k in before)  # bit-identical
    truth, brute_evals = brute_force(model, snap, metric, threshold, SMALL)
    assert result.mode == "exhaustive" and result.config is not None
    chosen, best = SMALL.point_of(result.config), SMALL.point_of(truth)
    assert result.degradation <= threshold
    assert max(abs(a - b) for a, b in zip(chosen, best)) <= 1  # the optimum, or within one step of it
    assert result.evaluations < brute_evals / 2
    assert len({(c.config.bins, c.config.prune, c.config.protect) for c in result.candidates}) == result.evaluations


def test_weight_error_sums_in_float64_whatever_the_dtype() -> None:
    """A candidate's squared error and norm (the audit figure ``weight_error``): float32 on the
    host in one compiled pass, other dtypes a chunk at a time, both the float64 sums."""
    from hf_dynaquant.search.measures import squared_error

    exact = torch.randn(300, 700, generator=torch.Generator().manual_seed(0))
    decoded = exact + 0.01 * torch.randn(300, 700, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        e, d = exact.to(dtype), decoded.to(dtype)
        error, norm = squared_error(d, e)
        assert error == pytest.approx(float(((d.double() - e.double()) ** 2).sum()), rel=1e-9)
        assert norm == pytest.approx(float((e.double() ** 2).sum()), rel=1e-9)


def test_measured_bits_need_no_evaluation() -> None:
    model, _, _ = digits_mlp()
    snap = snapshot_of(model)
    plan = plan_quantization(snap, QuantConfig(bins=6, prune=0.3, protect=0.005, min_numel=256))
    _, evaluated_bits = evaluate_plan(model, snap, plan, QualityMetric(lambda m: 0.0))
    assert measured_bits(snap, plan) == evaluated_bits  # the size the search orders by, without the model


def _weights_digest(model: torch.nn.Module) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.digest()


@pytest.mark.parametrize("scenario", ["moderate", "clear", "noisy"])
def test_search_trusts_only_clear_failures(scenario: str) -> None:
    """A designed, non-monotone quality over the MLP's real quantized weights: every point fails
    except the top of the cube and one point X with pruning, whose unpruned twin F (at or above
    X on every axis) is smaller, so F is evaluated first. A moderate failure of F (2x the
    threshold) must not hide X; a clear one (10x) condemns X unseen; once the cube has shown
    an inversion as large as that (a point losing 6x the threshold against one below it), the
    same failure is no longer clear and X is found again."""
    model, _, _ = digits_mlp()
    snap, threshold = snapshot_of(model), 0.01
    points = list(itertools.product(*(range(n) for n in SMALL.shape)))
    configs = {p: SMALL.config(p, "magnitude", BASE, 32) for p in points}
    bits = {p: measured_bits(snap, plan_quantization(snap, c)) for p, c in configs.items()}
    unpruned = SMALL.prune.index(0.0)
    x = min((p for p in points if p[1] != unpruned and bits[(p[0], unpruned, p[2])] < bits[p]), key=lambda p: bits[p])
    f, top = (x[0], unpruned, x[2]), tuple(n - 1 for n in SMALL.shape)
    level = 2 if scenario == "moderate" else 10
    degradation = {p: level * threshold for p in points} | {x: 0.0, top: 0.0}
    if scenario == "noisy":  # the smallest point, and one more step of protection on it, loses 6x the threshold more
        low = min(points, key=lambda p: bits[p])
        high = (low[0], low[1], low[2] + 1)
        assert f not in (low, high) and x not in (low, high) and bits[high] < bits[x]
        degradation[high] = degradation[low] + 6 * threshold

    by_digest: dict[bytes, tuple[int, int, int]] = {}  # the weights each configuration leaves in the model
    for p, c in configs.items():
        evaluate_plan(
            model,
            snap,
            plan_quantization(snap, c),
            QualityMetric(lambda m, p=p: by_digest.update({_weights_digest(m): p}) or 0.0),
        )

    def designed(m: torch.nn.Module) -> float:
        point = by_digest.get(_weights_digest(m))
        return 1.0 if point is None else 1.0 + degradation[point]

    result = ConfigurationSearch(QualityMetric(designed), threshold, search_space=SMALL, config=BASE).search(
        model, snap
    )
    evaluated = {SMALL.point_of(c.config) for c in result.candidates}
    assert bits[f] < bits[x] and f in evaluated and result.evaluations < len(points)
    if scenario == "clear":
        assert x not in evaluated and SMALL.point_of(result.config) == top
    else:
        assert SMALL.point_of(result.config) == x  # the brute-force optimum: the smallest passing point


def test_steady_state_neighbourhood_and_fallback() -> None:
    model, train, held = digits_mlp()
    search = ConfigurationSearch(mean_loss(held), 0.01, search_space=SMALL, config=BASE, z=0.0)
    first = search.search(model, snapshot_of(model))
    with torch.no_grad():  # a little more training: the next checkpoint is close to this one
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-4)
    second = search.search(model, snapshot_of(model))
    assert second.mode == "neighbourhood" and second.evaluations <= 2
    assert all(a >= b for a, b in zip(SMALL.point_of(second.config), SMALL.point_of(first.config)))  # not bolder
    # the quality bar tightens below what the last configuration gives: with a neighbourhood of
    # just that configuration, the round fails and the exhaustive search runs again
    snap, metric = snapshot_of(model), search.metric
    baseline = metric(model)
    best_quality = SMALL.config((4, 3, 1), "magnitude", BASE, 32)
    d_best = metric.degradation(baseline, evaluate_plan(model, snap, plan_quantization(snap, best_quality), metric)[0])
    search.epsilon, search.threshold = 0, (d_best + second.degradation) / 2
    assert second.degradation > search.threshold > d_best
    third = search.search(model, snap)
    assert third.mode == "fallback" and search.fallbacks == 1 and third.degradation <= search.threshold


def test_resumed_search_goes_on_from_the_stored_configuration(tmp_path) -> None:
    """A run resumed in a new process searches the neighbourhood of the configuration its last
    checkpoint records (not the whole cube again), and sizes against that entry's codes."""
    model, _, held = digits_mlp(steps=60)
    first = Compressor(model, tmp_path, BASE, threshold=0.01, metric=accuracy(held), search_space=SMALL)
    first.compress(10)
    first.compress(20)
    chosen = first.store.open("step-20").metadata["quant_config"]
    again = Compressor(model, tmp_path, BASE, threshold=0.01, metric=accuracy(held), search_space=SMALL)
    again.continue_chain("step-20")
    assert again.search.last is not None and again.search.last.bins == chosen["bins"]
    assert again._base_codes()  # the stored entry's codes, for sizes as stored
    again.compress(30)
    assert again.store.open("step-30").metadata["search"]["mode"] in ("neighbourhood", "fallback")
    assert again.store.verify("step-30", deep=True) == []  # the delta on the preloaded codes decodes
    # nothing to go on from: a lossless checkpoint, a configuration off the cube
    for recorded in (None, {**chosen, "bins": 5}, {**chosen, "embedding_bins": 7}, {**chosen, "prune_by": "hessian"}):
        again.search.continue_from(recorded)
        assert again.search.last is None


def test_no_passing_configuration_stores_lossless(tmp_path) -> None:
    model, _, held = digits_mlp()
    original = [p.detach().clone() for p in model.parameters()]

    def distance(m: torch.nn.Module) -> float:  # any quantization moves the weights: nothing passes at 0
        return float(sum((p - o).abs().sum() for p, o in zip(m.parameters(), original)))

    comp = Compressor(
        model, tmp_path, BASE, threshold=0.0, search_space=SMALL, metric=QualityMetric(distance, relative=False)
    )
    with pytest.warns(UserWarning, match="stored losslessly"):
        comp.compress(1)
    entry = comp.store.open("step-1")
    assert all(rec["codec"] == "lossless" for _, _, rec in entry.tensor_records())
    assert entry.metadata["search"]["config"] is None


def test_a_spent_time_bound_stores_losslessly_never_unverified(tmp_path) -> None:
    """search_seconds: once spent, no further candidate is evaluated; without a passing one the
    checkpoint is stored losslessly (mode "out of time"). The metric takes 1 s per evaluation and
    the bound is 1.5 s, so the baseline and exactly one candidate round fit whatever the machine's
    speed (planning this MLP takes milliseconds)."""
    import time

    model, _, held = digits_mlp()
    original = [p.detach().clone() for p in model.parameters()]

    def slow_metric(m: torch.nn.Module) -> float:
        """1.0 on the exact weights, 1.015 on any quantized copy: every candidate fails a 1%
        threshold, none clearly enough to rule out others, so an unbounded search would go on."""
        time.sleep(1.0)
        exact = all(torch.equal(p, o) for p, o in zip(m.parameters(), original))
        return 1.0 if exact else 1.015

    metric = QualityMetric(slow_metric)
    comp = Compressor(model, tmp_path, BASE, threshold=0.01, search_space=SMALL, metric=metric, search_seconds=1.5)
    with pytest.warns(UserWarning, match=r"spent its 1.5 s after 1 candidate\(s\).*stored losslessly"):
        comp.compress(1)
    entry = comp.store.open("step-1")
    assert all(rec["codec"] == "lossless" for _, _, rec in entry.tensor_records())
    assert entry.metadata["search"]["mode"] == "out of time"
    assert entry.metadata["search"]["evaluations"] == 1
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original))  # the live weights are back


def test_a_time_bound_keeps_a_passing_configuration_found_in_time(tmp_path) -> None:
    """A bound that is not reached changes nothing: the same choice as without one."""
    model, _, held = digits_mlp()
    chosen = []
    for seconds in (None, 600.0):
        search = ConfigurationSearch(mean_loss(held), 0.05, search_space=SMALL, config=BASE, z=0, seconds=seconds)
        chosen.append(search.search(model, {k: v.clone() for k, v in model.state_dict().items()}).config)
    assert chosen[0] is not None and chosen[0] == chosen[1]


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf")])
def test_a_time_bound_must_be_positive_and_finite(seconds) -> None:
    from hf_dynaquant import CheckpointSettings
    from hf_dynaquant.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match="search_seconds"):
        CheckpointSettings(search_seconds=seconds)
    with pytest.raises(InvalidSettingError, match="seconds"):
        ConfigurationSearch(mean_loss([]), 0.01, seconds=seconds)


def test_a_time_bound_from_the_environment(monkeypatch) -> None:
    from hf_dynaquant import CheckpointSettings

    monkeypatch.setenv("ACCELERATE_DYNAQUANT_SEARCH_SECONDS", "90")
    assert CheckpointSettings.from_env().search_seconds == 90.0
    monkeypatch.setenv("ACCELERATE_DYNAQUANT_SEARCH_SECONDS", "none")
    assert CheckpointSettings.from_env().search_seconds is None


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, comp: Compressor, batch: tuple) -> None:
    """One optimizer step of the digits MLP with the compressor's gradient hooks (Listing 1)."""
    xb, yb = batch
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    comp.on_backward_pass_end()
    opt.step()
    comp.before_gradient_flush()
    opt.zero_grad()


def test_compressor_with_threshold_records_the_search(tmp_path) -> None:
    model, train, held = digits_mlp(steps=60)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    comp = Compressor(
        model,
        tmp_path,
        BASE,
        optimizer=opt,
        threshold=0.01,
        metric=accuracy(held),
        search_space=SMALL,
        checkpoint_every=10,
        ema_steps=5,
    )
    for step in range(1, 31):
        _train_step(model, opt, comp, train[step % len(train)])
        if step % 10 == 0:
            comp.compress(step)
    modes = [comp.store.open(f"step-{s}").metadata["search"]["mode"] for s in (10, 20, 30)]
    assert modes[0] == "exhaustive" and set(modes[1:]) <= {"neighbourhood", "fallback"}
    rec = comp.store.open("step-30").metadata["search"]
    assert rec["degradation"] <= 0.01 and rec["evaluations"] == len(rec["candidates"]) >= 1
    assert rec["config"]["prune_by"] in ("magnitude", "sensitivity")
    table = inspect_table(tmp_path, ref="step-30")
    assert "search:" in table and "degradation" in table


def test_a_searched_write_lets_go_of_its_snapshot_without_the_garbage_collector(tmp_path) -> None:
    """Once a background-style write (detached snapshot, search on a copy of the model, every
    residual kind offered) is done and the snapshot released, its optimizer state and its
    quantized weights are freed at once, not when the cyclic garbage collector next runs; and
    the plan's sensitivities are computed when read, not held by the search's result."""
    model, train, held = digits_mlp(steps=20)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    space = replace(SMALL, prune_by=("magnitude", "sensitivity"), residuals=("none", "previous"))
    comp = Compressor(model, tmp_path, BASE, optimizer=opt, threshold=0.01, metric=accuracy(held), search_space=space)
    for step in range(1, 7):
        _train_step(model, opt, comp, train[step % len(train)])
        if step % 3:
            continue
        snap = comp.snapshot(step, detach_model=True, copy=True)
        watched = [weakref.ref(snap.optimizer["state"][0]["exp_avg"]), weakref.ref(snap.state["0.weight"])]
        gc.collect()
        gc.disable()
        try:
            report = comp.write(snap)
            snap.release()
            del snap
            assert [w() is None for w in watched] == [True, True], step
        finally:
            gc.enable()
        assert report.search is not None and comp.last_search.plan is None


def test_background_saves_with_the_search_leave_no_cyclic_garbage(tmp_path) -> None:
    """Background saves (search, residual kinds, optimizer state) create no reference cycles:
    what a cycle holds waits for the garbage collector, which can be a whole checkpoint's
    worth of tensors (``flatten_tree``'s recursive closure was one)."""
    from hf_dynaquant import CheckpointManager

    model, train, held = digits_mlp(steps=20)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    space = replace(SMALL, prune_by=("magnitude", "sensitivity"), residuals=("none", "previous"))
    comp = Compressor(model, tmp_path, BASE, optimizer=opt, threshold=0.01, metric=accuracy(held), search_space=space)
    manager = CheckpointManager(comp)
    try:
        for step in range(1, 13):
            _train_step(model, opt, comp, train[step % len(train)])
            if step % 3 == 0:
                manager.save(step)
                manager.wait()
            if step == 3:  # after a first save (pools, caches made once): collect everything from here
                gc.collect()
                gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycles = [type(o).__qualname__ for o in gc.garbage]
        assert not cycles, cycles[:20]
        assert len(manager.reports) == 4
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        manager.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model, _, held = digits_mlp()
        search = ConfigurationSearch(mean_loss(held), 0.01, search_space=SMALL, config=BASE, z=0.0)
        result = search.search(model, snapshot_of(model))
        out[rank] = (result.config, result.local_evaluations, [c.config for c in result.candidates])
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_agree_and_match_one_process() -> None:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_rank_main, args=(2, _free_port(), out), nprocs=2, join=True)
    (c0, e0, cands0), (c1, e1, cands1) = out[0], out[1]
    assert c0 == c1 and cands0 == cands1  # every rank saw every result and chose the same
    assert e0 > 0 and e1 > 0 and e0 + e1 == len(cands0)  # the ranks shared the evaluations
    model, _, held = digits_mlp()
    torch.set_num_threads(1)
    single = ConfigurationSearch(mean_loss(held), 0.01, search_space=SMALL, config=BASE, z=0.0).search(
        model, snapshot_of(model)
    )
    assert single.config == c0


def test_held_out_batches_and_metric_kinds() -> None:
    model, train, held = digits_mlp(steps=30)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.rand(40, 64), torch.randint(0, 10, (40,))), batch_size=8
    )
    kept = held_out(loader, 3)
    assert len(kept) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(kept, list(loader)[:3]))
    loss, acc = mean_loss(held), accuracy(held)
    assert loss(model) > 0 and 0 <= acc(model) <= 1
    assert acc.degradation(0.9, 0.891) == pytest.approx(0.01) and loss.degradation(2.0, 2.02) == pytest.approx(0.01)
    assert QualityMetric(lambda m: 1.0, relative=False).degradation(0.0, 0.05) == pytest.approx(0.05)
