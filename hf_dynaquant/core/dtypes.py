"""Tensor dtypes by their safetensors names, and lossless torch <-> raw-bits conversion.

Codecs work on :class:`RawTensor`: the tensor's bits as a flat little-endian numpy array of
unsigned integers (or bytes), independent of torch. This keeps numeric code torch-free and lets
bfloat16 and float8 (which numpy lacks) travel bit-exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..errors import UnsupportedTensorError

__all__ = [
    "RawTensor",
    "ValuesInParts",
    "bf16_parts",
    "FloatLayout",
    "FLOAT_LAYOUTS",
    "check_storable",
    "to_raw",
    "from_raw",
    "dtype_name",
    "itemsize",
    "storage_key",
    "all_finite",
    "bf16_bits_to_f32",
]

# safetensors name -> (torch dtype, item size in bytes)
_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "U16": (torch.uint16, 2),
    "I32": (torch.int32, 4),
    "U32": (torch.uint32, 4),
    "I64": (torch.int64, 8),
    "U64": (torch.uint64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
_BY_TORCH = {t: name for name, (t, _) in _DTYPES.items()}
# the unsigned integer type that holds one element's bits
UINT_DTYPES = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_TORCH_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class FloatLayout:
    """Bit layout of an IEEE-style float: 1 sign bit, ``exponent_bits``, ``mantissa_bits``."""

    exponent_bits: int
    mantissa_bits: int

    @property
    def width(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


FLOAT_LAYOUTS: dict[str, FloatLayout] = {
    "F64": FloatLayout(11, 52),
    "F32": FloatLayout(8, 23),
    "BF16": FloatLayout(8, 7),
    "F16": FloatLayout(5, 10),
    "F8_E4M3": FloatLayout(4, 3),
    "F8_E5M2": FloatLayout(5, 2),
}


@dataclass
class RawTensor:
    """A tensor as its dtype name, shape and flat raw bits (``uint8/16/32/64``, little-endian)."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)


@dataclass(frozen=True)
class ValuesInParts:
    """A float32 tensor made a part at a time: ``fill(start, stop, out)`` writes its flat values
    ``start:stop`` into ``out`` (float32, ``stop - start`` of them). A codec that reads it so
    (:attr:`~hf_dynaquant.codecs.base.Codec.reads_parts`) never holds it whole: Adam's update,
    made from the moments in float32, is the size of the weights; made whole for each tensor it
    was a pass that wrote it, page faults for its new memory, and a pass that read it back to
    quantize it. :meth:`made` makes it whole, for a codec that needs it so."""

    shape: tuple[int, ...]
    fill: Callable[[int, int, np.ndarray], None]

    dtype: ClassVar[str] = "F32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def made(self) -> RawTensor:
        """The tensor whole, as raw bits."""
        values = np.empty(self.numel, dtype=np.float32)
        self.fill(0, values.size, values)
        return RawTensor(self.dtype, self.shape, values.view(np.uint32))


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name."""
    try:
        return _DTYPES[dtype][1]
    except KeyError:
        raise UnsupportedTensorError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``)."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedTensorError(
            f"dtype {dtype} cannot be stored; supported: {sorted(str(t) for t in _BY_TORCH)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    itemsize(name)
    return _DTYPES[name][0]


def check_storable(tensor: torch.Tensor, name: str = "tensor") -> None:
    """Raise :class:`UnsupportedTensorError` naming ``name`` for a tensor whose values cannot be
    read (on the ``meta`` device) or stored (sparse or other non-strided layouts, complex)."""
    if tensor.is_meta:
        raise UnsupportedTensorError(
            f"tensor {name!r} is on the meta device and has no values to store; materialise the model "
            "(e.g. load its weights or call to_empty() and initialise it) first"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise UnsupportedTensorError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be stored")
    if tensor.is_complex():
        raise UnsupportedTensorError(f"tensor {name!r} is complex ({tensor.dtype}); store real and imaginary parts")


def to_raw(tensor: torch.Tensor, name: str = "tensor") -> RawTensor:
    """Copy a tensor's bits to a flat numpy array (moves it to the CPU, makes it contiguous)."""
    check_storable(tensor, name)
    dname = dtype_name(tensor.dtype)
    size = itemsize(dname)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_TORCH_SIGNED[size]).numpy().view(UINT_DTYPES[size])
    return RawTensor(dname, tuple(int(s) for s in tensor.shape), bits)


def from_raw(raw: RawTensor) -> torch.Tensor:
    """Rebuild a torch tensor (CPU) from raw bits; the inverse of :func:`to_raw`."""
    size = itemsize(raw.dtype)
    bits = np.ascontiguousarray(raw.bits).view(UINT_DTYPES[size])
    signed = torch.from_numpy(bits.view(np.dtype(f"<i{size}") if size > 1 else np.uint8))
    return signed.view(torch_dtype(raw.dtype)).reshape(raw.shape)


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN and no infinity. A sum is finite only if every term is
    (NaN and infinities propagate), and summing is ~20x faster than ``torch.isfinite(t).all()``
    (which writes a boolean per value); only a sum that overflows is checked value by value."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def storage_key(t: torch.Tensor) -> tuple | None:
    """Identifies a tensor view exactly: two names with the same key are one tensor (tied
    weights). None for empty or non-strided tensors, which are never shared."""
    if t.numel() == 0 or t.layout != torch.strided:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def raw_from_bytes(dtype: str, shape: tuple[int, ...], data: bytes | memoryview | np.ndarray) -> RawTensor:
    """Wrap a little-endian byte buffer as a :class:`RawTensor` (no copy where possible)."""
    bits = np.frombuffer(data, dtype=UINT_DTYPES[itemsize(dtype)])
    expected = int(np.prod(shape, dtype=np.int64))
    if bits.size != expected:
        raise UnsupportedTensorError(f"buffer holds {bits.size} elements of {dtype}, shape {shape} needs {expected}")
    return RawTensor(dtype, tuple(shape), bits)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their bits (uint16) widened to float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_parts(t: torch.Tensor) -> Callable[[int, int, np.ndarray], None] | None:
    """A :class:`ValuesInParts` ``fill`` of a contiguous bfloat16 CPU tensor's flat values
    widened to float32 exactly, a part at a time (a pure-bf16 Adam ``v`` as its scale's codes
    are made from it: whole, a 124M GPT-2's embedding's took 0.21x the checkpoint); None for
    any other tensor."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
        return None
    bits = t.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)

    def fill(start: int, stop: int, out: np.ndarray) -> None:
        wide = out.view(np.uint32)
        wide[...] = bits[start:stop]
        wide <<= 16

    return fill
