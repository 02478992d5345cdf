"""Session 47: how many bits an Adam scale's keyframe codes take with factored contexts
(core/factored.py), on a 109M-parameter GPT-2 (bench_trainer's wordpiece model) trained
``STEPS`` steps with AdamW, against the plain keyframe coding (packed codes, zstd) and their
order-0 entropy; and the other tensors' codes under the contexts' measures, which is why only
the scale's are coded with them.

    python benchmarks/out/factored_s47.py 8 40      # steps of the states measured (each trained anew)

For each state: trains, compresses it once with the 109M job's fixed configuration (3 bins, no
pruning, protection 0.0005, the callback's choice there), records every quantized tensor's codes
as the codec makes them, then codes each large 2-D scale both ways (encode and decode timed,
one thread) and prints bits a code. Also the conditional entropy of every kind's codes given
the contexts (whole levels and quarters), given the code above and the code to the left, and
of the code less the prediction's whole levels given only the prediction's quarter (4 contexts
where the quarters take 4 a level: what a cheaper grouping would code).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_trainer import make_model, wordpiece_lm_datasets  # noqa: E402

import hf_dynaquant.codecs.dynaquant as dq  # noqa: E402
from hf_dynaquant import Compressor, QuantConfig  # noqa: E402
from hf_dynaquant.core.moments import scale_plan  # noqa: E402


def trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    train, _, vocab = wordpiece_lm_datasets(64, 64)
    model = make_model(768, 12, 0, 12, 64, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)
    ids, g = train["input_ids"], torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = ids[torch.randint(0, len(ids), (8,), generator=g)]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def captured(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[dict]:
    """Every quantized tensor's codes, shape, levels and layer type, as one compressed save makes them."""
    records, original = [], dq.DynaQuantCodec._encode_state

    def spy(self, state, base, extra):
        encoded = original(self, state, base, extra)
        records.append({"kind": self.plan.layer_type, "shape": tuple(state.shape), "levels": state.levels,
                        "codes": np.array(state.codes), "stored": sum(map(len, encoded.blobs.values()))})  # fmt: skip
        return encoded

    dq.DynaQuantCodec._encode_state = spy
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as store:
            Compressor(model, store, QuantConfig(bins=3, prune=0.0, protect=0.0005), optimizer=opt).compress(1)
    finally:
        dq.DynaQuantCodec._encode_state = original
    return records


def entropy(table: np.ndarray) -> float:
    """Bits of the symbols counted in ``table``'s rows, each row with its own model."""
    t = table[table.sum(axis=1) > 0].astype(np.float64)
    p = t / t.sum(axis=1, keepdims=True)
    return float(-(t * np.log2(np.where(t > 0, p, 1))).sum())


def conditional(ctx: np.ndarray, x: np.ndarray, nctx: int, nx: int) -> float:
    return entropy(np.bincount(ctx.astype(np.int64) * nx + x, minlength=nctx * nx).reshape(nctx, nx))


def measures(records: list[dict]) -> None:
    heads = ("stored", "order 0", "| levels", "| quarters", "| above", "| left", "shifted")
    print(f"{'kind':<14} {'codes':>12} " + " ".join(f"{h:>8}" for h in heads) + "  (bits a code)")
    totals: dict[str, np.ndarray] = {}
    for r in records:
        c, shape, L = r["codes"], r["shape"], r["levels"]
        if len(shape) != 2 or shape[0] < 2 or c.size < 1 << 16:
            continue
        m = c.reshape(shape).astype(np.int64)
        rm, cm = m.mean(axis=1, keepdims=True), m.mean(axis=0, keepdims=True)
        f = (rm + cm - m.mean()).ravel()
        quarters = np.clip(np.rint(4 * f), 0, 4 * L - 1).astype(np.int64)
        x = m.ravel()
        above = np.vstack([np.zeros((1, shape[1]), np.int64), m[:-1]]).ravel()
        left = np.hstack([np.zeros((shape[0], 1), np.int64), m[:, :-1]]).ravel()
        row = np.array([
            c.size,
            8 * r["stored"],
            entropy(np.bincount(x, minlength=L)[None]),
            conditional(np.clip(np.rint(f), 0, L - 1), x, L, L),
            conditional(quarters, x, 4 * L, L),
            conditional(above, x, L, L),
            conditional(left, x, L, L),
            conditional(quarters % 4, x - quarters // 4 + 64, 4, 256),
        ])  # fmt: skip
        totals[r["kind"]] = totals.get(r["kind"], 0) + row
    for kind, t in totals.items():
        print(f"{kind:<14} {int(t[0]):>12,} " + " ".join(f"{b / t[0]:>8.3f}" for b in t[1:]))
    print("(stored: as this version codes them, the scale's with factored contexts; 2-D tensors of 65,536+ codes;")
    print(" shifted: the code less the prediction's whole levels, given the prediction's quarter: 4 contexts)")


def scale_codings(records: list[dict]) -> None:
    class Blobs(dict):
        where = "tensor"

        def __call__(self, name):
            return np.frombuffer(self[name], np.uint8)

    sizes, times, n = np.zeros(2), np.zeros((2, 2)), 0
    for r in records:
        if r["kind"] != "moment_scale":
            continue
        c, shape, L = r["codes"], r["shape"], r["levels"]
        state = dq.QuantState(c, L, np.arange(L - 2, dtype=np.float32), np.zeros(0, np.uint16), "F32", shape)
        n += c.size
        for i, factored in enumerate((False, True)):
            plan = scale_plan(5.0, 1e-8, 1.0)
            plan.factored = factored
            codec = dq.DynaQuantCodec(plan)
            t0 = time.perf_counter()
            enc = codec._encode_state(state, None, {})
            t1 = time.perf_counter()
            out = codec.decode("F32", shape, enc.params, Blobs(enc.blobs))
            times[i] += (t1 - t0, time.perf_counter() - t1)
            assert np.array_equal(out.codes, c)
            sizes[i] += sum(len(b) for b in enc.blobs.values())
    for i, name in enumerate(("plain keyframe", "factored contexts")):
        print(f"scale codes, {name:<18} {sizes[i] / 1e6:7.2f} MB  {8 * sizes[i] / n:.3f} bits a code  "
              f"encode {times[i, 0]:.2f} s  decode {times[i, 1]:.2f} s  ({n:,} codes, one thread)")  # fmt: skip
    print(f"factored / plain: {sizes[1] / sizes[0]:.3f}")


if __name__ == "__main__":
    for steps in map(int, sys.argv[1:] or ["8", "40"]):
        print(f"== 109M GPT-2 after {steps} AdamW steps")
        records = captured(*trained(steps))
        measures(records)
        scale_codings(records)
