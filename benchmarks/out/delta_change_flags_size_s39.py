# session 39: would a delta coded as change flags be as small as today's? On one 124M fp32 delta (bench_scale's
# setup: a keyframe, two AdamW steps, a delta), each tensor whose delta the codec weighs, its codes against its
# base's; flag formats sized by ans_bytes (each group's order-0 entropy plus its exact table, what rANS reaches to a
# few bytes), today's delta by the codec's own coding (_delta_payload, pairs where it takes them):
#   now:        today's delta (regrouped by the previous code, one model a group; pairs where smaller)
#   bitmap8:    which values changed, in element order, 8 flags a byte, one model; then the changed values' deltas,
#               one model per previous code (no regrouping pass: the encoder's cheapest form)
#   group8:     the flags regrouped by the previous code, 8 a byte, a model a group; the deltas as bitmap8's
#   group4:     the same, 4 flags a symbol (tables of 16)
# first as delta streams, then as stored: each tensor keeps the smaller of its keyframe (encode_codes_packed, as the
# codec codes one) and its delta; by how many of a tensor's values changed and its level count; and the change rate
# of each previous code of the weights' (10-level) deltas. Log: delta_change_flags_size_s39.log
import collections
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np
import torch
from bench_scale import CONFIG, SIZES, fresh, train_step
from transformers import GPT2Config

import hf_dynaquant.codecs.dynaquant as dq
from hf_dynaquant import Compressor
from hf_dynaquant.core.delta import current_counts
from hf_dynaquant.core.entropy import ans_bytes, encode_codes_packed

captured = []
grouped_delta = dq.grouped_delta


def capture(prev, cur, levels):
    grouped, pairs = grouped_delta(prev, cur, levels)
    captured.append((prev.copy(), cur.copy(), levels, pairs.copy(), grouped.copy()))
    return grouped, pairs


dq.grouped_delta = capture
torch.manual_seed(0)
model, opt = fresh(GPT2Config(**SIZES["124M"]), torch.float32)
train_step(model, opt, 0)
folder = tempfile.mkdtemp()
c = Compressor(model, os.path.join(folder, "s"), CONFIG, optimizer=opt)
c.compress(1)
train_step(model, opt, 1)
train_step(model, opt, 2)
captured.clear()
c.compress(3)
shutil.rmtree(folder)


def flag_rows(changed, prev, levels, width):
    """Histograms of the flags of each previous code's values, `width` to a symbol."""
    rows = []
    for k in range(levels):
        mine = changed[prev == k]
        if mine.size:
            symbols = np.packbits(mine, bitorder="little")
            if width == 4:
                symbols = np.stack([symbols & 15, symbols >> 4], 1).ravel()[: (mine.size + 3) // 4]
            rows.append(np.bincount(symbols, minlength=1 << width))
    return np.array(rows)


total = collections.defaultdict(float)
stored = collections.defaultdict(float)
rates = collections.defaultdict(lambda: [0, 0])
for prev, cur, levels, pairs, grouped in captured:
    now = len(dq._delta_payload(prev, grouped, "ans", pairs, ans_bytes(pairs))[1])
    keyframe = len(encode_codes_packed(cur, current_counts(pairs, levels))[1])
    changed = prev != cur
    if levels == 10:
        for k in range(levels):
            rates[k][0] += int(pairs[k].sum())
            rates[k][1] += int(pairs[k].sum() - pairs[k, 0])
    values = pairs.copy()
    values[:, 0] = 0  # the changed values' deltas, a model per previous code
    deltas = ans_bytes(values)
    sizes = {
        "now": now,
        "bitmap8": ans_bytes(np.bincount(np.packbits(changed, bitorder="little"), minlength=256)[None]) + deltas,
        "group8": ans_bytes(flag_rows(changed, prev, levels, 8)) + deltas,
        "group4": ans_bytes(flag_rows(changed, prev, levels, 4)) + deltas,
    }
    share = changed.mean()
    kind = "changed <5%" if share < 0.05 else "changed 5-25%" if share < 0.25 else "changed >=25%"
    key = (kind, f"{levels} levels" if prev.size > 100_000 else "small tensors")
    total[key + ("values",)] += prev.size
    for name, size in sizes.items():
        total[key + (name,)] += size
        total[("all", "", name)] += size
        stored[name] += min(keyframe, size)
    stored["tensors stored as deltas now"] += now < keyframe
    stored["values stored as deltas now"] += prev.size * (now < keyframe)
    stored["tensors"] += 1
    stored["values"] += prev.size
for key in sorted({k[:2] for k in total if k[0] != "all"}):
    row = {name: total[key + (name,)] for name in ("now", "bitmap8", "group8", "group4")}
    print(f"{key[0]:14} {key[1]:14} {total[key + ('values',)] / 1e6:6.1f}M values  "
          + "  ".join(f"{n} {v / 1e6:.3f} MB ({v / row['now'] - 1:+.1%})" for n, v in row.items()))  # fmt: skip
row = {name: total[("all", "", name)] for name in ("now", "bitmap8", "group8", "group4")}
print("all tensors   " + "  ".join(f"{n} {v / 1e6:.3f} MB ({v / row['now'] - 1:+.1%})" for n, v in row.items()))
print(
    f"as stored (the smaller of keyframe and delta, per tensor; {int(stored['tensors'])} tensors, "
    f"{stored['values'] / 1e6:.1f}M values; today {int(stored['tensors stored as deltas now'])} of them, "
    f"{stored['values stored as deltas now'] / 1e6:.1f}M values, stored as deltas):  "
    + "  ".join(f"{n} {stored[n] / 1e6:.3f} MB ({stored[n] / stored['now'] - 1:+.1%})" for n in row)
)
print("weights' deltas (10 levels), changed share by previous code:",
      " ".join(f"{k}: {c / max(n, 1):.3f} of {n / 1e6:.1f}M" for k, (n, c) in sorted(rates.items())))  # fmt: skip
