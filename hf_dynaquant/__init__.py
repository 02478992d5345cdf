"""hf_dynaquant: compress deep-learning checkpoints with DynaQuant, inside the Hugging Face tools.

The container (:class:`CheckpointStore`) holds model tensors, optimizer state and opaque extras
as checksummed safetensors payloads with a JSON manifest, never pickle; entries can be delta
chains. Codecs (:mod:`hf_dynaquant.codecs`) turn tensors into compact blobs.
"""

__version__ = "0.1.0"

from .codecs import Codec, codec_names, get_codec, register_codec
from .compressor import Compressor, compress_state_dict
from .core.quantizer import QuantConfig
from .errors import (
    ChecksumMismatchError,
    CodecError,
    CorruptCheckpointError,
    DynaQuantError,
    EntryNotFoundError,
    FormatError,
    MissingBaseError,
    UnknownCodecError,
    UnsafeInputError,
    UnsupportedFormatVersionError,
    UnsupportedTensorError,
)
from .folder import compress_folder, decompress_folder
from .store import CheckpointStore, EntryInfo, EntryReader

__all__ = [
    "__version__",
    "CheckpointStore",
    "Compressor",
    "QuantConfig",
    "compress_state_dict",
    "EntryInfo",
    "EntryReader",
    "Codec",
    "codec_names",
    "get_codec",
    "register_codec",
    "compress_folder",
    "decompress_folder",
    "DynaQuantError",
    "FormatError",
    "UnsupportedFormatVersionError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "MissingBaseError",
    "EntryNotFoundError",
    "CodecError",
    "UnknownCodecError",
    "UnsupportedTensorError",
    "UnsafeInputError",
]
