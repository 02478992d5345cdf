"""The ``lossless`` codec: bit-exact compression of any tensor, after NeuZip.

Floats go through :func:`~hf_dynaquant.core.bitplanes.split_float` (exponent rank + leading
mantissa bits in a head byte, entropy-coded; the rest in byte planes kept raw unless they
compress); integers and booleans through byte planes. Tensors are cut in chunks of
:data:`CHUNK` elements, each with its own exponent table, so memory stays bounded, chunks
encode in parallel, and a chunk adapts to its own value range.

Delta mode: when the store offers the same tensor from a base checkpoint, the codec tries
XOR-ing the new bits with the old ones first. Between nearby training checkpoints sign and
exponent rarely change, so the XOR's head bytes are nearly all zero. A sample decides whether
the delta pays; if not the tensor is stored self-contained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.bitplanes import FloatPlanes, join_bytes, join_float, side_bits, split_bytes, split_float
from ..core.dtypes import FLOAT_LAYOUTS, UINT_DTYPES, RawTensor, itemsize
from ..core.entropy import decode_stream, encode_stream, encode_symbols, packed_bits
from ..core.pool import ForkSafePool
from ..errors import CorruptCheckpointError
from .base import BlobSource, Codec, Encoded, register_codec

__all__ = ["LosslessCodec", "CHUNK", "KEEP_BYTES"]

CHUNK = 1 << 20  # elements per chunk
_SAMPLE = 1 << 16  # elements used to decide whether a delta pays (at most CHUNK)
_DELTA_SHARE = 0.95  # a delta pays where its sample codes to under this share of the plain sample's size
# bytes up to which a tensor's bits are kept for the next delta on it (LosslessCodec.kept)
KEEP_BYTES = 1 << 16
_POOL = ForkSafePool("dq-lossless")
_WORKERS = _POOL.max_workers


def _is_split_float(dtype: str) -> bool:
    layout = FLOAT_LAYOUTS.get(dtype)
    return layout is not None and layout.width > 8


def _encode_chunk(bits: np.ndarray, dtype: str) -> tuple[bytes, dict[str, Any]]:
    """Encode one chunk; returns its blob and the JSON describing its streams."""
    if _is_split_float(dtype):
        layout = FLOAT_LAYOUTS[dtype]
        planes = split_float(bits, layout)
        coded = [
            encode_stream(planes.head),
            encode_stream(planes.escapes.view(np.uint8)),
            encode_symbols(planes.side, side_bits(layout)),
            encode_stream(planes.rest),
        ]
        sizes = [planes.head.size, planes.escapes.nbytes, planes.side.size, planes.rest.size]
        extra: dict[str, Any] = {"table": planes.table}
    else:
        byte_planes = split_bytes(bits)
        coded = [encode_stream(p) for p in byte_planes]
        sizes = [p.size for p in byte_planes]
        extra = {}
    parts, streams = [], []
    for (coding, payload), size in zip(coded, sizes):
        parts.append(payload)
        streams.append([coding, int(size), len(payload)])
    return b"".join(parts), {"n": int(bits.size), "streams": streams, **extra}


def _decode_chunk(blob: np.ndarray, info: dict[str, Any], dtype: str, out: np.ndarray, where: str) -> None:
    """Decode one chunk into ``out`` (the chunk's slice of the tensor's bits)."""
    streams, pos = [], 0
    for i, (coding, size, length) in enumerate(info["streams"]):
        payload = blob[pos : pos + length]
        # a packed side stream goes to the join kernel as it is, which unpacks it on the fly
        packed = i == 2 and _is_split_float(dtype) and packed_bits(coding)
        streams.append(payload if packed else decode_stream(coding, payload, int(size), f"{where} stream {i}"))
        pos += length
    if pos != blob.size or int(info["n"]) != out.size:
        raise CorruptCheckpointError(f"{where}: chunk layout does not match its blob or the tensor's shape")
    try:
        if _is_split_float(dtype):
            if len(streams) != 4:
                raise ValueError(f"{len(streams)} streams, a float chunk has 4")
            planes = FloatPlanes(
                streams[0],
                list(info["table"]),
                streams[1].view("<u2"),
                streams[2],
                streams[3],
                side_packed=packed_bits(info["streams"][2][0]),
            )
            join_float(planes, FLOAT_LAYOUTS[dtype], out=out)
        else:
            join_bytes(streams, itemsize(dtype), out=out)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None


def _run(fn: Callable[[int], Any], count: int) -> list[Any]:
    """``[fn(i) for i in range(count)]``, on the thread pool when there is more than one."""
    return [fn(0)] if count == 1 else list(_POOL.map(fn, range(count)))


def _chunks(bits: np.ndarray) -> list[np.ndarray]:
    """Equal chunks of at most CHUNK elements; a tensor that needs several gets a multiple of
    the worker count, so the threads finish together."""
    count = -(-bits.size // CHUNK)
    if count > 1:
        count = -(-count // _WORKERS) * _WORKERS
    step = max(1, -(-bits.size // max(count, 1)))
    return [bits[i : i + step] for i in range(0, bits.size, step)] or [bits]


def _encoded_size(bits: np.ndarray, dtype: str) -> int:
    return len(_encode_chunk(bits, dtype)[0])


@register_codec
class LosslessCodec(Codec):
    """Bit-exact codec for tensors of every dtype; see the module docstring."""

    name = "lossless"
    version = 1
    stable_state = True  # kept(): a copy, of small tensors only

    def __init__(self, delta: bool = True) -> None:
        self.delta = delta

    def kept(self, state: RawTensor) -> RawTensor | None:
        """A copy of a tensor of at most :data:`KEEP_BYTES` (the encoded state is the caller's
        tensor, which training goes on changing), for the next delta on it; None for a larger
        one, which that delta reads back from the base entry. A model's small tensors (biases,
        norms and their optimizer moments: 246 of a GPT-2 124M checkpoint's, 0.5 MB) were each
        read back and decoded by the next delta's writing thread, the chain behind the ones
        coded as XOR replayed too: 0.05-0.075 s of each delta at 124M, growing along the chain.
        A large one is read back at the disk's pace, and held it could take a checkpoint's size
        between saves (the optimizer state stored losslessly)."""
        if state.bits.nbytes > KEEP_BYTES:
            return None
        return RawTensor(state.dtype, state.shape, state.bits.copy())

    def max_blobs(self, numel: int) -> int:
        return len(_chunks(np.empty(numel, dtype=np.uint8)))

    def _delta_pays(self, tensor: RawTensor, base: RawTensor) -> bool:
        sample = slice(0, min(tensor.bits.size, _SAMPLE))
        cur = tensor.bits[sample]
        return _encoded_size(cur ^ base.bits[sample], tensor.dtype) < _DELTA_SHARE * _encoded_size(cur, tensor.dtype)

    def encode(self, tensor: RawTensor, base: Any = None) -> Encoded:
        offered = (
            self.delta
            and isinstance(base, RawTensor)
            and base.dtype == tensor.dtype
            and base.shape == tensor.shape
            and tensor.bits.size > 0
        )
        if offered and tensor.bits.size <= _SAMPLE:
            # the sample is the whole tensor, in one chunk: its two codings are the candidates
            # (a model's biases and norms and their moments, coded three times each otherwise)
            xor, plain = (_encode_chunk(bits, tensor.dtype) for bits in (tensor.bits ^ base.bits, tensor.bits))
            use_base = len(xor[0]) < _DELTA_SHARE * len(plain[0])
            results = [xor if use_base else plain]
        else:
            use_base = offered and self._delta_pays(tensor, base)
            bits = tensor.bits ^ base.bits if use_base else tensor.bits
            chunks = _chunks(bits)
            results = _run(lambda i: _encode_chunk(chunks[i], tensor.dtype), len(chunks))
        blobs = {f"c{i}": blob for i, (blob, _) in enumerate(results)}
        params = {"chunks": [info for _, info in results], "xor": use_base}
        return Encoded(blobs, params, uses_base=use_base, state=tensor)

    def decode(
        self,
        dtype: str,
        shape: tuple[int, ...],
        params: dict[str, Any],
        blobs: BlobSource,
        base: Any = None,
        *,
        reference: np.ndarray | None = None,
    ) -> RawTensor:
        infos, where = params["chunks"], blobs.where
        n = int(np.prod(shape, dtype=np.int64))
        bits = np.empty(n, dtype=UINT_DTYPES[itemsize(dtype)])
        if sum(int(info["n"]) for info in infos) != n:
            raise CorruptCheckpointError(f"{where}: chunks hold a different element count than shape {list(shape)}")
        starts = np.cumsum([0] + [int(info["n"]) for info in infos])

        def one(i: int) -> None:
            _decode_chunk(blobs(f"c{i}"), infos[i], dtype, bits[starts[i] : starts[i + 1]], f"{where} chunk {i}")

        _run(one, len(infos))
        if params.get("xor"):
            if not isinstance(base, RawTensor) or base.bits.size != n:
                raise CorruptCheckpointError(f"{where}: delta-coded but its base tensor is missing or differs in size")
            bits ^= base.bits
        return RawTensor(dtype, tuple(shape), bits)
