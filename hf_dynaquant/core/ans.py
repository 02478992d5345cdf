"""Order-0 rANS coding of small-alphabet symbol streams, with one model per group of symbols.

Quantized codes and their deltas are streams of a few distinct byte values with a skewed
histogram. zstd's Huffman stage spends whole bits per symbol and a block header per 128 KiB,
which on such streams measured 1.4-1.5x their order-0 entropy (4-level codes: 2.15 bits per
value against 1.55; deltas after a restore: 353 KB against 233 KB over a training run). An
asymmetric numeral system (rANS, Duda 2013) reaches the entropy to within a few bytes. The
streams are those of ``constriction``'s ``AnsCoder`` (Bamler 2022: a maintained Rust
implementation with 32-bit words, a 64-bit state and 24-bit probabilities), which is the
reference implementation here. constriction holds the GIL while it codes, so a restore's
decoding ran on one core at about 50 M symbols/s and held up every other thread; the C kernels
(``csrc/ans.c``) code the same streams bit for bit with the GIL released, and are used when
built (the tests hold them to constriction's words and symbols).

The stream may be cut into *groups*: consecutive runs of symbols, each coded with its own
histogram (the delta encoder's groups are the previous checkpoint's codes, so a group's
migration rate is its own model). The decoder must know the group sizes; they are not stored.

One state decodes one symbol after another, each waiting on the last (about 120 M symbols/s on
one core here, however the loop is written), so a long stream is cut into ``L`` interleaved
*lanes*: the symbol at position ``i`` goes to lane ``i mod L``, each lane a coder of its own,
and the C decoder runs the ``L`` states in one loop, where the CPU overlaps them. Each lane is
a constriction stream of its own symbols, so constriction still decodes every lane.

Payload layout (FORMAT.md, "rANS streams"): ``uleb128(len(table))``, the ``table``, then the
coder's 32-bit words, little-endian (lane 0's, then lane 1's, ...). The table holds, for each
non-empty group in order, ``uleb128(K)`` and the ``K`` exact symbol counts (``uleb128`` each),
``K`` being the group's largest symbol plus one; with ``L > 1`` lanes, it ends with the word
counts of lanes ``0 .. L-2`` (the last lane has the words left). A group with one distinct
symbol writes no words. The model of a group is ``Categorical(counts / sum(counts),
perfect=False)``: exact counts make the model a pure function of the table, and the decoder
checks the decoded histogram against it.
"""

from __future__ import annotations

import constriction
import numpy as np

from .histogram import byte_counts
from .kernels import native
from .varint import length_prefixed, split_prefixed, uleb128_decode, uleb128_encode

__all__ = ["ans_encode", "ans_decode", "ans_counts", "ans_coding", "ans_lanes", "lanes_for", "LANES"]

# Symbols handed to the coder at once. constriction holds the GIL while it codes, so this bounds
# both the int32 copies (4 MiB) and how long a background encode can hold up the training loop's
# Python thread (about 5-10 ms); the stream does not depend on it.
_SLICE = 1 << 20

# lanes of a long stream: the states overlap in the CPU, and eight fill one AVX-512 vector, which
# the C encoder then codes a row at a time, 1.6x faster with the same words; decoding is as fast
# as with four (measured in benchmarks/RESULTS.md, issue 16)
LANES = 8
_LANES_FROM = 1 << 16  # symbols from which a stream takes LANES lanes (the extra lanes' states and
# counts, about 30 bytes, are then under 0.1% of a stream at a bit a symbol)
_CODING = "ans"  # the stream coding of one lane; "ans<L>" is L lanes (FORMAT.md section 8)


def lanes_for(n: int) -> int:
    """The lanes a writer cuts a stream of ``n`` symbols into."""
    return LANES if n >= _LANES_FROM else 1


def ans_coding(lanes: int) -> str:
    """The stream coding name (FORMAT.md) of an rANS stream in ``lanes`` lanes."""
    return _CODING if lanes == 1 else f"{_CODING}{lanes}"


def ans_lanes(coding: str) -> int:
    """The lanes of an rANS stream coding (``"ans"``: 1, ``"ans4"``: 4), 0 for another coding."""
    if coding == _CODING:
        return 1
    tail = coding[len(_CODING) :] if coding.startswith(_CODING) else ""
    return int(tail) if tail in ("2", "4", "8") else 0


def _model(counts: np.ndarray) -> constriction.stream.model.Categorical:
    """The group's model: a pure function of its exact counts, so encoder and decoder agree."""
    freq = counts.astype(np.float64)
    return constriction.stream.model.Categorical(freq / freq.sum(), perfect=False)


def _cdfs(rows: np.ndarray, symbols: np.ndarray) -> np.ndarray:
    """The cumulative tables (``uint32``, ``K + 1`` entries from 0 to ``2**24`` each,
    concatenated) that :func:`_model` makes of each row's first ``K = symbols`` counts (the row
    zero past them), computed as constriction 0.5 does (``fast_quantized_cdf``): ``p = counts /
    sum``, the running sum of ``p`` added left to right in float64 (``np.cumsum`` is sequential
    along each row, unlike ``np.sum``), ``cdf[i] = floor(sum_{j<i} p_j * (2**24 - K) / sum_j p_j) +
    i``. Every symbol, even one of count 0, gets a frequency of at least 1. All the rows at once
    (a delta's groups are hundreds a checkpoint; the counts are integers, so their sums are exact
    in any order)."""
    p = rows.astype(np.float64)
    p /= p.sum(axis=1, keepdims=True)
    running = np.cumsum(p, axis=1)
    scale = ((1 << 24) - symbols).astype(np.float64) / running[np.arange(rows.shape[0]), symbols - 1]
    width = rows.shape[1] + 1
    cdf = np.zeros((rows.shape[0], width), dtype=np.uint32)
    cdf[:, 1:] = (running * scale[:, None]).astype(np.uint32) + np.arange(1, width, dtype=np.uint32)
    column = np.arange(width)
    cdf[column == symbols[:, None]] = 1 << 24
    return cdf[column <= symbols[:, None]]


def _tables(rows: np.ndarray, symbols: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, ...]:
    """The C kernels' arguments for the coded groups: their cumulative tables (of ``rows`` of
    counts, each row's first ``symbols``) concatenated, each one's offset and symbol count,
    the groups' starts and stops."""
    symbols, starts, stops = (np.ascontiguousarray(a, dtype=np.int64) for a in (symbols, starts, stops))
    offsets = np.cumsum(symbols + 1) - (symbols + 1)  # (each table has K + 1 entries)
    cdf = _cdfs(rows, symbols) if symbols.size else np.zeros(0, np.uint32)
    return cdf, offsets, symbols, starts, stops


def _rows(counts: list[np.ndarray]) -> np.ndarray:
    """Groups' counts (each of up to 256 symbols) as the rows of one int64 array, zero past each."""
    rows = np.zeros((len(counts), 256), dtype=np.int64)
    for row, c in zip(rows, counts):
        row[: c.size] = c
    return rows


def table_symbols(rows: np.ndarray) -> np.ndarray:
    """Each row's largest symbol with a count, plus one: ``K``, the symbols of its rANS table
    (every row holding a count)."""
    return rows.shape[1] - np.argmax(rows[:, ::-1] != 0, axis=1)


def _sizes(n: int, groups: np.ndarray | None) -> np.ndarray:
    sizes = np.array([n], dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
    if (sizes.size and int(sizes.min()) < 0) or int(sizes.sum()) != n:
        raise ValueError(f"group sizes sum to {int(sizes.sum())}, not to the {n} symbols")
    return sizes


def _lane(start: int, stop: int, j: int, lanes: int) -> slice:
    """The positions of lane ``j`` in ``[start, stop)``."""
    return slice(start + (j - start) % lanes, stop, lanes)


def ans_encode(
    symbols: np.ndarray, groups: np.ndarray | None = None, lanes: int = 1, *, histograms: np.ndarray | None = None
) -> bytes:
    """The rANS payload of uint8 ``symbols``; ``groups``: sizes of consecutive runs that get
    a model each (default: one group); ``lanes``: interleaved lanes (1, 2, 4 or 8).

    ``histograms``, in place of ``groups``: each group's symbol counts, a row per group (the
    sizes are the rows' sums), where the caller has them already (the delta encoder's pair
    counts), so the symbols are not counted again. They must be the symbols' own: the payload
    is coded with them (a symbol beyond a group's histogram, or another than a group of one
    symbol's, is refused here; other mismatches make a stream :func:`ans_decode` refuses)."""
    if lanes not in (1, 2, 4, 8):
        raise ValueError(f"rANS lanes must be 1, 2, 4 or 8, not {lanes}")
    if histograms is not None and groups is not None:
        raise ValueError("give the groups' sizes or their histograms, not both")
    sym = np.ascontiguousarray(symbols, dtype=np.uint8).ravel()
    if histograms is not None and (histograms.ndim != 2 or histograms.shape[1] > 256 or histograms.min() < 0):
        raise ValueError(f"histograms must be rows of at most 256 non-negative counts, not of shape {histograms.shape}")
    sizes = _sizes(sym.size, groups if histograms is None else histograms.sum(axis=1))
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    present = np.flatnonzero(sizes)
    starts, stops = bounds[present], bounds[present + 1]
    if histograms is None:
        rows = _rows([byte_counts(sym[start:stop]) for start, stop in zip(starts, stops)])
    else:
        rows = histograms[present].astype(np.int64)
    k = table_symbols(rows)  # byte_counts' length: the largest symbol present, plus one
    # the table: each group's K and its K counts
    table = [np.concatenate((k[:, None], rows), axis=1)[np.arange(rows.shape[1] + 1) <= k[:, None]]]
    coded = np.count_nonzero(rows, axis=1) > 1
    if histograms is not None:  # a group of one symbol writes no words: its symbols must all be it
        for start, stop, top in zip(starts[~coded], stops[~coded], k[~coded]):
            if np.any(sym[start:stop] != top - 1):
                raise ValueError(f"symbols {start}-{stop} hold a symbol their histogram does not count")
        if native is None:  # (the C coder checks a coded group's symbols as it codes them)
            for start, stop, top in zip(starts[coded], stops[coded], k[coded]):
                if int(sym[start:stop].max()) >= top:
                    raise ValueError(f"symbols {start}-{stop} hold a symbol their histogram does not count")
    if native is not None:
        encoded = native.ans_encode(sym, *_tables(rows[coded], k[coded], starts[coded], stops[coded]), lanes)
        if isinstance(encoded, int):  # (the coder's tables end there)
            start, stop = starts[coded][encoded], stops[coded][encoded]
            raise ValueError(f"symbols {start}-{stop} hold a symbol their histogram does not count")
        words, lane_words = encoded  # little-endian words
    else:
        streams = []
        for j in range(lanes):
            coder = constriction.stream.stack.AnsCoder()
            # a stack: encode backwards so the groups decode forwards
            for start, stop, counts, top in reversed(list(zip(starts[coded], stops[coded], rows[coded], k[coded]))):
                model, mine = _model(counts[:top]), sym[_lane(int(start), int(stop), j, lanes)]
                for at in reversed(range(0, mine.size, _SLICE)):
                    coder.encode_reverse(mine[at : at + _SLICE].astype(np.int32), model)
            streams.append(coder.get_compressed().astype("<u4").tobytes())
        words, lane_words = b"".join(streams), [len(w) // 4 for w in streams]
    table.append(np.asarray(lane_words[:-1], dtype=np.int64))
    header = length_prefixed(uleb128_encode(np.concatenate(table).astype(np.uint64)).tobytes())
    # (a join copies a long stream's words with the GIL released; ``+`` holds it)
    return b"".join((header, words))


def _bytes(payload: bytes | memoryview | np.ndarray) -> np.ndarray:
    """A payload's bytes as uint8, without a copy."""
    return np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload.view(np.uint8)


def _table(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A payload's table (its uleb128 numbers, int64) and the coder's words' bytes."""
    table, words = split_prefixed(data, "rANS stream's table")
    if words.size % 4:
        raise ValueError("rANS stream is truncated")
    return uleb128_decode(table).astype(np.int64), words


def ans_counts(payload: bytes | memoryview | np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The symbol counts the table of :func:`ans_encode`'s ``payload`` holds for its first
    groups, of ``groups`` sizes: a row of 256 for each (zero for an empty group), without
    decoding. Where the sizes of a stream's later groups follow from its earlier groups'
    symbols (a delta's changed values, one for each gap before one), the reader learns them here.
    ``ValueError`` for a table that does not match the sizes."""
    sizes = np.asarray(groups, dtype=np.int64)
    rows = np.zeros((sizes.size, 256), dtype=np.int64)
    for g, counts in _group_counts(_table(_bytes(payload))[0], sizes)[0]:
        rows[g, : counts.size] = counts
    return rows


def _group_counts(table: np.ndarray, sizes: np.ndarray) -> tuple[list[tuple[int, np.ndarray]], int]:
    """``([(group, its counts), ...] for the non-empty groups, where the table goes on)``,
    checked against the groups' sizes."""
    found, pos = [], 0
    for g in np.flatnonzero(sizes):
        k = int(table[pos]) if pos < table.size else 0
        counts = table[pos + 1 : pos + 1 + k]
        pos += 1 + k
        if k == 0 or k > 256 or counts.size != k or int(counts.sum()) != sizes[g]:
            raise ValueError(f"rANS table of group {g} does not match its {int(sizes[g])} symbols")
        found.append((int(g), counts))
    return found, pos


def ans_decode(
    payload: bytes | memoryview | np.ndarray, n: int, groups: np.ndarray | None = None, lanes: int = 1
) -> np.ndarray:
    """Inverse of :func:`ans_encode`: ``n`` uint8 symbols. ``ValueError`` names what is wrong
    with a damaged payload."""
    if lanes not in (1, 2, 4, 8):
        raise ValueError(f"rANS lanes must be 1, 2, 4 or 8, not {lanes}")
    data = _bytes(payload)
    sizes = _sizes(n, groups)
    table, word_bytes = _table(data)
    out = np.empty(n, dtype=np.uint8)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    coded = []
    found, pos = _group_counts(table, sizes)
    for g, counts in found:
        if np.count_nonzero(counts) == 1:
            out[bounds[g] : bounds[g + 1]] = int(np.flatnonzero(counts)[0])
        else:
            coded.append((int(bounds[g]), int(bounds[g + 1]), counts))
    words = np.frombuffer(word_bytes, dtype="<u4").astype(np.uint32)  # aligned, native order
    if table.size - pos != lanes - 1:
        raise ValueError(f"rANS table has {table.size - pos} entries after its groups, not the {lanes - 1} lane sizes")
    lane_words = [int(c) for c in table[pos:]]  # (a count of 2^63 or more reads as negative)
    ends = np.cumsum([0, *lane_words])
    if min(lane_words, default=0) < 0 or int(ends[-1]) > words.size:
        raise ValueError(f"rANS lane sizes {table[pos:].tolist()} do not fit the stream's {words.size} words")
    lane_bounds = np.array([*ends.tolist(), words.size], dtype=np.int64)
    if native is not None:  # the kernel counts the symbols as it decodes them
        symbols, starts, stops = ([c.size for _, _, c in coded], [a for a, _, _ in coded], [b for _, b, _ in coded])
        tables = _tables(_rows([c for _, _, c in coded]), symbols, starts, stops)
        hist = np.zeros(tables[0].size, dtype=np.int64)
        empty = native.ans_decode(words, lane_bounds, *tables, out, hist)
        decoded = np.split(hist, tables[1][1:])
    else:
        empty = True
        for j in range(lanes):
            decoder = constriction.stream.stack.AnsCoder(words[lane_bounds[j] : lane_bounds[j + 1]])
            for start, stop, counts in coded:
                model, mine = _model(counts), _lane(start, stop, j, lanes)
                size = len(range(mine.start, mine.stop, lanes))
                values = np.empty(size, dtype=np.uint8)
                for at in range(0, size, _SLICE):
                    values[at : at + _SLICE] = decoder.decode(model, min(_SLICE, size - at))
                out[mine] = values
            empty &= decoder.is_empty()
        decoded = [byte_counts(out[start:stop], counts.size) for start, stop, counts in coded]
    for (start, stop, counts), histogram in zip(coded, decoded):
        if not np.array_equal(histogram[: counts.size], counts):
            raise ValueError(f"rANS group of symbols {start}-{stop} decodes to a histogram other than its table's")
    if not empty:
        raise ValueError("rANS stream has words left over after its last symbol")
    return out
