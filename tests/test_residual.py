"""Residual coding (issue 15, item 1): codes of ``w - ref`` against the previous checkpoint's
decoded weights or the pre-trained weights, closed loop, through the quantizer, codec, store,
compressor and search."""

from __future__ import annotations

import gc
import shutil
import weakref

import numpy as np
import pytest
import torch

from hf_dynaquant import Compressor, QuantConfig
from hf_dynaquant.core.memory import Computed
from hf_dynaquant.core.quantizer import PRUNED, decoded_values, dequantize, plan_quantization, quantize
from hf_dynaquant.errors import ChecksumMismatchError, MissingBaseError, UnsupportedSetupError
from hf_dynaquant.search import ConfigurationSearch, Reference, SearchSpace, mean_loss
from hf_dynaquant.training.compressor import read_checkpoint
from hf_dynaquant.training.manager import CheckpointManager

FIXED = QuantConfig(bins=4, prune=0.0, protect=0.0)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))


def _drift(model: torch.nn.Module, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def test_residual_plans_read_their_references_when_they_need_them_and_hold_none() -> None:
    """A residual plan reads its reference (the previous checkpoint's decoded weights, made from
    their codes on each read: a :class:`Computed` mapping) when it makes or decodes codes, and
    holds none of them; the plans and codes equal those of references held in memory, and a
    reference of another shape or with a NaN is not used."""
    g = torch.Generator().manual_seed(0)
    refs = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(4)}
    weights = {n: r + 0.01 * torch.randn(r.shape, generator=g) for n, r in refs.items()}
    weights["other shape"], refs["other shape"] = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g)
    weights["nan"], refs["nan"] = torch.randn(64, 64, generator=g), torch.full((64, 64), float("nan"))
    made: list[weakref.ref] = []

    def make(name: str) -> torch.Tensor:
        t = refs[name].clone()
        made.append(weakref.ref(t.untyped_storage()))  # (the memory: a plan may hold a view of it)
        return t

    config = QuantConfig(bins=6, prune=0.2, protect=0.01, min_numel=100, residual="previous")
    lazy = plan_quantization(weights, config, reference=Computed({n: (lambda n=n: make(n)) for n in refs}))
    held = plan_quantization(weights, config, reference=refs)
    gc.collect()
    assert made and not [r for r in made if r() is not None]  # read, and not held
    assert [n for n, tp in lazy.tensors.items() if tp.residual == "previous"] == [f"w{i}" for i in range(4)]
    for name, w in weights.items():
        a, b = lazy.tensors[name], held.tensors[name]
        assert a.residual == b.residual and np.array_equal(a.centres, b.centres)
        (codes_a, prot_a), (codes_b, prot_b) = quantize(w, a), quantize(w, b)
        assert np.array_equal(codes_a, codes_b) and np.array_equal(prot_a, prot_b), name
        assert np.array_equal(
            decoded_values(codes_a, a.centres, prot_a, a.reference_values()),
            decoded_values(codes_b, b.centres, prot_b, b.reference_values()),
        )


def test_residual_plan_decodes_to_reference_plus_centres():
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(128, 96, generator=gen)
    w = ref + 0.01 * torch.randn(128, 96, generator=gen)
    config = QuantConfig(bins=4, prune=0.3, protect=0.01, residual="previous")
    plan = plan_quantization({"w": w}, config, reference={"w": ref}).tensors["w"]
    assert plan.residual == "previous" and np.array_equal(plan.reference_values(), ref.reshape(-1).numpy())
    codes, protected = quantize(w, plan)
    values = decoded_values(codes, plan.centres, protected, plan.reference_values())
    assert np.array_equal(values, ref.reshape(-1).numpy() + dequantize(codes, plan.centres, protected))
    pruned = codes == PRUNED
    assert 0.25 < pruned.mean() < 0.35
    assert np.array_equal(values[pruned], ref.reshape(-1).numpy()[pruned])  # a pruned residual keeps the reference
    # the residual's codebook spans the residual, so 4 bins are ~100x finer than on the weights
    direct = plan_quantization({"w": w}, QuantConfig(bins=4, prune=0.3, protect=0.01)).tensors["w"]
    d_codes, d_prot = quantize(w, direct)
    err_res = np.abs(values - w.reshape(-1).numpy()).mean()
    err_dir = np.abs(dequantize(d_codes, direct.centres, d_prot) - w.reshape(-1).numpy()).mean()
    assert err_res < err_dir / 30
    # a tensor without a reference (or of another shape) stays direct
    other = plan_quantization({"w": w}, config, reference={"w": ref[:64]}).tensors["w"]
    assert other.residual == "none" and other.reference is None


def _chain(tmp_path, residual: str, steps: int = 10, **kw) -> tuple[Compressor, torch.nn.Module, list[dict]]:
    model = _mlp()
    comp = Compressor(model, tmp_path / "s", replace_config(residual), pretrained=None, keyframe_every=100, **kw)
    exact = []
    for step in range(1, steps + 1):
        _drift(model, 0.005, step)
        comp.compress(step)
        exact.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return comp, model, exact


def replace_config(residual: str) -> QuantConfig:
    return QuantConfig(bins=4, prune=0.0, protect=0.0, residual=residual)


def test_closed_loop_error_does_not_grow_open_loop_does(tmp_path):
    comp, _, exact = _chain(tmp_path, "previous")
    name = "0.weight"
    closed = []
    for step, weights in enumerate(exact, 1):
        state, _, meta = read_checkpoint(comp.store, f"step-{step}")
        assert meta["quant_config"]["residual"] == ("none" if step == 1 else "previous")
        closed.append(float((state[name] - weights[name]).abs().mean()))
    # open loop: each residual taken against the exact previous weights; the decoder adds it to
    # its own (decoded) previous values, so the quantization errors add up along the chain
    decoded = exact[0][name].clone()  # (from an exact start, so only the accumulation shows)
    open_loop = [0.0]
    for prev, cur in zip(exact, exact[1:]):
        plan = plan_quantization({name: cur[name]}, replace_config("previous"), reference={name: prev[name]})
        tp = plan.tensors[name]
        codes, prot = quantize(cur[name], tp)
        decoded = decoded + torch.from_numpy(dequantize(codes, tp.centres, prot)).view(decoded.shape)
        open_loop.append(float((decoded - cur[name]).abs().mean()))
    assert max(closed[2:]) < 1.3 * closed[1]  # closed loop: the error settles
    assert closed[-1] < closed[0] / 2  # and stays far below direct coding's
    assert open_loop[-1] > 2 * open_loop[1]  # open loop: it grows along the chain
    assert open_loop[-1] > closed[-1]


def test_restore_equals_compressor_reference_and_chain_is_checked(tmp_path):
    comp, _, _ = _chain(tmp_path, "previous", steps=4)
    store = comp.store
    state, _, _ = read_checkpoint(store, "step-4")
    for name, ref in comp._previous_values(state).items():  # what the next residual will be coded against
        assert torch.equal(state[name].float(), ref)
    assert store.verify(deep=True) == []
    with store.open("step-4") as entry:
        rec = entry.record("model", "0.weight")
        assert rec["params"]["residual"] == "previous" and rec["uses_base"]
    # compaction stays exact: the residual tensors are stored losslessly
    new = store.compact("step-4")
    with store.open(new) as entry:
        assert entry.base is None
        assert entry.record("model", "0.weight")["codec"] == "lossless"
        compacted = entry.load_section("model")
    assert all(torch.equal(compacted[n], state[n]) for n in state)
    assert store.verify("step-4", deep=True) == []
    # a missing base of a "previous" entry is a clear error naming it
    base = store.chain("step-3")[1]
    shutil.rmtree(store.entries_dir / base)
    with pytest.raises(MissingBaseError):
        read_checkpoint(store, "step-3")
    assert any("step-3" in p or base[:16] in p for p in store.verify(deep=True))


def test_corrupt_base_is_a_checksum_error(tmp_path):
    comp, _, _ = _chain(tmp_path, "previous", steps=2)
    base = comp.store.chain("step-2")[1]
    payload = comp.store.entries_dir / base / "payload.safetensors"
    data = bytearray(payload.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 10] ^= 0xFF  # in the first blob: a weight's codes
    payload.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):
        read_checkpoint(comp.store, "step-2")


def test_keyframes_reset_to_direct_coding(tmp_path):
    model = _mlp()
    comp = Compressor(model, tmp_path / "s", replace_config("previous"), pretrained=None, keyframe_every=3)
    for step in range(1, 8):
        _drift(model, 0.005, step)
        comp.compress(step)
        with comp.store.open(f"step-{step}") as entry:
            keyframe = (step - 1) % 3 == 0
            assert (entry.base is None) == keyframe
            assert entry.metadata["quant_config"]["residual"] == ("none" if keyframe else "previous")
    assert comp.store.verify(deep=True) == []


def test_continue_chain_reads_the_previous_values_back(tmp_path):
    comp, model, _ = _chain(tmp_path, "previous", steps=2)
    resumed = Compressor(model, comp.store, replace_config("previous"), pretrained=None, keyframe_every=100)
    resumed.continue_chain("step-2")
    _drift(model, 0.005, 3)
    resumed.compress(3)
    state, _, _ = read_checkpoint(comp.store, "step-3")
    with comp.store.open("step-3") as entry:
        assert entry.record("model", "0.weight")["params"]["residual"] == "previous"
    assert comp.store.verify(deep=True) == []
    assert float((state["0.weight"] - model[0].weight.detach()).abs().mean()) < 0.005


# -- the search ---------------------------------------------------------------------------------


def _task(seed: int = 0):
    """A small classifier trained to fit synthetic data, and held-out batches."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 32, generator=gen)
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()
    model = _mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(150):
        idx = torch.randint(0, 768, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    batches = [(x[i : i + 128], y[i : i + 128]) for i in range(768, 1024, 128)]
    return model, x, y, gen, batches


def _fine_tune(model, x, y, gen, steps=10, lr=1e-3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, 768, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


def _search(model, batches, references, residuals=("pretrained", "previous", "none")):
    snapshot = {n: t.detach().clone() for n, t in model.state_dict().items() if t.dim() >= 2}
    search = ConfigurationSearch(
        mean_loss(batches),
        0.01,
        search_space=SearchSpace(residuals=residuals, prune_by=("magnitude",)),
        config=QuantConfig(min_numel=1024),
    )
    return search.search(model, snapshot, references=references)


def test_search_codes_a_fine_tune_as_a_residual_of_its_start():
    model, x, y, gen, batches = _task()
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    _fine_tune(model, x, y, gen)
    result = _search(model, batches, {"pretrained": Reference(start)})
    direct = _search(model, batches, {}, residuals=("none",))
    assert result.config.residual == "pretrained"
    assert result.to_dict()["residual"] == "pretrained"
    chosen = next(c for c in result.candidates if c.config == result.config)
    best_direct = next(c for c in direct.candidates if c.config == direct.config)
    assert chosen.bits < best_direct.bits


def test_search_codes_directly_when_the_reference_is_useless():
    model, _, _, _, batches = _task()
    gen = torch.Generator().manual_seed(7)
    useless = {n: 10 * torch.randn(t.shape, generator=gen) for n, t in model.state_dict().items()}
    result = _search(model, batches, {"pretrained": Reference(useless)})
    assert result.config.residual == "none"


def test_restore_is_what_the_search_evaluated(tmp_path):
    """Training resumes from exactly the weights the search judged, bit for bit."""
    model, x, y, gen, batches = _task()
    seen: list[dict[str, torch.Tensor]] = []
    loss = mean_loss(batches)

    def metric(m):
        seen.append({n: t.detach().clone() for n, t in m.state_dict().items()})
        return loss(m)

    comp = Compressor(
        model,
        tmp_path / "s",
        QuantConfig(min_numel=1024),
        threshold=0.01,
        metric=metric,
        pretrained=None,
        search_space=SearchSpace(prune_by=("magnitude",), residuals=("previous",)),
    )
    comp.compress(1)
    _fine_tune(model, x, y, gen)
    seen.clear()
    comp.compress(2)
    result = comp.last_search
    assert result.config.residual == "previous"  # (the first checkpoint, a keyframe, is coded directly)
    index = next(i for i, c in enumerate(result.candidates) if c.config == result.config)
    evaluated = seen[1 + index]  # the first call is the baseline
    restored, _, meta = read_checkpoint(comp.store, "step-2")
    assert meta["search"]["residual"] == "previous"
    assert all(torch.equal(restored[n], evaluated[n]) for n in restored)


def test_sharded_refuses_residual_coding():
    from hf_dynaquant.training.sharded import ShardedCompressor

    with pytest.raises(UnsupportedSetupError, match="residual"):
        ShardedCompressor(_mlp(), "unused", QuantConfig(residual="previous"))


# -- pre-trained weights -----------------------------------------------------------------------


def _gpt2(folder):
    """A small GPT-2 saved with save_pretrained and loaded back with from_pretrained (so it knows
    its folder), and the weights it started from."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    _drift(model, 0.002, 1)  # "fine-tuned a little"
    return model, start


def test_pretrained_residual_round_trip_and_missing_weights(tmp_path):
    from hf_dynaquant.errors import MissingPretrainedError

    model, start = _gpt2(tmp_path / "base")
    config = QuantConfig(bins=4, prune=0.2, protect=0.0, residual="pretrained")
    comp = Compressor(model, tmp_path / "s", config)  # pretrained="auto": the folder from_pretrained read
    assert comp.pretrained is not None
    comp.compress(1)
    _drift(model, 0.002, 2)
    comp.compress(2)  # a delta entry: code delta on top of the pre-trained residual
    store = comp.store
    name = "transformer.h.0.attn.c_attn.weight"
    with store.open("step-2") as entry:
        assert entry.metadata["quant_config"]["residual"] == "pretrained"
        assert entry.metadata["pretrained"]["source"] == str((tmp_path / "base").resolve())
        assert entry.record("model", name)["params"]["residual"] == "pretrained"
    state, _, _ = read_checkpoint(store, "step-2")
    exact = model.state_dict()[name]
    assert float((state[name] - exact).abs().mean()) < 0.002  # the drift is coded, not the weights
    direct = _direct_error(exact)
    assert float((state[name] - exact).abs().mean()) < direct / 4  # (weights std 0.02, drift 0.003)
    assert store.verify(deep=True) == []
    new = store.compact("step-2")  # stays exact, still against the pre-trained weights
    compacted, _, _ = read_checkpoint(store, new)
    assert all(torch.equal(compacted[n], state[n]) for n in state)
    # a changed pre-trained file: a clear error naming the source and the entry
    weights = tmp_path / "base" / "model.safetensors"
    weights.rename(tmp_path / "moved.safetensors")
    with pytest.raises(MissingPretrainedError, match=r"entry [0-9a-f]{16}.*base"):
        read_checkpoint(store, "step-2")
    assert any("pre-trained" in p for p in store.verify(deep=True))
    (tmp_path / "moved.safetensors").rename(weights)
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(MissingPretrainedError, match="SHA-256"):
        read_checkpoint(store, "step-1")


def _direct_error(w: torch.Tensor) -> float:
    tp = plan_quantization({"w": w}, QuantConfig(bins=4, prune=0.2, protect=0.0)).tensors["w"]
    codes, prot = quantize(w, tp)
    return float(np.abs(decoded_values(codes, tp.centres, prot) - w.reshape(-1).numpy()).mean())


def test_continue_chain_keeps_the_pretrained_weights_of_the_entry(tmp_path):
    model, _ = _gpt2(tmp_path / "base")
    comp = Compressor(model, tmp_path / "s", QuantConfig(bins=4, residual="pretrained"))
    comp.compress(1)
    # a new process whose model names no source: the chain keeps the entry's pre-trained weights
    resumed = Compressor(model, comp.store, QuantConfig(bins=4, residual="pretrained"), pretrained=None)
    assert resumed.pretrained is None
    resumed.continue_chain("step-1")
    assert resumed.pretrained is not None
    resumed.compress(2)
    with comp.store.open("step-2") as entry:
        assert entry.metadata["pretrained"] == comp.pretrained.descriptor
    assert comp.store.verify(deep=True) == []


def test_sizes_count_the_code_delta_on_the_base_entry():
    """Direct codes change little between checkpoints and are stored as a code delta: the search
    sizes them so, or it would prefer residuals that store larger."""
    from hf_dynaquant.search import measured_bits

    model = _mlp()
    snap = {n: t.detach().clone() for n, t in model.state_dict().items() if t.dim() >= 2}
    plan = plan_quantization(snap, QuantConfig(bins=8, min_numel=1024))
    base = {n: quantize(snap[n], tp)[0] for n, tp in plan.tensors.items()}
    alone = measured_bits(snap, plan)
    assert measured_bits(snap, plan, base_codes=base) < alone / 20  # same codes: a near-empty delta
    unrelated = {n: np.roll(c, 1) for n, c in base.items()}
    assert measured_bits(snap, plan, base_codes=unrelated) == pytest.approx(alone, rel=0.02)  # never larger


def _going_on_from_direct(centre, threshold, delta_bits=None):
    """``(result, last, space)`` of a neighbourhood search of a fine-tune that goes on from the
    direct configuration at ``centre``, with residuals on the pre-trained weights offered (and
    ``delta_bits``: what each kind's last delta on its own kind cost, see ``chain_cost``)."""
    model, x, y, gen, batches = _task()
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    _fine_tune(model, x, y, gen)
    snapshot = {n: t.detach().clone() for n, t in model.state_dict().items() if t.dim() >= 2}
    space = SearchSpace(residuals=("pretrained", "none"), prune_by=("magnitude",))
    search = ConfigurationSearch(
        mean_loss(batches), threshold, search_space=space, config=QuantConfig(min_numel=1024), z=0.0
    )
    search.last = last = space.config(centre, "magnitude", search.config, 32, residual="none")
    search.delta_bits = dict(delta_bits or {})
    return search.search(model, snapshot, references={"pretrained": Reference(start)}), last, space


def test_neighbourhood_takes_the_smallest_passing_of_either_kind():
    """Going on from a direct configuration that now fails: the search answers with the
    passing candidate of fewest measured bits among the centre's other residual kind and the
    points less aggressive than the centre, and evaluates only those points that measure
    smaller than the best candidate round 1 found (never bolder than the centre)."""
    centre = (0, 0, 0)  # the boldest point: 3 bins, half pruned; coded directly it loses far more than 0.05%
    result, last, space = _going_on_from_direct(centre, 0.0005)
    assert result.mode == "neighbourhood"
    first, second = result.candidates[:2]
    assert first.config == last and not first.passed  # the centre under its own kind fails
    assert second.config.residual == "pretrained" and second.passed  # and passes as a residual
    assert all(a >= b for c in result.candidates for a, b in zip(space.point_of(c.config), centre))  # never bolder
    assert all(c.bits < second.bits for c in result.candidates[2:])  # only points smaller than round 1's best
    passing = [c for c in result.candidates if c.passed]
    assert result.config == min(passing, key=lambda c: c.bits).config


def test_neighbourhood_searches_another_kind_around_the_centre_bolder_too():
    """The centre is the last kind's point, not the other kind's: going on from a fine direct
    configuration, the residual on the pre-trained weights is judged at every point around the
    centre that measures smaller than round 1's best, bolder ones included, and the search takes
    a bolder residual point than the centre; the last kind itself never goes bolder."""
    centre = (6, 5, 1)  # 32 bins, unpruned, 0.5% protected: passes coded directly, at many bits
    result, last, space = _going_on_from_direct(centre, 0.01)
    assert result.mode == "neighbourhood"
    first = result.candidates[:2]
    assert first[0].config == last and first[0].passed
    assert first[1].config.residual == "pretrained" and first[1].passed
    round_one = min(c.bits for c in first)
    assert all(c.bits < round_one for c in result.candidates[2:])  # only points smaller than round 1's best
    for c in result.candidates:
        point = space.point_of(c.config)
        assert all(abs(a - b) <= 1 for a, b in zip(point, centre))  # within epsilon
        if c.config.residual == "none":
            assert all(a >= b for a, b in zip(point, centre))  # the last kind never bolder
    assert result.config.residual == "pretrained"
    assert any(a < b for a, b in zip(space.point_of(result.config), centre))  # bolder than the centre
    chosen = next(c for c in result.candidates if c.config == result.config)
    assert chosen.passed and chosen.bits < round_one


def test_neighbourhood_leaves_other_kinds_to_the_fallback_when_nothing_passes():
    """When round 1 finds nothing passing, the other kinds' points around the centre are not
    evaluated one by one: the fallback's walk orders every kind's cube by size."""
    centre = (0, 0, 0)  # 3 bins, half pruned: at a 0.001% threshold nothing passes there
    result, last, space = _going_on_from_direct(centre, 0.00001)
    assert result.mode == "fallback"
    round_one = result.candidates[:2]
    assert not any(c.passed for c in round_one)
    after = result.candidates[2:]
    # before the fallback only the last kind's less aggressive points (at most 7) come
    fallback_start = next((i for i, c in enumerate(after) if c.config.bins == space.bins[-1]), len(after))
    assert all(c.config.residual == "none" for c in after[:fallback_start])


def test_the_search_minimises_this_checkpoint_and_the_next():
    """Candidates are ranked by chain cost: their size now plus what the next checkpoint of their
    kind is expected to cost (the kind's last delta on its own kind, else their own size). With
    no history that ranks as size does; when the pre-trained residual's deltas are known to be
    dear, the direct coding that is larger now but cheap to go on from is kept."""
    centre = (2, 5, 1)  # 6 bins, unpruned: passes coded directly and as a residual
    by_size, _, _ = _going_on_from_direct(centre, 0.01)
    assert by_size.config.residual == "pretrained"
    dear = {"pretrained": 10.0}
    result, last, space = _going_on_from_direct(centre, 0.01, delta_bits=dear)
    cost = lambda c: c.bits + dear.get(c.config.residual, c.bits)  # noqa: E731
    chosen = next(c for c in result.candidates if c.config == result.config)
    assert result.config == last and chosen.bits > min(c.bits for c in by_size.candidates if c.passed)
    assert chosen == min((c for c in result.candidates if c.passed), key=cost)
    round_one = min(cost(c) for c in result.candidates[:2] if c.passed)
    assert all(cost(c) < round_one for c in result.candidates[2:])  # only points cheaper than round 1's best


def test_delta_costs_go_along_the_chain_and_come_back_on_a_resume(tmp_path):
    """The search records what a delta of each kind on its own kind cost (the entry's ``bits``),
    each entry's search record keeps those costs (``delta_bits``), and a run resumed in a new
    process reads them back, so it ranks as the process that wrote the chain would have."""
    model, x, y, gen, batches = _task()
    settings = dict(threshold=0.01, metric=mean_loss(batches), pretrained=None, keyframe_every=100)
    space = SearchSpace(residuals=("previous", "none"), prune_by=("magnitude",))
    comp = Compressor(model, tmp_path / "s", QuantConfig(min_numel=1024), search_space=space, **settings)
    chosen = []  # (residual kind, bits) per step
    for step in (1, 2, 3, 4):
        _fine_tune(model, x, y, gen, steps=3)
        comp.compress(step)
        result = comp.last_search
        assert result.to_dict()["bits"] == result.bits
        chosen.append((result.config.residual, result.bits))
    expected = {kind: bits for (before, _), (kind, bits) in zip(chosen, chosen[1:]) if kind == before}
    assert expected and comp.search.delta_bits == expected
    resumed = Compressor(model, comp.store, QuantConfig(min_numel=1024), search_space=space, **settings)
    resumed.continue_chain("step-4")
    assert resumed.search.delta_bits == pytest.approx(expected)


def _float_bytes(obj, seen=None) -> int:
    """Bytes of the float arrays and tensors reachable from ``obj`` through containers and plain
    objects (each storage once; modules, optimizers and functions are not followed)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, type)) or callable(obj):
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        key = ("storage", obj.untyped_storage().data_ptr())
        if not obj.is_floating_point() or key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, np.ndarray):
        base = obj if obj.base is None else obj.base
        if obj.dtype.kind != "f" or ("array", id(base)) in seen:
            return 0
        seen.add(("array", id(base)))
        return base.nbytes
    if isinstance(obj, dict):
        return sum(_float_bytes(k, seen) + _float_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_float_bytes(v, seen) for v in obj)
    fields = getattr(obj, "__dict__", None)
    return _float_bytes(fields, seen) if fields is not None else 0


def test_between_checkpoints_only_the_codes_are_kept(tmp_path):
    """From one background checkpoint to the next a compressor holds the last checkpoint's codes
    (the next delta's base and "previous" residual, with the reference such codes decode against)
    and no other copy of the weights' size: no plan (sensitivities, references), no decoded copy,
    and the snapshot's tensors are dropped
    once written. At 124M parameters these had kept 1.3x the checkpoint between saves, so a GPU
    run's host memory peaked at 4.1x (benchmarks/RESULTS.md, session 21)."""
    model, x, y, gen, batches = _task()
    space = SearchSpace(residuals=("previous",), prune_by=("magnitude",))
    comp = Compressor(model, tmp_path / "s", QuantConfig(min_numel=1024), search_space=space, threshold=0.01,
                      metric=mean_loss(batches), pretrained=None, keyframe_every=100)
    manager = CheckpointManager(comp)
    weights = sum(p.numel() * 4 for p in model.parameters())
    for step in (1, 2, 3):
        _fine_tune(model, x, y, gen, steps=3)
        pending = manager.take(step, writer=True)
        folder = tmp_path / "run" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        manager.write(pending, folder, small_files=(), remove_plain_files=False)
        manager.wait()
        snap = pending.snapshot
        assert snap.state == {} and snap.optimizer is None and snap.gradient_ema == {}  # released once written
        held = {k: v for k, v in vars(comp).items() if k not in ("model", "optimizer", "ema", "store", "search")}
        # a residual on the previous checkpoint decodes as its reference plus its codes' centres:
        # the kept codes carry that one float32 copy, nothing else of the weights' size
        assert _float_bytes(held) < 1.05 * weights
        assert comp.last_search.plan is None and all(c.plan is None for c in comp.last_search.candidates)
    assert comp.last_search.config.residual == "previous"
    # what the next checkpoint's "previous" residual is coded against is still the last one as restored
    restored, _, _ = read_checkpoint(comp.store, "checkpoint-3")
    previous = comp._previous_values(restored)
    assert previous and all(torch.equal(restored[n].float(), v) for n, v in previous.items())



def test_a_foreground_save_stored_losslessly_is_the_next_residuals_reference_as_it_was(tmp_path):
    """A foreground save takes the live CPU tensors as its snapshot (no copy). When nothing
    passes the search, its weights are stored losslessly, and the next "previous" residual must
    be coded against those values as stored, not against the live tensors training has moved
    since: that residual would be zero (it passes any threshold) and restore the older weights."""
    model, x, y, gen, batches = _task()
    space = SearchSpace(residuals=("previous",), prune_by=("magnitude",))
    comp = Compressor(model, tmp_path / "s", QuantConfig(min_numel=1024), search_space=space, threshold=1e-12,
                      metric=mean_loss(batches), pretrained=None, keyframe_every=100)
    manager = CheckpointManager(comp, background=False)
    before = None
    for step in (1, 2, 3):
        _fine_tune(model, x, y, gen, steps=3)
        exact = {n: t.detach().clone() for n, t in model.state_dict().items()}
        folder = tmp_path / "run" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        manager.write(manager.take(step, writer=True), folder, small_files=(), remove_plain_files=False)
        restored, _, _ = read_checkpoint(comp.store, f"checkpoint-{step}")
        if step == 1:
            assert comp.last_search.config is None  # nothing passed: stored losslessly
        else:  # a residual coded against the moved live weights would restore the step before
            assert comp.last_search.config.residual == "previous"
            for name in ("0.weight", "2.weight"):
                error = float((restored[name] - exact[name]).norm())
                assert error < 0.5 * float((exact[name] - before[name]).norm()), (step, name)
        before = exact


def test_a_residual_on_the_previous_checkpoint_may_go_bolder():
    """Unlike the weights, the update since the previous checkpoint shrinks as the learning rate
    decays: going on from a passing residual on the previous checkpoint, the search also judges
    that kind's bolder points around the centre (cheaper ones only) and takes one that passes."""
    model, x, y, gen, batches = _task()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    _fine_tune(model, x, y, gen)
    snapshot = {n: t.detach().clone() for n, t in model.state_dict().items() if t.dim() >= 2}
    space = SearchSpace(residuals=("previous",), prune_by=("magnitude",))
    search = ConfigurationSearch(
        mean_loss(batches), 0.01, search_space=space, config=QuantConfig(min_numel=1024), z=0.0
    )
    centre = (3, 5, 1)  # 8 bins, unpruned: a small update passes there with room to spare
    search.last = last = space.config(centre, "magnitude", search.config, 32, residual="previous")
    result = search.search(model, snapshot, references={"previous": Reference(before)})
    assert result.mode == "neighbourhood"
    assert result.candidates[0].config == last and result.candidates[0].passed
    assert all(c.bits < result.candidates[0].bits for c in result.candidates[1:])
    point = space.point_of(result.config)
    assert all(abs(a - b) <= 1 for a, b in zip(point, centre)) and any(a < b for a, b in zip(point, centre))


# -- anchors (restore_depth) ----------------------------------------------------------------------


def test_anchors_take_no_previous_residual_and_restore_as_the_compressor_holds(tmp_path):
    """With ``restore_depth=1`` every checkpoint after the first delta is an anchor, coded on the
    keyframe: it takes no ``"previous"`` residual (the store would decode one against the keyframe,
    not the checkpoint it was taken on), and every entry restores to exactly the decoded weights
    the compressor holds for the next residual."""
    model = _mlp()
    config = replace_config("previous")
    comp = Compressor(model, tmp_path / "s", config, pretrained=None, keyframe_every=8, restore_depth=1)
    for step in range(1, 6):
        _drift(model, 0.005, step)
        comp.compress(step)
        state, _, meta = read_checkpoint(comp.store, f"step-{step}")
        assert meta["quant_config"]["residual"] == ("previous" if step == 2 else "none"), step
        assert len(comp.store.chain(f"step-{step}")) == (1 if step == 1 else 2)
        for name, ref in comp._previous_values(state).items():
            assert torch.equal(state[name].float(), ref), (step, name)
    assert comp.store.verify(deep=True) == []


def test_excp_anchors_code_their_residuals_on_the_keyframe(tmp_path, monkeypatch):
    """ExCP codes each checkpoint's weights as a residual on its base entry's restored weights,
    which the compressor hands it: at an anchor the keyframe's, not the last checkpoint's (whose
    residual the store would add to the keyframe's)."""
    from hf_dynaquant.training import compressor as compressor_module

    handed = []
    real = compressor_module.excp_checkpoint
    spy = lambda snap, previous, *a: handed.append(previous) or real(snap, previous, *a)  # noqa: E731
    monkeypatch.setattr(compressor_module, "excp_checkpoint", spy)
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    comp = Compressor(model, tmp_path / "s", codec="excp", optimizer=optimizer, keyframe_every=8, restore_depth=1)
    for step in range(1, 5):
        model(torch.randn(64, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        comp.compress(step)
    keyframe, _, _ = read_checkpoint(comp.store, "step-1")
    second, _, _ = read_checkpoint(comp.store, "step-2")
    assert handed[0] is None and [len(comp.store.chain(f"step-{s}")) for s in range(1, 5)] == [1, 2, 2, 2]
    for previous in handed[1:]:  # the second checkpoint's base is the keyframe too; the others are anchors
        assert torch.equal(previous["0.weight"], keyframe["0.weight"].float())
    assert not torch.equal(second["0.weight"], keyframe["0.weight"])  # (the two bases would differ)
    assert comp.store.verify(deep=True) == []


def test_an_anchor_leaves_the_searched_delta_costs_as_they_were(tmp_path):
    """An anchor is coded on the keyframe, so its size is not what the next delta on the checkpoint
    before costs: the search records delta costs (``delta_bits``) only for deltas on the last one."""
    model, x, y, gen, batches = _task()
    settings = dict(threshold=0.01, metric=mean_loss(batches), pretrained=None, keyframe_every=100, restore_depth=1)
    space = SearchSpace(residuals=("none",), prune_by=("magnitude",))
    comp = Compressor(model, tmp_path / "s", QuantConfig(min_numel=1024), search_space=space, **settings)
    bits = []
    for step in (1, 2, 3, 4):
        _fine_tune(model, x, y, gen, steps=3)
        comp.compress(step)
        bits.append(comp.last_search.bits)
    assert [len(comp.store.chain(f"step-{s}")) for s in (1, 2, 3, 4)] == [1, 2, 2, 2]  # 3 and 4: anchors
    assert comp.search.delta_bits == {"none": bits[1]}
