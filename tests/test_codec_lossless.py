"""The lossless codec is bit-exact for every dtype, shape and special value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynaquant.codecs import MemoryBlobs, get_codec
from hf_dynaquant.codecs.lossless import CHUNK
from hf_dynaquant.core.bitplanes import join_float, split_float
from hf_dynaquant.core.dtypes import FLOAT_LAYOUTS, RawTensor, from_raw, to_raw
from hf_dynaquant.errors import CorruptCheckpointError


def roundtrip(t: torch.Tensor, base: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    codec = get_codec("lossless")
    raw = to_raw(t)
    base_raw = to_raw(base) if base is not None else None
    enc = codec.encode(raw, base_raw)
    dec = codec.decode(raw.dtype, raw.shape, enc.params, MemoryBlobs(enc.blobs, "test"), base_raw if enc.uses_base else None)
    out = from_raw(dec)
    return out, sum(len(b) for b in enc.blobs.values())


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(to_raw(a).bits, to_raw(b).bits)


FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (7,), (33, 65), (2, 3, 4, 5)])
def test_float_roundtrip_shapes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    t = (torch.randn(shape) * 0.05).to(dtype)
    out, _ = roundtrip(t)
    assert_bits_equal(out, t)


@pytest.mark.parametrize("dtype", INTS + [torch.bool])
def test_int_and_bool_roundtrip(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    if dtype == torch.bool:
        t = torch.rand(1000) > 0.3
    elif dtype in (torch.uint16, torch.uint32, torch.uint64):
        t = torch.randint(0, 2**15, (1000,), dtype=torch.int64).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), (1000,), dtype=torch.int64).to(dtype)
    out, _ = roundtrip(t)
    assert_bits_equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_special_values(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    specials = [
        float("nan"),
        float("inf"),
        float("-inf"),
        -0.0,
        0.0,
        info.tiny,
        info.tiny / 4,
        -info.tiny / 8,
        info.max,
        -info.max,
        info.eps,
        1.0,
        -1.0,
    ]
    t = torch.tensor(specials * 50, dtype=dtype)
    out, _ = roundtrip(t)
    assert_bits_equal(out, t)  # NaN payloads and the sign of zero survive


def test_all_16bit_patterns() -> None:
    """Every bf16 and fp16 bit pattern (all NaNs, subnormals, infinities) comes back."""
    pats = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        t = pats.view(dtype)
        out, _ = roundtrip(t)
        assert_bits_equal(out, t)


def test_many_exponents_force_escapes() -> None:
    """Values spanning every binade exceed the rank table and go through the escape stream."""
    torch.manual_seed(3)
    exps = torch.randint(-140, 120, (20000,)).float()
    t = torch.sign(torch.randn(20000)) * torch.exp2(exps) * (1 + torch.rand(20000))
    out, _ = roundtrip(t)
    assert_bits_equal(out, t)
    planes = split_float(to_raw(t).bits, FLOAT_LAYOUTS["F32"])
    assert planes.escapes.size > 0
    assert np.array_equal(join_float(planes, FLOAT_LAYOUTS["F32"]), to_raw(t).bits)


def test_non_contiguous_and_large() -> None:
    torch.manual_seed(4)
    big = torch.randn(CHUNK * 2 + 12345) * 0.02  # three chunks
    out, size = roundtrip(big)
    assert_bits_equal(out, big)
    assert size < big.numel() * 4 / 1.1  # gaussian weights compress
    nc = torch.randn(64, 48).t()[::2]
    assert not nc.is_contiguous()
    out, _ = roundtrip(nc)
    assert_bits_equal(out, nc.contiguous())


def test_xor_delta_used_when_it_pays_and_exact() -> None:
    torch.manual_seed(5)
    base = torch.randn(100_000) * 0.02
    cur = base + torch.randn(100_000) * 1e-6  # a small training step
    alone, size_alone = roundtrip(cur)
    delta, size_delta = roundtrip(cur, base)
    assert_bits_equal(delta, cur)
    assert size_delta < 0.8 * size_alone
    unrelated, _ = roundtrip(torch.randn(100_000), base)  # no gain: stored self-contained
    codec = get_codec("lossless")
    assert not codec.encode(to_raw(torch.randn(100_000)), to_raw(base)).uses_base
    assert unrelated.shape == base.shape


@pytest.mark.parametrize("n", [1, 768, 65536])
def test_a_small_tensor_takes_the_smaller_of_its_two_codings_coded_once(n: int) -> None:
    """A tensor no longer than the sample (a bias, a norm, their moments) is coded with its base
    and without, once each, and keeps the delta where it is under 95% of the plain coding: the
    same bytes as coding the one chosen again."""
    from hf_dynaquant.codecs.lossless import LosslessCodec

    torch.manual_seed(n)
    base = torch.randn(n) * 0.02
    for cur, expect in ((base + torch.randn(n) * 1e-6, n > 1), (torch.randn(n), False)):
        raw, base_raw = to_raw(cur), to_raw(base)
        plain = LosslessCodec(delta=False).encode(raw)
        xor = LosslessCodec(delta=False).encode(RawTensor(raw.dtype, raw.shape, raw.bits ^ base_raw.bits))
        enc = get_codec("lossless").encode(raw, base_raw)
        pays = sum(map(len, xor.blobs.values())) < 0.95 * sum(map(len, plain.blobs.values()))
        assert enc.uses_base is pays and (pays is expect or n == 1)  # (one value's two codings: either)
        assert enc.blobs == (xor if pays else plain).blobs
        assert enc.params == {**(xor if pays else plain).params, "xor": pays}
        dec = get_codec("lossless").decode(raw.dtype, raw.shape, enc.params, MemoryBlobs(enc.blobs, "t"), base_raw)
        assert_bits_equal(from_raw(dec), cur)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), dtype=st.sampled_from(["F32", "BF16", "F16", "F64", "I32", "U8"]))
def test_arbitrary_bit_patterns(data: bytes, dtype: str) -> None:
    size = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I32": 4, "U8": 1}[dtype]
    data = data[: len(data) // size * size]
    bits = np.frombuffer(data, dtype=np.dtype(f"<u{size}") if size > 1 else np.uint8).copy()
    raw = RawTensor(dtype, (bits.size,), bits)
    codec = get_codec("lossless")
    enc = codec.encode(raw)
    dec = codec.decode(dtype, raw.shape, enc.params, MemoryBlobs(enc.blobs, "test"))
    assert np.array_equal(dec.bits, bits)


def test_inconsistent_params_raise_clear_error() -> None:
    codec = get_codec("lossless")
    raw = to_raw(torch.randn(1000))
    enc = codec.encode(raw)
    enc.params["chunks"][0]["streams"][0][2] += 1  # lengths no longer match the blob
    with pytest.raises(CorruptCheckpointError, match="test chunk 0"):
        codec.decode(raw.dtype, raw.shape, enc.params, MemoryBlobs(enc.blobs, "test"))
    with pytest.raises(CorruptCheckpointError, match="element count"):
        codec.decode(raw.dtype, (999,), codec.encode(raw).params, MemoryBlobs(enc.blobs, "test"))


def test_compresses_real_weights_like_neuzip(minilm_dir) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(minilm_dir / "model.safetensors"))
    w = sd["encoder.layer.0.intermediate.dense.weight"]
    out, size = roundtrip(w)
    assert_bits_equal(out, w)
    assert w.numel() * 4 / size > 1.18  # exponent entropy ~2.6 bits of 8
    out16, size16 = roundtrip(w.bfloat16())
    assert w.numel() * 2 / size16 > 1.4


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "F64"])
def test_compiled_kernels_match_numpy_reference(dtype: str) -> None:
    from hf_dynaquant.core import bitplanes

    assert bitplanes.native is not None, "the compiled kernels were not built"
    layout = FLOAT_LAYOUTS[dtype]
    torch.manual_seed(6)
    values = torch.cat(
        [
            torch.randn(30000) * 0.02,
            torch.exp2(torch.randint(-140, 120, (3000,)).float()),
            torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")]),
        ]
    )
    bits = to_raw(
        values.to({"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}[dtype])
    ).bits
    ref = bitplanes._split_float_numpy(bits, layout)
    fast = bitplanes.split_float(bits, layout)
    for field in ("head", "escapes", "side", "rest"):
        assert np.array_equal(getattr(ref, field), getattr(fast, field)), field
    assert ref.table == fast.table
    assert np.array_equal(bitplanes.join_float(ref, layout), bits)
    assert np.array_equal(bitplanes._join_float_numpy(fast, layout), bits)


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_matches_numpy_and_roundtrips(bits: int, monkeypatch) -> None:
    from hf_dynaquant.core import bitplanes

    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 1001, 100_003):
        values = rng.integers(0, 1 << bits, n, dtype=np.uint8)
        fast = bitplanes.pack_bits(values, bits)
        assert np.array_equal(bitplanes.unpack_bits(fast, bits, n), values)
        monkeypatch.setattr(bitplanes, "native", None)  # the numpy reference
        assert np.array_equal(bitplanes.pack_bits(values, bits), fast)
        assert np.array_equal(bitplanes.unpack_bits(fast, bits, n), values)
        monkeypatch.undo()


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_from_a_base_refuses_values_outside_its_range(bits: int, monkeypatch) -> None:
    """Values less a base are packed, and unpacked plus it, as the numpy reference does; a value
    under the base or past ``base + 2^bits - 1`` is refused (checked in the packing's own pass),
    as is an unpacking that would pass 255."""
    from hf_dynaquant.core import bitplanes

    rng = np.random.default_rng(bits)
    base = 255 - (1 << bits) + 1 if bits < 8 else 0
    for n in (1, 7, 1001):
        values = (base + rng.integers(0, 1 << bits, n)).astype(np.uint8)
        for kernel in (bitplanes.native, None):
            monkeypatch.setattr(bitplanes, "native", kernel)
            packed = bitplanes.pack_bits(values, bits, base)
            assert np.array_equal(packed, bitplanes.pack_bits(values - np.uint8(base), bits))
            assert np.array_equal(bitplanes.unpack_bits(packed, bits, n, base), values)
            if bits < 8:
                for outside in (base - 1, 0) if base else (1 << bits, 255):
                    wrong = values.copy()
                    wrong[rng.integers(0, n)] = outside
                    with pytest.raises(ValueError, match="cannot be packed"):
                        bitplanes.pack_bits(wrong, bits, base)
                with pytest.raises(ValueError, match="pass 255"):
                    bitplanes.unpack_bits(packed, bits, n, base + 1)
        monkeypatch.undo()


def test_symbol_streams_pack_uniform_and_zstd_skewed() -> None:
    from hf_dynaquant.core.entropy import decode_stream, encode_symbols

    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 64, 100_000, dtype=np.uint8)
    coding, payload = encode_symbols(uniform, 6)
    assert coding == "pack6" and len(payload) == 75_000
    assert np.array_equal(decode_stream(coding, payload, uniform.size, "t"), uniform)
    sparse = np.where(rng.random(100_000) < 0.9, 0, uniform).astype(np.uint8)  # mostly zeros
    coding, payload = encode_symbols(sparse, 6)
    assert coding == "zstd" and len(payload) < 0.6 * 75_000
    assert np.array_equal(decode_stream(coding, payload, sparse.size, "t"), sparse)
    with pytest.raises(CorruptCheckpointError, match="cannot hold"):
        decode_stream("pack6", payload[:10], sparse.size, "t")
