"""Quantization-aware delta encoding between consecutive checkpoints (DynaQuant section 6).

Both checkpoints are integer codes (pruned and protected values are levels of their own).

* **Cyclic delta** (after QD-Compressor): ``D = (C_prev - C_cur) mod B`` and
  ``C_cur = (C_prev - D) mod B``, with ``B`` the larger level count of the two checkpoints, so
  deltas need no more bits than codes.
* **Regrouping** (Alg. 5 and 6): deltas are ordered by the *previous* checkpoint's code (a stable
  sort), so each quantization bucket's deltas are contiguous and a bucket with a high migration
  rate does not break the runs of the others. The decoder knows the previous codes, so it
  recomputes the same order: nothing extra is stored.
* **Run-length encoding with negated values**: each run is ``-value`` (<= 0) followed by its
  length only when the length exceeds 1 (> 0), so no marker is needed.
* **Entropy coding**: tokens become LEB128 varints (even numbers for values, odd for lengths) and
  then zstd, whose Huffman stage codes the skewed byte alphabet.

hf_dynaquant's default codes the regrouped delta with rANS, a model per group, and, where the
levels are few (at most :data:`PAIRED_LEVELS`), two deltas to a symbol (:func:`pair_up`): rANS
then takes one step for two values, and a pair's model sees what neighbouring deltas share.
Where few values changed, it codes the *gaps* between them instead (:func:`gap_up`): a token for
each changed value (how many unchanged ones came before it), then the changed values, so rANS
takes about two steps for each changed value and none for the others.
"""

from __future__ import annotations

import functools

import numpy as np

from .bitplanes import PackedCodes
from .factored import FactoredContexts
from .histogram import pair_counts
from .kernels import native
from .varint import uleb128_decode, uleb128_encode

__all__ = [
    "PAIRED_LEVELS",
    "cyclic_delta",
    "grouped_delta",
    "pair_up",
    "paired_sizes",
    "unpair",
    "GAP_ESCAPE",
    "gap_up",
    "most_gap_tokens",
    "ungap",
    "current_counts",
    "apply_delta",
    "regroup",
    "ungroup",
    "undo_regrouped_delta",
    "rle_encode",
    "rle_decode",
    "varint_encode",
    "varint_decode",
]


PAIRED_LEVELS = 16  # the most levels whose pairs of deltas fit a byte (16 x 16)


def paired_sizes(sizes: np.ndarray) -> np.ndarray:
    """The group sizes of :func:`pair_up`'s stream for groups of ``sizes`` values: each group's
    pairs, then one group of the odd groups' last values."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.append(sizes // 2, np.count_nonzero(sizes % 2))


def _group_sizes(sizes: np.ndarray, levels: int) -> np.ndarray:
    """``sizes`` as contiguous int64, checked: at most 256 groups of no negative size, at a level
    count whose pairs fit a byte."""
    if not 1 <= levels <= PAIRED_LEVELS:
        raise ValueError(f"pairs of deltas fit a byte at 1 to {PAIRED_LEVELS} levels, not {levels}")
    sizes = np.ascontiguousarray(sizes, dtype=np.int64).reshape(-1)
    if sizes.size > 256 or (sizes.size and int(sizes.min()) < 0):
        raise ValueError("group sizes must be at most 256 non-negative counts")
    return sizes


def pair_up(grouped: np.ndarray, sizes: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(symbols, histograms)``: a regrouped delta (uint8 values below ``levels`` <= 16, in
    consecutive groups of ``sizes``) two values to a symbol, ``x * levels + y``, group by group,
    then the last value of each group of odd size as a group of its own (the groups of
    :func:`paired_sizes`); and each of those groups' histogram, a row of 256 counts apiece.
    ``ValueError`` for a value at or past ``levels``."""
    sizes = _group_sizes(sizes, levels)
    lengths = paired_sizes(sizes)
    symbols = np.empty(int(lengths.sum()), dtype=np.uint8)
    counts = np.zeros((lengths.size, 256), dtype=np.int64)
    if native is not None:
        native.pair_up_u8(np.ascontiguousarray(grouped, dtype=np.uint8), sizes, levels, symbols, counts)
        return symbols, counts
    values = np.asarray(grouped, dtype=np.uint8)
    if values.size != int(sizes.sum()) or (values.size and int(values.max()) >= levels):
        raise ValueError("pair_up: a value is at or past the levels, or the sizes do not add up")
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    pieces = [values[a : a + (b - a) // 2 * 2 : 2] * levels + values[a + 1 : a + (b - a) // 2 * 2 : 2]
              for a, b in zip(bounds[:-1], bounds[1:])]  # fmt: skip
    pieces.append(values[bounds[1:][sizes % 2 == 1] - 1])
    symbols[:] = np.concatenate(pieces) if pieces else symbols
    at = np.concatenate(([0], np.cumsum(lengths)))
    for g in range(lengths.size):
        counts[g] = np.bincount(symbols[at[g] : at[g + 1]], minlength=256)
    return symbols, counts


def unpair(symbols: np.ndarray, sizes: np.ndarray, levels: int) -> np.ndarray:
    """Inverse of :func:`pair_up`: the regrouped delta. ``ValueError`` for a symbol that is no
    pair of values below ``levels``, or sizes that do not fit the symbols."""
    sizes = _group_sizes(sizes, levels)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    if native is not None:
        native.unpair_u8(np.ascontiguousarray(symbols, dtype=np.uint8), sizes, levels, out)
        return out
    symbols = np.asarray(symbols, dtype=np.uint8)
    lengths = paired_sizes(sizes)
    if symbols.size != int(lengths.sum()):
        raise ValueError("unpair: the sizes do not fit the symbols")
    at = np.concatenate(([0], np.cumsum(lengths)))
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    pairs, tails = symbols[: at[-2]], symbols[at[-2] :]
    if (pairs.size and int(pairs.max()) >= levels * levels) or (tails.size and int(tails.max()) >= levels):
        raise ValueError("unpair: a symbol is no pair of values below the levels")
    for g, a in enumerate(bounds[:-1]):
        p = pairs[at[g] : at[g + 1]]
        out[a : a + 2 * p.size : 2], out[a + 1 : a + 2 * p.size : 2] = p // levels, p % levels
    out[bounds[1:][sizes % 2 == 1] - 1] = tails
    return out


GAP_ESCAPE = 31  # the gap token that stands for this many unchanged values, with no changed one after them


def most_gap_tokens(sizes: np.ndarray) -> np.ndarray:
    """The most tokens :func:`gap_up` gives groups of ``sizes`` values: one for each value, and
    one for each :data:`GAP_ESCAPE` of them (a reader refuses counts past this before it decodes)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return sizes + sizes // GAP_ESCAPE


def gap_up(grouped: np.ndarray, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(symbols, histograms, token_counts)``: a regrouped delta as the gaps between its values
    that are not 0. ``pairs`` is its :func:`grouped_delta` count table (row ``g``: group ``g``'s
    deltas by value; the levels are its columns). For each group, in order, a token for each
    value that is not 0: the number of 0s before it (since the group's start or the last such
    value) where that is below :data:`GAP_ESCAPE`, with a token :data:`GAP_ESCAPE` ahead of it for
    each :data:`GAP_ESCAPE` 0s (the group's trailing 0s take none); then each group's values that
    are not 0, less 1, in order. ``token_counts[g]`` is how many tokens group ``g`` took;
    ``histograms`` holds a row of 256 counts for each of the stream's groups (every group's tokens,
    then every group's values: the values' taken from ``pairs``). A delta where few values changed
    (a weight's, two steps on: 1-6%) then takes a rANS step or two for each changed value and none
    for the others. ``ValueError`` for a value at or past the levels, or ``pairs`` whose sizes or
    count of changed values are not the delta's."""
    pairs = np.asarray(pairs, dtype=np.int64)
    groups, levels = pairs.shape
    if groups > 256 or not 1 <= levels <= 256:
        raise ValueError(f"gap_up takes at most 256 groups of 1 to 256 levels, not {pairs.shape}")
    sizes, changed = pairs.sum(axis=1), pairs[:, 1:].sum(axis=1)
    values = np.ascontiguousarray(grouped, dtype=np.uint8).reshape(-1)
    if values.size != int(sizes.sum()):
        raise ValueError(f"gap_up: {values.size} deltas, but the pairs count {int(sizes.sum())}")
    counts = np.zeros((2 * groups, 256), dtype=np.int64)
    counts[groups:, : levels - 1] = pairs[:, 1:]
    token_counts = np.zeros(groups, dtype=np.int64)
    rest = np.empty(int(changed.sum()), dtype=np.uint8)
    if native is not None:  # (room for the most tokens, and 4 the kernel may write past them)
        gaps = np.empty(int(changed.sum() + (sizes // GAP_ESCAPE).sum()) + 4, dtype=np.uint8)
        gaps = gaps[: native.gap_up_u8(values, sizes, levels, gaps, token_counts, counts[:groups], rest)]
        return np.concatenate((gaps, rest)), counts, token_counts
    pieces, at = [], 0
    for g, size in enumerate(sizes):
        mine = values[at : at + size]
        at += size
        gap = np.diff(np.flatnonzero(mine), prepend=-1) - 1
        skips = gap // GAP_ESCAPE
        piece = np.full(int(skips.sum() + gap.size), GAP_ESCAPE, dtype=np.uint8)
        piece[np.cumsum(skips + 1) - 1] = gap % GAP_ESCAPE
        pieces.append(piece)
        token_counts[g] = piece.size
        counts[g] = np.bincount(piece, minlength=256)
    nonzero = values[values != 0]
    if nonzero.size != rest.size or (values.size and int(values.max()) >= levels):
        raise ValueError("gap_up: a value is at or past the levels, or the changed values or tokens do not fit")
    rest[:] = nonzero - 1
    return np.concatenate([*pieces, rest]), counts, token_counts


def ungap(symbols: np.ndarray, token_counts: np.ndarray, sizes: np.ndarray, levels: int) -> np.ndarray:
    """Inverse of :func:`gap_up`: the regrouped delta of groups of ``sizes`` values whose gaps
    took ``token_counts`` tokens each. ``ValueError`` for counts past :func:`most_gap_tokens` or
    the symbols, gaps that run past their group's end, a token past :data:`GAP_ESCAPE`, a value
    at or past ``levels - 1``, or values that are not one for each gap."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64).reshape(-1)
    token_counts = np.ascontiguousarray(token_counts, dtype=np.int64).reshape(-1)
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8).reshape(-1)
    if (
        sizes.size > 256
        or token_counts.size != sizes.size
        or not 1 <= levels <= 256
        or (sizes.size and (int(sizes.min()) < 0 or int(token_counts.min()) < 0))
        or np.any(token_counts > most_gap_tokens(sizes))  # (each bounded, the sum cannot wrap)
        or int(token_counts.sum()) > symbols.size
    ):
        raise ValueError("ungap: at most 256 groups, and a token count for each that fits the group and the symbols")
    gaps, rest = symbols[: int(token_counts.sum())], symbols[int(token_counts.sum()) :]
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    if native is not None:
        native.ungap_u8(gaps, token_counts, rest, sizes, levels, out)
        return out
    wrong = ValueError("ungap: a gap or value is out of range, or the values do not match the gaps")
    if (gaps.size and int(gaps.max()) > GAP_ESCAPE) or (rest.size and int(rest.max()) + 1 >= levels):
        raise wrong
    out[:] = 0
    bounds, at, c = np.concatenate(([0], np.cumsum(token_counts))), 0, 0
    for g, size in enumerate(sizes):
        mine = gaps[bounds[g] : bounds[g + 1]].astype(np.int64)
        ends = np.cumsum(mine + (mine < GAP_ESCAPE))  # (each value takes its place after its gap)
        places = ends[mine < GAP_ESCAPE] - 1
        if (ends.size and ends[-1] > size) or c + places.size > rest.size:
            raise wrong
        out[at + places] = rest[c : c + places.size] + 1
        c += places.size
        at += size
    if c != rest.size:
        raise wrong
    return out


def cyclic_delta(prev: np.ndarray, cur: np.ndarray, levels: int) -> np.ndarray:
    """``(prev - cur) mod levels`` as uint8 (codes must be below ``levels`` <= 256)."""
    return _cyclic(prev, cur, levels)


def grouped_delta(
    prev: np.ndarray | PackedCodes | FactoredContexts, cur: np.ndarray, levels: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(grouped, pairs)``: the :func:`cyclic_delta` :func:`regroup`-ed by ``prev``, and
    ``pair_counts(prev, delta)`` of the pairs there can be (``levels x levels``: the previous
    codes are below ``levels``, as :func:`cyclic_delta` requires, and so are the differences),
    where the kernel is built in one pass over the codes that places each difference in its
    group (after counting ``prev``), then one over each group counting its pairs. The pairs hold
    every histogram the delta's coding needs: the regrouped groups' sizes (row sums) and models
    (rows), and the current codes' histogram (:func:`current_counts`). ``prev`` may come packed
    (:class:`~hf_dynaquant.core.bitplanes.PackedCodes`, as a kept state holds the previous
    checkpoint's codes): the kernel then unpacks it a cache-sized chunk at a time as it reads
    it, never whole (whole, a 124M delta's previous codes took 373 MB of new memory); or as the
    :class:`~hf_dynaquant.core.factored.FactoredContexts` a factored keyframe is coded on, never
    made (the kernel groups a row's codes a class of columns at a time)."""
    if isinstance(prev, FactoredContexts):
        if native is None or prev.size != cur.size or not 1 <= levels <= 256 or cur.dtype != np.uint8:
            return grouped_delta(prev.unpacked(), cur, levels)
        cur = np.ascontiguousarray(cur)
        grouped, pairs = np.empty_like(cur), np.empty(65536, dtype=np.int64)
        native.cyclic_factored_u8(*prev.bounded_terms(), prev.contexts, cur, levels, grouped, pairs)
        return grouped, pairs.reshape(256, 256)[:levels, :levels]
    if isinstance(prev, PackedCodes):
        if native is None or prev.size != cur.size or not 1 <= levels <= 256 or cur.dtype != np.uint8:
            return grouped_delta(prev.unpacked(), cur, levels)
        cur = np.ascontiguousarray(cur)
        grouped, pairs = np.empty_like(cur), np.empty(65536, dtype=np.int64)
        packed = np.ascontiguousarray(prev.data, dtype=np.uint8)
        native.cyclic_packed_u8(packed, prev.width, prev.base, cur, levels, grouped, pairs)
        return grouped, pairs.reshape(256, 256)[:levels, :levels]
    if _native_u8(prev, cur) and 1 <= levels <= 256:
        grouped, pairs = np.empty_like(prev), np.empty(65536, dtype=np.int64)
        native.cyclic_u8(prev, cur, levels, grouped, pairs)
        return grouped, pairs.reshape(256, 256)[:levels, :levels]
    delta = cyclic_delta(prev, cur, levels)
    return regroup(delta, prev), pair_counts(prev, delta)[:levels, :levels]


def current_counts(pairs: np.ndarray, levels: int) -> np.ndarray:
    """The histogram (int64, 256 long) of the codes a delta was taken from, given its
    :func:`grouped_delta` counts (or any leading rows and columns of ``pair_counts`` holding
    every pair): the pair (previous code ``p``, delta ``d``) is the code ``(p - d) mod levels``."""
    rows, columns = pairs.shape
    weights = np.asarray(pairs, dtype=np.float64).ravel()  # (counts below 2^53 add exactly)
    return np.bincount(_pair_codes(levels, rows, columns), weights=weights, minlength=256).astype(np.int64)


@functools.lru_cache(maxsize=16)
def _pair_codes(levels: int, rows: int, columns: int) -> np.ndarray:
    """The code ``(p - d) mod levels`` of each pair ``(p, d)`` of a ``rows x columns`` count
    table, flat (a few distinct level counts recur over a checkpoint's tensors)."""
    codes = (np.arange(rows)[:, None] - np.arange(columns)[None, :]) % levels
    codes.flags.writeable = False
    return codes.ravel()


def apply_delta(prev: np.ndarray, delta: np.ndarray, levels: int) -> np.ndarray:
    """Inverse of :func:`cyclic_delta`: the current codes (``(prev - delta) mod levels``, the
    same operation)."""
    return _cyclic(prev, delta, levels)


def _cyclic(a: np.ndarray, b: np.ndarray, levels: int) -> np.ndarray:
    if _native_u8(a, b) and 1 <= levels <= 256:
        out = np.empty_like(a)
        native.cyclic_u8(a, b, levels, out)
        return out
    return ((a.astype(np.int16) - b.astype(np.int16)) % levels).astype(np.uint8)


def regroup(values: np.ndarray, prev_codes: np.ndarray) -> np.ndarray:
    """Values ordered by previous code (stable): each bucket's values become contiguous."""
    if _native_u8(values, prev_codes):
        out = np.empty_like(values)
        native.regroup_u8(values, prev_codes, out, False)
        return out
    return values[np.argsort(prev_codes, kind="stable")]


def ungroup(grouped: np.ndarray, prev_codes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`regroup`."""
    out = np.empty_like(grouped)
    if _native_u8(grouped, prev_codes):
        native.regroup_u8(grouped, prev_codes, out, True)
    else:
        out[np.argsort(prev_codes, kind="stable")] = grouped
    return out


def undo_regrouped_delta(
    grouped: np.ndarray,
    prev: np.ndarray | FactoredContexts,
    levels: int,
    *,
    in_place: bool = False,
    groups: np.ndarray | None = None,
) -> np.ndarray:
    """The current codes from their regrouped delta: ``apply_delta(prev, ungroup(grouped, prev),
    levels)``, in one pass where the kernel is built (a restore's delta undone). ``in_place``:
    written over ``prev`` where it is writable (each code is read before its place is written),
    for a caller that gives ``prev`` up. ``groups``: ``byte_counts(prev)`` when the caller has
    it (the delta's rANS models are made of it), so that the kernel does not count it again;
    counts that are not ``prev``'s histogram raise ``ValueError`` (in place, ``prev`` is then
    partly overwritten). ``prev`` may be the
    :class:`~hf_dynaquant.core.factored.FactoredContexts` of a factored keyframe: where the
    kernel is built they are never made (the groups' sizes are the terms', so ``groups`` is not
    read), and the codes come in a new array."""
    if isinstance(prev, FactoredContexts):
        if native is None or grouped.dtype != np.uint8 or grouped.size != prev.size or not 1 <= levels <= 256:
            return undo_regrouped_delta(grouped, prev.unpacked(), levels, in_place=True, groups=groups)
        out = np.empty(prev.size, dtype=np.uint8)
        native.ungroup_factored_u8(np.ascontiguousarray(grouped), *prev.bounded_terms(), prev.contexts, levels, out)
        return out
    if _native_u8(grouped, prev) and 1 <= levels <= 256:
        out = prev if in_place and prev.flags.writeable else np.empty_like(prev)
        if groups is None:
            native.ungroup_cyclic_u8(grouped, prev, levels, out)
        else:
            counts = np.zeros(256, dtype=np.int64)
            counts[: groups.size] = groups  # (byte_counts ends at the largest code present)
            native.ungroup_cyclic_u8(grouped, prev, levels, out, counts)
        return out
    return apply_delta(prev, ungroup(grouped, prev), levels)


def _native_u8(values: np.ndarray, keys: np.ndarray) -> bool:
    """Whether the compiled counting sort applies: contiguous uint8 values and keys of one size."""
    return (
        native is not None
        and values.dtype == np.uint8
        and keys.dtype == np.uint8
        and values.shape == keys.shape
        and values.flags.c_contiguous
        and keys.flags.c_contiguous
    )


def rle_encode(values: np.ndarray) -> np.ndarray:
    """Run-length tokens of small non-negative integers: ``-value`` per run, then the run's
    length if it is longer than 1."""
    v = np.asarray(values).astype(np.int64)
    if v.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], v[1:] != v[:-1])))
    lengths = np.diff(np.append(starts, v.size))
    width = 1 + (lengths > 1)
    pos = np.cumsum(width) - width
    tokens = np.empty(int(width.sum()), dtype=np.int64)
    tokens[pos] = -v[starts]
    long_runs = lengths > 1
    tokens[pos[long_runs] + 1] = lengths[long_runs]
    return tokens


def rle_decode(tokens: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rle_encode`."""
    t = np.asarray(tokens, dtype=np.int64)
    is_value = t <= 0
    if t.size and not is_value[0]:
        raise ValueError("run-length stream starts with a length")
    if np.any(~is_value[1:] & ~is_value[:-1]):
        raise ValueError("run-length stream has two lengths in a row")
    values = -t[is_value]
    lengths = np.ones(values.size, dtype=np.int64)
    owner = np.cumsum(is_value) - 1
    lengths[owner[~is_value]] = t[~is_value]
    return np.repeat(values, lengths)


def varint_encode(tokens: np.ndarray) -> np.ndarray:
    """LEB128 bytes of RLE tokens: value ``-t`` as ``2 * -t``, length ``L`` as ``2 * L - 1``."""
    t = np.asarray(tokens, dtype=np.int64)
    return uleb128_encode(np.where(t <= 0, -2 * t, 2 * t - 1))


def varint_decode(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`varint_encode`."""
    u = uleb128_decode(data).astype(np.int64)
    return np.where(u % 2 == 0, -(u // 2), (u + 1) // 2)
