"""The rANS coder of quantization codes (core/ans.py) and its use by the dynaquant codec."""

from __future__ import annotations

import constriction
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynaquant import CheckpointStore
from hf_dynaquant.codecs.dynaquant import DynaQuantCodec
from hf_dynaquant.core import varint
from hf_dynaquant.core.ans import LANES, ans_coding, ans_decode, ans_encode, ans_lanes, lanes_for
from hf_dynaquant.core.bitplanes import pack_bits
from hf_dynaquant.core.entropy import ANS, ZSTD, decode_stream, encode_codes, encode_codes_packed, encode_stream
from hf_dynaquant.core.histogram import byte_counts
from hf_dynaquant.core.kernels import native
from hf_dynaquant.core.quantizer import QuantConfig
from hf_dynaquant.core.varint import uleb128_decode, uleb128_encode
from hf_dynaquant.errors import CorruptCheckpointError
from hf_dynaquant.pipeline import compress_state_dict


def _entropy_bytes(symbols: np.ndarray) -> float:
    counts = np.bincount(symbols)
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / symbols.size)).sum() / 8)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 255), max_size=400),
    st.lists(st.integers(0, 60), max_size=8),
)
def test_round_trip_any_symbols_and_groups(values: list[int], cuts: list[int]) -> None:
    symbols = np.array(values, dtype=np.uint8)
    sizes = np.array(cuts + [0], dtype=np.int64)
    sizes[-1] = max(0, symbols.size - int(sizes[:-1].sum()))
    symbols = np.resize(symbols, int(sizes.sum())) if symbols.size else np.zeros(int(sizes.sum()), np.uint8)
    for lanes in (1, 2, 4, 8):
        payload = ans_encode(symbols, sizes, lanes)
        assert np.array_equal(ans_decode(payload, symbols.size, sizes, lanes), symbols)
        assert np.array_equal(ans_decode(ans_encode(symbols, lanes=lanes), symbols.size, lanes=lanes), symbols)


def test_reaches_the_order0_entropy() -> None:
    """Within a few bytes of the entropy, where zstd's Huffman stage spends a third more."""
    rng = np.random.default_rng(0)
    symbols = rng.choice(6, 200_000, p=[0.02, 0.002, 0.5, 0.4, 0.06, 0.018]).astype(np.uint8)
    payload = ans_encode(symbols)
    assert len(payload) <= _entropy_bytes(symbols) + 64
    in_lanes = ans_encode(symbols, lanes=LANES)
    assert len(in_lanes) <= len(payload) + 11 * (LANES - 1)  # the other lanes' states (8 bytes) and word counts
    import zstandard

    assert len(zstandard.ZstdCompressor(level=1).compress(symbols.tobytes())) > 1.3 * len(payload)
    skewed = rng.choice(3, 200_000, p=[0.9, 0.05, 0.05]).astype(np.uint8)  # where packing loses over 10%
    coding, coded = encode_codes(skewed)
    assert coding == ans_coding(LANES) == "ans8" and coded == ans_encode(skewed, lanes=LANES)
    assert len(coded) <= _entropy_bytes(skewed) + 64


def test_groups_get_their_own_models() -> None:
    """Two groups with opposite histograms: one model each costs a fraction of one shared model."""
    rng = np.random.default_rng(1)
    a = (rng.random(50_000) < 0.02).astype(np.uint8)
    b = (rng.random(50_000) > 0.02).astype(np.uint8)
    both = np.concatenate([a, b])
    grouped = ans_encode(both, np.array([a.size, b.size]))
    assert len(grouped) < 0.2 * len(ans_encode(both))
    assert len(grouped) <= _entropy_bytes(a) + _entropy_bytes(b) + 64


def test_constant_and_empty_groups_write_no_words() -> None:
    symbols = np.concatenate([np.full(1000, 3, np.uint8), np.full(500, 7, np.uint8)])
    payload = ans_encode(symbols, np.array([0, 1000, 0, 500, 0]))
    assert len(payload) == 1 + len(uleb128_encode(np.array([4, 0, 0, 0, 1000, 8, 0, 0, 0, 0, 0, 0, 0, 500])))
    assert np.array_equal(ans_decode(payload, 1500, np.array([0, 1000, 0, 500, 0])), symbols)
    assert ans_encode(np.zeros(0, np.uint8)) == b"\x00" and ans_decode(b"\x00", 0).size == 0


def test_stream_bytes_are_pinned() -> None:
    """The payload is part of the file format: a change in constriction's model quantization or
    word layout must fail here, not in a user's restore."""
    symbols = np.array([2, 3, 3, 2, 4, 2, 3, 3, 0, 3, 2, 3] * 3, dtype=np.uint8)
    payload = ans_encode(symbols, np.array([20, 16]))
    assert payload.hex() == PINNED
    assert np.array_equal(ans_decode(bytes.fromhex(PINNED), 36, np.array([20, 16])), symbols)


PINNED = "0c050100070a020502000508013faeb9a54fb3635656cf0000"


def test_lanes_are_streams_of_their_own_and_pinned() -> None:
    """Lane ``j`` holds the symbols at positions ``j mod L``, each a stream of one lane coded
    with the groups' models; the table ends with the first lanes' word counts. A long stream
    takes eight lanes, a short one keeps one (the extra states would cost more than they save)."""
    symbols = np.array([2, 3, 3, 2, 4, 2, 3, 3, 0, 3, 2, 3] * 3, dtype=np.uint8)
    groups = np.array([20, 16])
    payload = ans_encode(symbols, groups, lanes=4)
    assert payload.hex() == PINNED_LANES
    assert np.array_equal(ans_decode(bytes.fromhex(PINNED_LANES), 36, groups, 4), symbols)
    table = uleb128_decode(np.frombuffer(payload, np.uint8)[1 : 1 + payload[0]])
    counts = table[-3:].astype(np.int64)
    words = np.frombuffer(payload[1 + payload[0] :], "<u4")
    bounds = np.concatenate(([0], np.cumsum(counts), [words.size]))
    sizes = np.concatenate(([0], np.cumsum(groups)))
    for j in range(4):  # constriction decodes each lane alone: its positions, with the groups' models
        coder = constriction.stream.stack.AnsCoder(words[bounds[j] : bounds[j + 1]].astype(np.uint32))
        for start, stop in zip(sizes[:-1], sizes[1:]):
            group = symbols[start:stop]
            model = constriction.stream.model.Categorical(np.bincount(group) / group.size, perfect=False)
            mine = symbols[start + (j - start) % 4 : stop : 4]
            assert np.array_equal(coder.decode(model, mine.size), mine)
        assert coder.is_empty()
    assert lanes_for(1000) == 1 and lanes_for(1 << 20) == LANES
    assert [ans_lanes(c) for c in ("ans", "ans2", "ans4", "ans8", "ans3", "ans-rows", "zstd")] == [1, 2, 4, 8, 0, 0, 0]


PINNED_LANES = "0f050100070a020502000508010202011b3e5afb390600005d379372010000001b6986c9fcce1c3901000000"


def _with_table(payload: bytes, edit) -> bytes:
    """``payload`` with its table (the uleb128 numbers after the table length) passed through ``edit``."""
    data = np.frombuffer(payload, dtype=np.uint8)
    first = int(np.argmax(data < 0x80)) + 1
    end = first + int(uleb128_decode(data[:first])[0])
    table = edit(uleb128_decode(data[first:end]).astype(np.uint64))
    header = uleb128_encode(table).tobytes()
    return uleb128_encode(np.array([len(header)], dtype=np.uint64)).tobytes() + header + payload[end:]


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("kernel", ["compiled", "python"])
def test_a_stream_decoding_to_another_histogram_than_its_table_is_refused(monkeypatch, lanes, kernel) -> None:
    """The decoder counts what each group decodes to (the compiled kernel as it decodes, lane by
    lane); a table whose counts were swapped (same total) decodes to other symbols, refused by name."""
    from hf_dynaquant.core import ans as ans_mod

    if kernel == "python":
        monkeypatch.setattr(ans_mod, "native", None)
    rng = np.random.default_rng(4)
    sizes = np.array([3000, 5000])
    symbols = np.concatenate([rng.choice(3, 3000, p=[0.2, 0.3, 0.5]), rng.choice(4, 5000, p=[0.1, 0.2, 0.3, 0.4])])
    payload = ans_encode(symbols.astype(np.uint8), sizes, lanes)
    assert np.array_equal(ans_decode(payload, symbols.size, sizes, lanes), symbols)

    def swap_second_group(table: np.ndarray) -> np.ndarray:  # [3, c0, c1, c2, 4, c0, c1, c2, c3, lane sizes...]
        out = table.copy()
        out[[5, 8]] = table[[8, 5]]
        return out

    with pytest.raises(ValueError, match="group of symbols 3000-8000 decodes to a histogram other than its table's"):
        ans_decode(_with_table(payload, swap_second_group), symbols.size, sizes, lanes)


def test_the_compiled_decoder_refuses_tables_it_cannot_hold() -> None:
    """Called directly, the kernel checks what ``ans_decode`` checks before it: an alphabet of
    more than 256 symbols, or a histogram buffer shorter than the tables, is a ValueError, not
    a write past its buffers."""
    assert native is not None, "the compiled kernels were not built"
    words, bounds = np.zeros(2, np.uint32), np.array([0, 2], np.int64)
    cdf = np.arange(301, dtype=np.uint32)
    offsets = starts = np.zeros(1, np.int64)
    stops, out = np.array([4], np.int64), np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="alphabet"):
        sizes, hist = np.array([300], np.int64), np.zeros(301, np.int64)
        native.ans_decode(words, bounds, cdf, offsets, sizes, starts, stops, out, hist)
    with pytest.raises(ValueError, match="histogram"):
        sizes, hist = np.array([4], np.int64), np.zeros(2, np.int64)
        native.ans_decode(words, bounds, cdf[:5], offsets, sizes, starts, stops, out, hist)


def test_the_compiled_coders_refuse_tables_and_groups_that_do_not_fit() -> None:
    """Called directly, the encoder checks what ``ans_encode`` always passes: groups in order and
    apart inside the symbols (its lanes' buffers hold a word for each symbol, coded once), each
    table inside the tables' buffer (an offset near 2^63 too), from 0 to 2^24 with every
    frequency at least 1 (it divides by each), and two symbols at least; the decoder checks its
    groups against its output and its lanes against the words. A ValueError, never a write past a
    buffer or a division by zero."""
    assert native is not None, "the compiled kernels were not built"
    symbols = np.zeros(1000, np.uint8)
    cdf = np.array([0, 1, 1 << 24], np.uint32)  # two symbols, frequencies 1 and 2^24 - 1
    one, k, whole = np.zeros(1, np.int64), np.array([2], np.int64), np.array([1000], np.int64)

    def encode(cdf=cdf, offsets=one, k=k, starts=one, stops=whole):
        return native.ans_encode(symbols, cdf, offsets, k, starts, stops, 4)

    assert isinstance(encode(), tuple)  # (fits)
    overlapping = dict(offsets=np.zeros(8, np.int64), k=np.full(8, 2, np.int64), starts=np.zeros(8, np.int64),
                       stops=np.full(8, 1000, np.int64))  # fmt: skip
    for wrong in (
        overlapping,
        dict(stops=np.array([1001], np.int64)),  # past the symbols
        dict(offsets=np.array([(1 << 63) - 1], np.int64)),  # o + k + 1 overflows
        dict(cdf=np.array([0, 0, 1 << 24], np.uint32)),  # a frequency of 0
        dict(cdf=np.array([0, 1, 1 << 23], np.uint32)),  # not up to 2^24
        dict(cdf=np.array([0, 1 << 24], np.uint32), k=np.array([1], np.int64)),  # one symbol
    ):
        with pytest.raises(ValueError, match="do not fit"):
            encode(**wrong)
    words, bounds = np.zeros(2, np.uint32), np.array([0, 2], np.int64)
    out, hist = np.zeros(4, np.uint8), np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="do not fit"):  # a group past the output
        native.ans_decode(words, bounds, cdf, one, k, one, np.array([5], np.int64), out, hist)
    with pytest.raises(ValueError, match="do not fit"):  # a lane past the words
        native.ans_decode(words, np.array([0, 3], np.int64), cdf, one, k, one, np.array([4], np.int64), out, hist)


def test_histograms_that_are_not_the_symbols_own_are_refused_with_or_without_the_kernels(monkeypatch) -> None:
    """A group of one symbol writes no words, so each of its symbols must be that one (one below
    it decoded silently as it); without the kernels a coded group's symbols are checked before
    constriction codes them, with the same error; groups that leave symbols over are refused."""
    import hf_dynaquant.core.ans as ans

    symbols = np.array([0, 0, 0, 0, 0, 1, 1, 2], np.uint8)
    with pytest.raises(ValueError, match="symbols 0-4 hold"):  # zeros where the table says all are 1
        ans_encode(symbols[:4], histograms=np.array([[0, 4]]))
    with pytest.raises(ValueError, match="sum to 0"):
        ans_encode(symbols, groups=np.zeros(0, np.int64))
    for kernel in (ans.native, None):
        with monkeypatch.context() as patch:
            patch.setattr(ans, "native", kernel)
            with pytest.raises(ValueError, match="symbols 4-8 hold"):  # the symbol 2 in a coded group of two
                ans_encode(symbols, histograms=np.array([[4, 0], [1, 3]]))


def test_the_compiled_decoder_reads_a_lone_symbol_alphabet() -> None:
    """A group of one symbol (which ``ans_encode`` never codes, but the kernel accepts) has all
    2^24 of the frequency: it decodes to that symbol without a word, not through the slot table,
    whose packed frequency holds 24 bits."""
    assert native is not None, "the compiled kernels were not built"
    words, bounds = np.zeros(0, np.uint32), np.array([0, 0], np.int64)
    cdf = np.array([0, 1 << 24], np.uint32)
    offsets = starts = np.zeros(1, np.int64)
    sizes, stops = np.array([1], np.int64), np.array([5], np.int64)
    out, hist = np.full(5, 7, np.uint8), np.zeros(2, np.int64)
    assert native.ans_decode(words, bounds, cdf, offsets, sizes, starts, stops, out, hist)
    assert out.tolist() == [0] * 5 and hist.tolist() == [5, 0]


def test_damaged_streams_raise_value_errors() -> None:
    rng = np.random.default_rng(2)
    symbols = rng.choice(4, 5000, p=[0.1, 0.2, 0.3, 0.4]).astype(np.uint8)
    payload = ans_encode(symbols)
    with pytest.raises(ValueError, match="truncated"):
        ans_decode(payload[:-3], symbols.size)
    with pytest.raises(ValueError, match="histogram|left over"):
        ans_decode(payload + b"\x01\x00\x00\x00", symbols.size)
    with pytest.raises(ValueError, match="does not match"):
        ans_decode(payload, symbols.size - 1)
    with pytest.raises(ValueError, match="sum to"):
        ans_encode(symbols, np.array([10, 10]))
    with pytest.raises(ValueError, match="table length"):
        ans_decode(b"\x80", 1)
    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 0x55
    with pytest.raises(ValueError):
        ans_decode(bytes(flipped), symbols.size)
    with pytest.raises(CorruptCheckpointError, match="tensor w"):
        decode_stream(ANS, payload[:-3], symbols.size, "tensor w")
    with pytest.raises(CorruptCheckpointError, match="unknown stream coding 'ans3'"):
        decode_stream("ans3", payload, symbols.size, "tensor w")
    with pytest.raises(ValueError, match="lane sizes"):
        ans_decode(payload, symbols.size, lanes=2)  # no lane sizes in a one-lane table
    lanes = ans_encode(symbols, lanes=4)
    with pytest.raises(ValueError, match="lane sizes"):
        ans_decode(lanes, symbols.size)  # a four-lane table read as one lane
    damaged = bytearray(lanes)
    damaged[damaged[0]] = 0x7F  # the last lane size byte: more words than the stream has
    with pytest.raises(ValueError):
        ans_decode(bytes(damaged), symbols.size, lanes=4)
    header = uleb128_decode(np.frombuffer(lanes, np.uint8)[1 : 1 + lanes[0]])
    header[-3:] = [3, 2**64 - 2, 1]  # a lane of "-2" words: the lanes would overlap
    table = uleb128_encode(header).tobytes()
    with pytest.raises(ValueError, match="lane sizes"):
        ans_decode(bytes([len(table)]) + table + lanes[1 + lanes[0] :], symbols.size, lanes=4)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        ans_encode(symbols, lanes=3)


@pytest.mark.parametrize("kernels", [True, False], ids=["compiled", "numpy"])
def test_uleb128_round_trip_and_limits(kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels:
        monkeypatch.setattr(varint, "native", None)
    elif native is None:
        pytest.skip("the compiled kernels are not built")
    values = np.array([0, 1, 127, 128, 300, 2**32, 2**63 + 5, 2**64 - 1], dtype=np.uint64)
    assert np.array_equal(uleb128_decode(uleb128_encode(values)), values)
    assert uleb128_encode(np.array([127, 128])).tolist() == [0x7F, 0x80, 0x01]
    assert uleb128_encode(np.array([], dtype=np.uint64)).size == 0 and uleb128_decode(np.zeros(0, np.uint8)).size == 0
    with pytest.raises(ValueError, match="truncated"):
        uleb128_decode(np.array([0x80], dtype=np.uint8))
    with pytest.raises(ValueError, match="truncated"):
        uleb128_decode(np.array([5, 0x81, 0x80], dtype=np.uint8))
    with pytest.raises(ValueError, match="64 bits"):
        uleb128_decode(np.array([0x80] * 10 + [1], dtype=np.uint8))
    # a tenth byte's bits past the 64th are dropped, as both paths drop them
    assert uleb128_decode(np.array([0xFF] * 9 + [0x7F], dtype=np.uint8)).tolist() == [2**64 - 1]


def test_uleb128_kernels_match_the_numpy_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled varints are the numpy reference's bytes and values, over values of every
    width and the array sizes a table or a token stream has."""
    if native is None:
        pytest.skip("the compiled kernels are not built")
    rng = np.random.default_rng(7)
    cases = [rng.integers(0, 1 << int(bits), int(size), dtype=np.uint64) for bits, size in
             zip(rng.integers(1, 64, 60), rng.integers(0, 400, 60))]  # fmt: skip
    compiled = [uleb128_encode(c) for c in cases]
    monkeypatch.setattr(varint, "native", None)
    for case, data in zip(cases, compiled):
        assert data.tobytes() == uleb128_encode(case).tobytes()
        assert np.array_equal(uleb128_decode(data), case)


def test_codes_are_packed_for_zstd_which_then_codes_them_within_2_percent_of_their_entropy() -> None:
    """Codes spanning at most 16 values are packed 2 (or 4, or 8) to a byte before zstd, whose
    Huffman stage then codes them jointly: within 2% of the entropy at 16 and at 3 levels, where
    on the codes one a byte it spends 9% and 45% more. rANS would save too little for its
    slower decode; the stream reads back, and wider codes keep zstd on the codes themselves."""
    rng = np.random.default_rng(4)
    many = (2 + rng.binomial(15, 0.5, 200_000)).astype(np.uint8)
    coarse = (2 + rng.binomial(2, 0.3, 200_000)).astype(np.uint8)
    for codes, coding in ((many, "zstd:pack4+2"), (coarse, "zstd:pack2+2")):
        assert encode_codes(codes)[0] == coding
        payload = encode_codes(codes)[1]
        assert len(payload) < 1.02 * _entropy_bytes(codes) < 0.95 * len(encode_stream(codes)[1])
        assert np.array_equal(decode_stream(coding, payload, codes.size, "t"), codes)
    wide = (2 + rng.binomial(40, 0.5, 200_000)).astype(np.uint8)  # 20-odd values in use: a byte each
    assert encode_codes(wide) == encode_stream(wide) and encode_stream(wide)[0] == ZSTD


def test_keyframes_take_zstd_when_repeats_make_it_smaller() -> None:
    periodic = np.tile(np.arange(2, 6, dtype=np.uint8), 50_000)  # order-0: 2 bits each; zstd: almost free
    coding, payload = encode_codes(periodic)
    assert coding == "zstd:pack2+2" and len(payload) < 0.01 * len(ans_encode(periodic))
    assert np.array_equal(decode_stream(coding, payload, periodic.size, "t"), periodic)


def test_codes_filling_a_range_evenly_are_packed_from_their_smallest() -> None:
    """Codes spread evenly over ``2^N`` neighbours (Adam's update at two bins) are stored
    packed, ``N`` bits a code less the smallest: no larger than rANS, and faster to code both
    ways. Skewed codes, runs and codes that leave half the range unused are packed too, and then
    zstd-compressed (within 2% of the entropy; runs far under it)."""
    rng = np.random.default_rng(12)
    n = 400_003
    even = (2 + rng.integers(0, 2, n)).astype(np.uint8)
    coding, payload = encode_codes(even)
    assert coding == "pack1+2" and len(payload) == (n + 7) // 8
    assert len(payload) <= 1.005 * len(ans_encode(even, lanes=LANES))
    assert np.array_equal(decode_stream(coding, payload, n, "t"), even)
    four = (5 + rng.integers(0, 4, n)).astype(np.uint8)
    coding, payload = encode_codes(four)
    assert coding == "pack2+5" and np.array_equal(decode_stream(coding, payload, n, "t"), four)
    skewed = (2 + (rng.random(n) < 0.2)).astype(np.uint8)  # 0.72 bits a code
    runs = np.repeat(even[: n // 500 + 1], 500)[:n]  # the same two codes, in runs
    gap = np.where(even == 2, 2, 4).astype(np.uint8)  # two codes, not neighbours: half of 2 bits unused
    cases = ((skewed, "zstd:pack1+2", 1.02), (runs, "zstd:pack1+2", 0.02), (gap, "zstd:pack2+2", 1.02))
    for codes, coding, most in cases:
        stored, payload = encode_codes(codes)
        assert stored == coding and len(payload) < most * _entropy_bytes(codes)
        assert np.array_equal(decode_stream(coding, payload, n, "t"), codes)
    assert encode_codes(even[:50_000])[0] == "pack1+2"  # short streams too
    # the codes as packed are handed back (a keyframe keeps them for the next delta), whichever
    # stream was kept; none where the codes were not packed
    for codes in (even, four, skewed, runs, gap, np.tile(np.arange(2, 6, dtype=np.uint8), 50_000)):
        coding, payload, packed = encode_codes_packed(codes)
        assert (coding, payload) == encode_codes(codes) and packed.size == codes.size
        assert np.array_equal(packed.unpacked(), codes)
        assert np.array_equal(packed.data, pack_bits(codes, packed.width, packed.base))
    wide = (2 + rng.binomial(40, 0.5, n)).astype(np.uint8)
    assert encode_codes_packed(wide)[2] is None


def test_packed_codes_that_leave_a_byte_are_refused() -> None:
    for coding in ("pack1+255", "pack8+1", "pack2+253"):
        with pytest.raises(CorruptCheckpointError, match="past 255"):
            decode_stream(coding, np.zeros(8, np.uint8), 16, "t")
    with pytest.raises(CorruptCheckpointError, match="cannot hold exactly"):
        decode_stream("pack1+2", np.zeros(3, np.uint8), 16, "t")
    for coding in ("pack9+0", "pack\u00b2", "pack08", "pack1+007", "pack1+"):  # (ASCII digits, no leading zeros)
        with pytest.raises(CorruptCheckpointError, match="unknown stream coding"):
            decode_stream(coding, np.zeros(8, np.uint8), 8, "t")
    assert decode_stream("pack2+252", np.full(1, 0xFF, np.uint8), 4, "t").tolist() == [255] * 4
    assert decode_stream("pack1+0", np.full(1, 0x0F, np.uint8), 8, "t").tolist() == [1] * 4 + [0] * 4


def test_damaged_zstd_packed_streams_are_refused_by_name() -> None:
    """A ``"zstd:pack<N>+<B>"`` stream reads back; a damaged frame, a frame whose header claims
    more bytes than the packing takes (refused before zstd allocates them), a frame one byte
    short, and codings this version does not write are each refused, naming the stream."""
    import zstandard

    codes = (2 + np.random.default_rng(5).binomial(7, 0.5, 10_000)).astype(np.uint8)
    coding, payload = encode_codes(codes)
    assert coding == "zstd:pack4+2" and np.array_equal(decode_stream(coding, payload, codes.size, "t"), codes)
    with pytest.raises(CorruptCheckpointError, match="t: zstd stream cannot be decoded"):
        decode_stream(coding, b"\x28\xb5\x2f\xfd" + bytes(12), codes.size, "t")
    with pytest.raises(CorruptCheckpointError, match="more than the 2500 bytes expected"):
        decode_stream(coding, payload, codes.size // 2, "t")
    short = zstandard.ZstdCompressor().compress(bytes(4999))
    with pytest.raises(CorruptCheckpointError, match="t: 4999 packed bytes cannot hold exactly 10000"):
        decode_stream(coding, short, codes.size, "t")
    for unknown in ("zstd:pack9+0", "zstd:zstd", "zstd:", "zstd:ans4", "zstd:pack4+02", "pack4+2:zstd"):
        with pytest.raises(CorruptCheckpointError, match="unknown stream coding"):
            decode_stream(unknown, payload, codes.size, "t")
    with pytest.raises(CorruptCheckpointError, match="past 255"):
        decode_stream("zstd:pack1+255", payload, codes.size, "t")
    with pytest.raises(CorruptCheckpointError, match="more than the 0 bytes expected"):  # an empty tensor's
        decode_stream(ZSTD, payload, 0, "t")


def test_codes_at_the_top_of_a_byte_are_packed_from_a_base_that_keeps_their_range_in_it() -> None:
    """Codes among the highest values a byte holds are packed from ``256 - 2^N`` (their smallest
    would put the range past 255, which no reader accepts) and read back, through the codec too."""
    rng = np.random.default_rng(17)
    for values, coding in (([253, 254, 255], "zstd:pack2+252"), ([245, 250, 255], "zstd:pack4+240"),
                           ([249, 252, 255], "zstd:pack4+240"), ([254, 255], "pack1+254")):  # fmt: skip
        codes = rng.choice(np.array(values, dtype=np.uint8), 100_000)
        stored, payload = encode_codes(codes)
        assert stored == coding and np.array_equal(decode_stream(stored, payload, codes.size, "t"), codes), values
    from hf_dynaquant.codecs.base import MemoryBlobs
    from hf_dynaquant.codecs.dynaquant import QuantState

    codes = rng.choice(np.array([253, 254, 255], dtype=np.uint8), 70_000)
    centres = np.linspace(-1, 1, 254).astype(np.float32)
    state = QuantState(codes, 256, centres, np.zeros(0, np.uint16), "F32", (codes.size,))
    encoded = DynaQuantCodec().keyframe(state)
    assert encoded.params["codes_stream"] == "zstd:pack2+252"
    decoded = DynaQuantCodec().decode("F32", (codes.size,), encoded.params, MemoryBlobs(encoded.blobs))
    assert np.array_equal(decoded.codes, codes)


def test_packing_refuses_codes_that_their_histogram_does_not_count() -> None:
    """A histogram given by the caller decides the packing's range: codes past it are refused
    (as rANS refuses them), never packed into other codes."""
    rng = np.random.default_rng(13)
    codes = (2 + rng.integers(0, 2, 400_000)).astype(np.uint8)
    counts = np.bincount(codes, minlength=256)
    codes[:400] = 9
    with pytest.raises(ValueError, match="histogram does not count"):
        encode_codes(codes, counts)


def test_codec_packs_two_level_keyframes_and_reads_them_back(tmp_path, monkeypatch) -> None:
    """Weights at two bins keep two neighbouring codes about equally often: the keyframe is stored
    packed (codec version 4 on), its delta is coded against it as before, and both read back to
    what the same chain with rANS keyframes reads to."""
    import hf_dynaquant.core.entropy as entropy

    torch.manual_seed(0)
    w = {"layer.weight": torch.randn(1024, 512) * 0.05}
    moved = {"layer.weight": w["layer.weight"] + 0.002 * torch.randn(1024, 512)}
    config = QuantConfig(bins=2, prune=0.0, protect=0.0, min_numel=1000)
    decoded, streams = {}, {}
    for packs in (True, False):
        with monkeypatch.context() as patch:
            if not packs:
                patch.setattr(entropy, "_packing", lambda counts: None)
            store = CheckpointStore(tmp_path / str(packs))
            base = compress_state_dict(store, w, config, ref="k")
            compress_state_dict(store, moved, config, base=base, ref="d")
        key, delta = store.open("k").record("model", "layer.weight"), store.open("d").record("model", "layer.weight")
        streams[packs] = (key["params"]["codes_stream"], delta["params"]["mode"], key["codec_version"])
        decoded[packs] = [store.open(ref).load_section("model")["layer.weight"] for ref in ("k", "d")]
        assert store.verify(deep=True) == []
    version = DynaQuantCodec.version  # (packed keyframes from version 4 on)
    assert streams == {True: ("pack1+2", "delta", version), False: (ans_coding(LANES), "delta", version)}
    assert all(torch.equal(a, b) for a, b in zip(decoded[True], decoded[False]))


def test_long_streams_skip_zstds_trial_only_where_a_sample_shows_rans_clearly_smaller(monkeypatch) -> None:
    """A stream of codes too wide to pack (spanning more than 16 values) and long enough to
    sample (16 blocks of 16 Ki codes) codes as the whole trial would: rANS for coarse
    near-independent codes without coding them with zstd first, zstd where the sample shows
    repeats (periodic codes, or long runs), and zstd for many near-uniform levels."""
    import hf_dynaquant.core.entropy as entropy

    rng = np.random.default_rng(11)
    n = 16 * (1 << 16) + 12_345
    coarse = (2 + rng.binomial(2, 0.3, n)).astype(np.uint8)
    coarse[:: 1 << 14] = 40  # a rare far code: too wide to pack
    streams = {
        "coarse": coarse,
        "periodic": np.resize(np.arange(2, 40, dtype=np.uint8), n),
        "runs": np.repeat(coarse[: n // 500 + 1], 500)[:n],
        "many levels": (2 + rng.binomial(60, 0.5, n)).astype(np.uint8),
    }
    sampled = {name: encode_codes(codes) for name, codes in streams.items()}
    zstd_calls = []
    compress = entropy.encode_stream
    monkeypatch.setattr(entropy, "encode_stream", lambda data, level=1: zstd_calls.append(1) or compress(data, level))
    assert encode_codes(streams["coarse"]) == sampled["coarse"] and not zstd_calls  # no whole trial
    monkeypatch.setattr(entropy, "_SAMPLE_BLOCKS", 10**9)  # the whole trial, always
    for name, codes in streams.items():
        assert encode_codes(codes) == sampled[name], name
        coding, payload = sampled[name]
        assert np.array_equal(decode_stream(coding, payload, n, name), codes)
    assert [sampled[k][0] for k in streams] == [ans_coding(LANES), ZSTD, ZSTD, ZSTD]


def test_long_streams_choose_from_a_sampled_histogram_as_from_the_whole(monkeypatch) -> None:
    """Without a histogram, a long stream's is sampled for the choices: the stream is coded as
    with its whole histogram, rANS included (which is given the whole one); a code the sample
    missed, outside the packing's range, is found by the packing and the stream coded whole."""
    import hf_dynaquant.core.entropy as entropy

    rng = np.random.default_rng(21)
    n = 4_000_000
    streams = {
        "weights": (2 + rng.binomial(7, 0.5, n)).astype(np.uint8),
        "skewed": rng.choice(3, n, p=[0.9, 0.05, 0.05]).astype(np.uint8),
        "two codes": (2 + rng.integers(0, 2, n)).astype(np.uint8),
    }
    gap = int(np.linspace(0, n - entropy._ESTIMATE_BLOCK, entropy._SAMPLE_BLOCKS)[1]) - 100  # between two blocks
    stray_low, stray_far = streams["weights"].copy(), streams["weights"].copy()
    stray_low[gap], stray_far[gap] = 0, 40
    streams.update({"stray low code": stray_low, "stray far code": stray_far})
    counted = []
    monkeypatch.setattr(entropy, "byte_counts", lambda codes, *a: counted.append(codes.size) or byte_counts(codes, *a))
    expected = ["zstd:pack4+2", "ans8", "pack1+2", "zstd:pack4+0", "ans8"]  # (the far code: too wide to pack)
    for (name, codes), stored in zip(streams.items(), expected):
        counted.clear()
        coding, payload = encode_codes(codes)
        whole = n in counted  # the whole stream counted: for rANS, or after the sample missed a code
        assert whole == (name in ("skewed", "stray low code", "stray far code")), name
        assert coding == stored and (coding, payload) == encode_codes(codes, byte_counts(codes)), name
        assert np.array_equal(decode_stream(coding, payload, n, name), codes), name


def test_codec_stores_deltas_as_rans_and_keyframes_packed(tmp_path) -> None:
    """Default codings end to end (the keyframe's 8 codes packed two a byte, then zstd; the
    delta rANS), and the size gain over the paper's RLE + zstd on a realistic delta (a weight
    moves one bin with small probability)."""
    torch.manual_seed(0)
    w = {"layer.weight": torch.randn(256, 256) * 0.05}
    config = QuantConfig(bins=6, prune=0.0, protect=0.001, min_numel=1000)
    sizes = {}
    for coding in ("ans", "regroup"):
        store = CheckpointStore(tmp_path / coding)
        base = compress_state_dict(store, w, config, ref="k", delta_coding=coding)
        moved = {"layer.weight": w["layer.weight"] + 0.004 * torch.randn(256, 256)}
        compress_state_dict(store, moved, config, base=base, ref="d", delta_coding=coding)
        key, delta = store.open("k").record("model", "layer.weight"), store.open("d").record("model", "layer.weight")
        assert delta["params"]["mode"] == "delta" and delta["params"]["delta_coding"] == coding
        sizes[coding] = delta["blobs"]["delta"]["nbytes"]
        if coding == "ans":
            assert key["params"]["codes_stream"] == "zstd:pack4+1"
            assert delta["params"]["delta_stream"] == ["ans8", 256 * 256]
        else:  # the paper's coding keeps zstd keyframes (faster to decode)
            assert key["params"]["codes_stream"] == ZSTD
        assert store.verify(deep=True) == []
    assert sizes["ans"] < 0.85 * sizes["regroup"]


def test_one_lane_streams_of_earlier_writers_still_read(tmp_path, monkeypatch) -> None:
    """Writers before lanes (codec version 1) coded long keyframes and deltas in one lane
    (``"ans"``), and packed no codes (version 4 on), and later ones in four lanes (``"ans4"``):
    such chains read back to exactly what the same chain in today's lanes reads to."""
    import hf_dynaquant.codecs.dynaquant as dynaquant_codec
    import hf_dynaquant.core.entropy as entropy

    torch.manual_seed(0)
    w = {"layer.weight": torch.randn(256, 256) * 0.05}
    moved = {"layer.weight": w["layer.weight"] + 0.004 * torch.randn(256, 256)}
    config = QuantConfig(bins=6, prune=0.0, protect=0.001, min_numel=1000)
    decoded, streams = {}, {}
    for lanes in (1, 4, LANES):
        with monkeypatch.context() as patch:
            for module in (entropy, dynaquant_codec):
                patch.setattr(module, "lanes_for", lambda n, lanes=lanes: lanes)
            patch.setattr(entropy, "_packing", lambda counts: None)
            store = CheckpointStore(tmp_path / str(lanes))
            base = compress_state_dict(store, w, config, ref="k")
            compress_state_dict(store, moved, config, base=base, ref="d")
        key, delta = store.open("k").record("model", "layer.weight"), store.open("d").record("model", "layer.weight")
        streams[lanes] = (key["params"]["codes_stream"], delta["params"]["delta_stream"][0])
        decoded[lanes] = [store.open(ref).load_section("model")["layer.weight"] for ref in ("k", "d")]
    assert streams == {1: ("ans", "ans"), 4: ("ans4", "ans4"), LANES: ("ans8", "ans8")}
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(decoded[1], decoded[4], decoded[LANES]))


def test_long_groups_are_coded_in_slices_without_changing_the_bytes(monkeypatch) -> None:
    """constriction sees at most ``_SLICE`` symbols at once (bounded memory); the stream is the same."""
    import hf_dynaquant.core.ans as ans

    monkeypatch.setattr(ans, "native", None)  # constriction's path (the C kernels take whole groups)
    rng = np.random.default_rng(3)
    symbols = rng.choice(5, 12_345, p=[0.1, 0.2, 0.3, 0.3, 0.1]).astype(np.uint8)
    groups = np.array([5000, 0, 7345])
    whole = ans_encode(symbols, groups)
    monkeypatch.setattr(ans, "_SLICE", 1000)
    assert ans_encode(symbols, groups) == whole
    monkeypatch.setattr(ans, "_SLICE", 777)
    assert np.array_equal(ans_decode(whole, symbols.size, groups), symbols)


@pytest.mark.skipif(native is None, reason="the C kernels are not built")
def test_the_vector_encoder_writes_the_plain_loops_words() -> None:
    """Eight lanes are coded a row at a time in one AVX-512 vector where the CPU has it (the
    quotient in double precision, corrected where it is one off): the words are the plain
    loops', byte for byte, for alphabets looked up from registers (up to 16 and 32 symbols) and
    gathered (up to 256), frequencies of 1 beside ones near 2^24, groups of every alignment to
    the rows (empty and shorter than a row included), some 3 million steps; a symbol past its
    group's table names the same group both ways. (On a CPU without AVX-512 both runs take the
    plain loops.)"""
    assert native is not None, "the compiled kernels were not built"
    import hf_dynaquant.core.ans as ans

    rng = np.random.default_rng(38)
    cases = []
    for k in (2, 3, 9, 16, 17, 30, 32, 33, 100, 256):
        for _ in range(3):
            p = rng.pareto(0.7, k) + 1e-9
            p[rng.integers(k)] += 50.0 * p.sum()  # one symbol of nearly all the mass: others near frequency 1
            sizes = rng.integers(0, 40, 6).tolist() + rng.integers(1000, 120_000, 3).tolist()
            rng.shuffle(sizes)
            symbols = np.concatenate([rng.choice(k, int(n), p=p / p.sum()) for n in sizes]).astype(np.uint8)
            cases.append((symbols, np.array(sizes)))
    steps = 0
    for symbols, sizes in cases:
        bounds = np.concatenate(([0], np.cumsum(sizes)))
        present = np.flatnonzero(sizes)
        rows = ans._rows([byte_counts(symbols[a:b]) for a, b in zip(bounds[present], bounds[present + 1])])
        coded = np.count_nonzero(rows, axis=1) > 1
        tables = ans._tables(rows[coded], ans.table_symbols(rows)[coded], bounds[present][coded],
                             bounds[present + 1][coded])  # fmt: skip
        last = np.flatnonzero(coded)[-1]  # the last coded group, coded first
        past = symbols.copy()
        past[bounds[present][last]] = min(int(ans.table_symbols(rows)[last]), 255)  # past its table, if it can be
        words = {}
        for vector in (True, False):
            before = native.allow_simd(vector)
            try:
                words[vector] = native.ans_encode(symbols, *tables, 8)
                words[vector, "past"] = native.ans_encode(past, *tables, 8)
            finally:
                native.allow_simd(before)
        assert words[True] == words[False] and isinstance(words[True], tuple)
        assert words[True, "past"] == words[False, "past"]
        assert words[True, "past"] == int(np.count_nonzero(coded)) - 1 or ans.table_symbols(rows)[last] == 256
        steps += symbols.size
    assert steps > 3_000_000
    flags = _cpu_flags()
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:  # (else both runs took the plain loops)
        assert native.simd_paths() & 4, "the CPU has AVX-512 DQ/BW/VL, but the vector encoder is not taken"


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (none elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_c_kernels_code_constrictions_streams_bit_for_bit(monkeypatch) -> None:
    """The C coder writes the words constriction writes and reads them back to the same symbols,
    on skewed alphabets of 2-256 symbols with gaps (counts of 0 inside the alphabet), symbols
    seen once among hundreds of thousands, and several groups in one stream; its cumulative
    tables are constriction's quantization (which sums the probabilities left to right: a
    pairwise sum would give other tables for some of these)."""
    import hf_dynaquant.core.ans as ans

    rng = np.random.default_rng(7)
    cases = []
    for _ in range(120):
        k = int(rng.integers(2, 257))
        p = rng.pareto(1.0, k) * (rng.random(k) < 0.7)  # skewed, with gaps
        p[rng.integers(k)] += 1.0
        sizes = rng.integers(0, 3000, int(rng.integers(1, 5)))
        symbols = np.concatenate([rng.choice(k, int(n), p=p / p.sum()) for n in sizes]).astype(np.uint8)
        cases.append((symbols, sizes))
    rare = np.zeros(400_000, np.uint8)
    rare[[5, 200_000]] = [1, 37]  # two symbols seen once, a gap between them
    cases.append((rare, np.array([rare.size])))
    for case, (symbols, sizes) in enumerate(cases):
        lanes = (1, 2, 4, 8)[case % 4]
        ours = ans_encode(symbols, sizes, lanes)
        assert np.array_equal(ans_decode(ours, symbols.size, sizes, lanes), symbols)
        with monkeypatch.context() as patch:
            patch.setattr(ans, "native", None)
            assert ans_encode(symbols, sizes, lanes) == ours
            assert np.array_equal(ans_decode(ours, symbols.size, sizes, lanes), symbols)
