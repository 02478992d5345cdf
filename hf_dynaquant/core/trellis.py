"""Trellis-coded quantization (TCQ; Marcellin & Fischer, IEEE Trans. Commun. 1990) on a uniform grid.

A scalar quantizer gives away up to 1.53 dB (a quarter of a bit a value at these rates) against
the best coding of the same values; TCQ wins back about 1 dB of it with a Viterbi search and a
decoder that is a table lookup and a state machine. The grid ``c0 + i * step`` (``i`` from 0 to
``L - 1``, ``L`` a multiple of 4) is split into four subsets by ``i % 4``; an 8-state trellis
(:data:`NEXT`, :data:`SUB`, Ungerboeck's amplitude-modulation code) allows from each state only
the two subsets of one parity, ``i % 2 == state % 2``, and each subset leads to one next state.
So the stored symbol is ``i // 2`` (:func:`pack`: half as many levels, one bit less a value),
and the decoder, which follows the states, puts the parity back (:func:`unpack`). The encoder
picks, with the Viterbi algorithm, the path of grid levels of least squared error
(:func:`round_sequences`; the compiled kernel also rounds a linear layer's columns inside GPTQ's
error feedback, :mod:`.feedback`).

The trellis runs down each column of a ``rows x cols`` tensor (the sequence is the column's
rows, from state 0), over the values that are neither pruned nor protected: codes ``0`` and
``1`` keep their meaning and leave the state alone, and every other code is ``2 + i``. A tensor
whose rows use two codebooks (the rare rows of an input embedding, ``QuantConfig.rare_bins``)
has a grid for each kind of row and a trellis down each column for each kind. Measured
on all-MiniLM-L6-v2 (benchmarks/RESULTS.md, issue 19): at the same output error of each linear
layer, 9% fewer bits than one K-means codebook per tensor.
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import native

__all__ = ["NEXT", "SUB", "MAX_LEVELS", "grid", "matched_grid", "pack", "symbol_counts", "unpack", "round_sequences"]

# the trellis: from state s, subset SUB[s][b] leads to state NEXT[s][b]
NEXT = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3], [4, 5], [6, 7]], dtype=np.int64)
SUB = np.array([[0, 2], [1, 3], [2, 0], [3, 1], [2, 0], [3, 1], [0, 2], [1, 3]], dtype=np.int64)
# the next state after a level of subset d from state s (every state allows the two subsets of its parity)
_AFTER = np.full((8, 4), -1, dtype=np.int64)
for _s in range(8):
    for _b in range(2):
        _AFTER[_s, SUB[_s, _b]] = NEXT[_s, _b]

FIRST = 2  # codes 0 (pruned) and 1 (protected) are not grid levels (quantizer.FIRST_CENTRE, which imports this module)
MAX_LEVELS = 252  # grid levels a one-byte code can name after the two special codes, a multiple of 4
# how far past the K-means codebook's outer centres the grid reaches: error feedback moves the
# values it has yet to round by the errors of those already rounded, past the range they began in
REACH = 1.5


def grid(centres: np.ndarray, step: float | None = None) -> tuple[np.ndarray, float]:
    """``(levels, step)``: the uniform grid TCQ rounds a tensor to, from its ``k`` K-means
    centres (sorted). Unless ``step`` is given, each parity's levels (the subsets one state
    allows) lie ``(c[-1] - c[0]) / (k - 1)`` apart, so ``bins`` keeps its meaning: that many of
    them span the codebook's range. The grid reaches :data:`REACH` times the outer centres'
    magnitude on each side (at most :data:`MAX_LEVELS` levels, centred on 0; a finer spacing is
    widened until it reaches), and holds 0 (level ``L / 2``)."""
    if centres.size < 2 or not centres[-1] > centres[0]:
        raise ValueError("a trellis grid needs at least two distinct centres")
    step = float(centres[-1] - centres[0]) / (2 * (centres.size - 1)) if step is None else step
    reach = REACH * max(abs(float(centres[0])), abs(float(centres[-1])))
    half = 4 * max(1, math.ceil(reach / step / 4))  # a multiple of 4
    if half > MAX_LEVELS // 2:  # (past about 80 bins) the finest grid that still reaches
        half = 4 * (MAX_LEVELS // 8)
        step = reach / half
    return (np.arange(-half, half, dtype=np.float64) * step).astype(np.float32), step


def matched_grid(sequences: np.ndarray, centres: np.ndarray, limit: float = math.inf) -> tuple[np.ndarray, float]:
    """:func:`grid` whose spacing makes TCQ's squared error on ``sequences`` (float32, each row
    one trellis's values: a sample of the tensor's; values above ``limit`` in magnitude, which
    are protected, left out) that of rounding them to the nearest of the K-means ``centres``:
    the codebook's fidelity in fewer bits. Found by the secant method on the logarithms (the
    error grows about as the step squared), from the spacing :func:`grid` gives: a few Viterbi
    passes over the sample."""
    kept = np.abs(sequences) <= limit
    target = _nearest_error(sequences[kept], centres)
    _, start = grid(centres)
    step, tried, previous = start, [], None
    for _ in range(6):
        error = _tcq_error(sequences, kept, centres, step)
        tried.append((abs(math.log(error / target)) if error > 0 and target > 0 else math.inf, step))
        if target <= 0.0 or error <= 0.0 or tried[-1][0] < 0.01:
            break
        slope = 2.0
        if previous is not None and previous[1] != error and previous[0] != step:
            slope = min(max(math.log(error / previous[1]) / math.log(step / previous[0]), 0.5), 4.0)
        previous = (step, error)
        step = min(max(step * math.exp(math.log(target / error) / slope), start / 4), start * 4)
    return grid(centres, min(tried)[1])  # the closest step tried


def _nearest_error(values: np.ndarray, centres: np.ndarray) -> float:
    """The mean squared error of rounding the values to their nearest centre."""
    at = np.clip(np.searchsorted(centres, values), 1, centres.size - 1)
    lower, upper = centres[at - 1], centres[at]
    nearest = np.where(values - lower <= upper - values, lower, upper)
    return float(np.mean((values.astype(np.float64) - nearest) ** 2)) if values.size else 0.0


def _tcq_error(sequences: np.ndarray, kept: np.ndarray, centres: np.ndarray, step: float) -> float:
    """The mean squared error of TCQ on the grid of that spacing, over the kept values."""
    levels, step = grid(centres, step)
    codes = np.where(kept, FIRST, 1).astype(np.uint8)
    table = np.concatenate(([0.0, 0.0], levels)).astype(np.float32)
    round_sequences(sequences, codes, float(levels[0]), step, table)
    return float(np.mean((sequences[kept].astype(np.float64) - table[codes[kept]]) ** 2)) if kept.any() else 0.0


def pack(codes: np.ndarray, rare_rows: np.ndarray | None = None, common: int = 0) -> np.ndarray:
    """The stored symbols of TCQ codes (flat): ``2 + i`` becomes ``2 + i // 2``; 0 and 1 stay.
    With ``rare_rows`` (a byte per row, 1 for a rare one), a rare row's grid follows the
    ``common`` levels of the common rows': its ``2 + common + i`` becomes ``2 + i // 2``. One
    table look-up a code."""
    symbols = _symbol_table(0)[codes]
    if rare_rows is not None:
        rare = rare_rows.astype(bool)
        rows = symbols.reshape(rare_rows.size, -1)
        rows[rare] = _symbol_table(common)[codes.reshape(rare_rows.size, -1)[rare]]
    return symbols


def symbol_counts(code_counts: np.ndarray, common: int = 0) -> np.ndarray:
    """The counts of :func:`pack`'s symbols from the counts of the codes (one row, as long as
    the largest code; with rare rows two rows of 256, the rare rows' second, their grid after the
    ``common`` levels), the same shape: what the symbols would count, without packing them."""
    out = np.zeros(code_counts.shape, dtype=np.int64)
    for row, counts, offset in zip(np.atleast_2d(out), np.atleast_2d(code_counts), (0, common)):
        np.add.at(row, _symbol_table(offset)[: counts.size], counts)
    return out


def _symbol_table(offset: int) -> np.ndarray:
    """Each code's symbol, for a grid that starts ``offset`` levels into the centres."""
    codes = np.arange(256)
    return np.where(codes >= FIRST + offset, FIRST + ((codes - FIRST - offset) >> 1), codes).astype(np.uint8)


def unpack(stored: np.ndarray, rows: int, levels: tuple[int, ...], kinds: np.ndarray | None = None) -> np.ndarray:
    """The codes of :func:`pack`'s symbols, flat, of a ``rows x (size / rows)`` tensor whose
    trellis runs down each column over a grid of ``levels[0]`` levels; with ``kinds`` (the row
    map: 0 a common row, 1 a rare one), one trellis per column and kind of row, the rare rows'
    grid of ``levels[1]`` levels following the common rows'. Raises ``ValueError`` where a
    symbol names a level past its grid (a corrupt stream)."""
    stored = np.ascontiguousarray(stored, dtype=np.uint8).reshape(-1)
    if rows <= 0 or stored.size % rows or (kinds is not None and kinds.size != rows):
        raise ValueError(f"{stored.size} codes do not make {rows} rows")
    if len(levels) != (1 if kinds is None else 2) or min(levels) < 4 or sum(levels) > MAX_LEVELS or any(
        k % 4 for k in levels
    ):
        raise ValueError(f"trellis grids of {list(levels)} levels, not ones a writer makes")
    kinds = np.zeros(rows, dtype=np.uint8) if kinds is None else np.ascontiguousarray(kinds, dtype=np.uint8)
    sizes = (levels[0], levels[-1])
    out = stored.copy()
    if native is not None:
        if native.trellis_unpack_u8(out, kinds, sizes[0], sizes[1]) < 0:
            raise ValueError(f"a trellis symbol names a level past its grid's {list(levels)}")
        return out
    table = out.reshape(rows, -1)
    state = np.zeros((2, table.shape[1]), dtype=np.int64)
    for r in range(rows):
        k, row = int(kinds[r]), table[r]
        on = row >= FIRST
        i = 2 * (row[on].astype(np.int64) - FIRST) + (state[k, on] & 1)
        if i.size and int(i.max()) >= sizes[k]:
            raise ValueError(f"a trellis symbol names a level past its grid's {list(levels)}")
        row[on] = FIRST + k * sizes[0] + i
        state[k, on] = _AFTER[state[k, on], i & 3]
    return out


def round_sequences(x: np.ndarray, codes: np.ndarray, c0: float, step: float, table: np.ndarray) -> None:
    """The Viterbi search over each row of ``x`` (float32, ``sequences x length``): rounds the
    values whose ``codes`` (uint8, the same shape) are ``>= 2`` (the others are skipped and leave
    the state alone) to the path of grid levels of least squared error from state 0, writing
    ``2 + i`` into ``codes``. ``table``: each code's float32 value (``code_table`` of the grid);
    ``c0`` and ``step``: the grid's first level and spacing, which place a value on it. ``x`` and
    ``codes`` may instead both be transposed views of row-major matrices (``m.T``): the trellis
    then runs down each column of ``m``, without a copy. In the compiled kernel when there is
    one (the columns many at a time), else in numpy (the reference it follows, bit for bit)."""
    if native is not None:
        across = codes.T.flags.c_contiguous and not codes.flags.c_contiguous
        xs = np.ascontiguousarray(x.T if across else x, dtype=np.float32)
        native.trellis_round_f32(xs, codes.T if across else codes, x.shape[1], across, c0, step, table)
        return
    nseq, length = x.shape
    levels = table.size - FIRST
    subsets = np.arange(4, dtype=np.float64)
    top = subsets + 4 * ((levels - 1 - np.arange(4)) // 4)
    # a state's winner among its two ways in (from states t // 2 and t // 2 + 4, by branch t % 2):
    # the second only when strictly cheaper, as the kernel's loop over states in order decides
    first, second = np.arange(8) // 2, np.arange(8) // 2 + 4
    way1, way2 = 2 * first + np.arange(8) % 2, 2 * second + np.arange(8) % 2
    sub1, sub2 = SUB[first, np.arange(8) % 2], SUB[second, np.arange(8) % 2]
    same = np.tile(np.arange(8), (nseq, 1))
    cost = np.full((nseq, 8), math.inf)
    cost[:, 0] = 0.0
    back = np.empty((length, nseq, 8), dtype=np.uint8)
    pick = np.zeros((length, nseq, 8), dtype=np.uint8)  # (levels < 256)
    for t in range(length):
        v = x[:, t].astype(np.float64)
        y = (v - c0) / step
        # each subset's nearest level (the same from every state) and its squared error
        i = np.minimum(np.maximum(subsets + 4.0 * np.rint((y[:, None] - subsets) / 4.0), subsets), top)
        e = v[:, None] - table[FIRST + i.astype(np.int64)].astype(np.float64)
        ways = cost[:, np.arange(16) // 2] + (e * e)[:, SUB.reshape(-1)]  # (state, branch) in order
        two = ways[:, way2] < ways[:, way1]
        on = codes[:, t] >= FIRST
        cost = np.where(on[:, None], np.where(two, ways[:, way2], ways[:, way1]), cost)
        back[t] = np.where(on[:, None], np.where(two, second, first), same)
        pick[t] = np.where(two, i[:, sub2], i[:, sub1])
    s = np.argmin(cost, axis=1)
    rows = np.arange(nseq)
    for t in range(length - 1, -1, -1):
        on = codes[:, t] >= FIRST
        codes[on, t] = FIRST + pick[t, rows[on], s[on]]
        s = back[t, rows, s].astype(np.int64)
