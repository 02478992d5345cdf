"""The codec interface: how one tensor becomes blobs plus JSON parameters, and back.

A codec never touches files. The store hands it a :class:`~hf_dynaquant.core.dtypes.RawTensor`
(and, for delta coding, the *state* the same codec decoded for this tensor in the base entry);
it returns named byte blobs and a JSON-serialisable ``params`` dict, which the store writes
into the payload and the manifest. Decoding gets the params back and a :class:`BlobSource`
that checks each blob's checksum when it is read.

For byte-exact codecs the state is the decoded :class:`RawTensor` itself; lossy codecs may use
a richer state (for example quantization codes) and turn it into a tensor in
:meth:`Codec.to_raw`.

A codec that codes a *residual* says so in :meth:`Codec.reference_kind`: decoding then also gets
the reference values (flat float32) the store found for it: the base entry's decoded tensor
(``"previous"``) or the entry's pre-trained weights (``"pretrained"``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from ..core.dtypes import RawTensor
from ..core.quantizer import Coded
from ..errors import UnknownCodecError

__all__ = ["Encoded", "BlobSource", "MemoryBlobs", "Codec", "register_codec", "get_codec", "codec_names"]


@dataclass
class Encoded:
    """What a codec produced for one tensor."""

    blobs: dict[str, bytes]
    params: dict[str, Any]
    uses_base: bool = False
    state: Any = field(default=None, repr=False)  # what a later delta on this entry will need


class BlobSource(Protocol):
    """Reads a tensor's blobs by name, verifying checksums; ``where`` names it in errors."""

    where: str

    def __call__(self, name: str) -> np.ndarray: ...


class MemoryBlobs:
    """A :class:`BlobSource` over blobs held in memory (an :class:`Encoded`'s), to decode what a
    codec encoded without a store in between (tests, benchmarks)."""

    def __init__(self, blobs: dict[str, bytes], where: str = "in memory") -> None:
        self.blobs, self.where = blobs, where

    def __call__(self, name: str) -> np.ndarray:
        return np.frombuffer(self.blobs[name], dtype=np.uint8)


class Codec(ABC):
    """Encodes tensors to blobs and decodes them back. Subclasses register with
    :func:`register_codec` under a unique ``name``; ``version`` is stored per tensor."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    stable_state: ClassVar[bool] = False  # True if the store may keep what kept() makes of Encoded.state
    # True if encode() also takes a ValuesInParts (a deferred tensor made a part at a time); the
    # store makes it whole for a codec that does not
    reads_parts: ClassVar[bool] = False

    @abstractmethod
    def encode(self, tensor: RawTensor, base: Any = None) -> Encoded:
        """Encode ``tensor`` (or, where :attr:`reads_parts`, a
        :class:`~hf_dynaquant.core.dtypes.ValuesInParts`); ``base`` is this codec's decoded
        state of the same tensor in the base entry, or what :meth:`kept` made of its encoded
        state (or None). Set ``uses_base`` only if decoding will need it."""

    def kept(self, state: Any) -> Any:
        """What the store keeps of an encoded ``state`` (of a :attr:`stable_state` codec) for a
        later delta on it, until then: the state itself (when it owns its memory), unless the
        codec can hold it smaller or must copy it (:meth:`encode` takes either as ``base``);
        None keeps nothing, and that delta reads the base entry's state back instead."""
        return state

    @abstractmethod
    def decode(
        self,
        dtype: str,
        shape: tuple[int, ...],
        params: dict[str, Any],
        blobs: BlobSource,
        base: Any = None,
        *,
        reference: np.ndarray | None = None,
    ) -> Any:
        """Decode a tensor's state from its blobs (and the base state when it used one; the
        reference values when :meth:`reference_kind` names one). The base is the caller's to
        give up: a decode may reuse its writable arrays for the new state (the store decodes
        each base for this one decode, and a restore then pages in no fresh copy of the codes)."""

    def reference_kind(self, params: dict[str, Any]) -> str | None:
        """The reference a stored tensor's decode adds its values to: ``None``, ``"previous"``
        (the base entry's decoded tensor) or ``"pretrained"`` (the entry's pre-trained weights)."""
        return None

    def to_raw(self, state: Any) -> RawTensor:
        """Turn a decoded state into the tensor; identity for byte-exact codecs."""
        return state

    def coded(self, state: Any) -> Coded | None:
        """A decoded state as plain codes (:class:`~hf_dynaquant.core.quantizer.Coded`: codes,
        centres, protected values, nothing added), for a consumer that turns codes into values
        of its own; ``None`` where the state is not that."""
        return None

    def keyframe(self, state: Any) -> Encoded:
        """Re-encode a decoded state self-contained (used to compact a delta chain)."""
        return self.encode(self.to_raw(state))

    def max_blobs(self, numel: int) -> int:
        """An upper bound of the blobs :meth:`encode` makes for a tensor of ``numel`` elements
        (used to reserve the payload header)."""
        return 1


_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec available by its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a codec named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def get_codec(name: str | Codec, **options: Any) -> Codec:
    """A codec instance by name (options go to its constructor), or the instance itself."""
    if isinstance(name, Codec):
        return name
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None
    return cls(**options)


def codec_names() -> list[str]:
    """Names of the registered codecs."""
    return sorted(_REGISTRY)
