"""Codecs, one module per method, behind the small interface in :mod:`.base`."""

from .base import BlobSource, Codec, Encoded, MemoryBlobs, codec_names, get_codec, register_codec
from .dynaquant import DynaQuantCodec, KeptState, QuantState
from .lossless import LosslessCodec
from .peers import NF4Codec

__all__ = [
    "BlobSource",
    "MemoryBlobs",
    "Codec",
    "DynaQuantCodec",
    "Encoded",
    "KeptState",
    "LosslessCodec",
    "NF4Codec",
    "QuantState",
    "codec_names",
    "get_codec",
    "register_codec",
]
