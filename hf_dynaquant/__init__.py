"""hf_dynaquant: compress deep-learning checkpoints with DynaQuant, inside the Hugging Face tools.

The container (:class:`CheckpointStore`) holds model tensors, optimizer state and opaque extras
as checksummed safetensors payloads with a JSON manifest, never pickle; entries can be delta
chains. Codecs (:mod:`hf_dynaquant.codecs`) turn tensors into compact blobs.
"""

from ._version import __version__
from .codecs import Codec, codec_names, get_codec, register_codec
from .core.quantizer import QuantConfig
from .errors import (
    BackgroundCompressionError,
    CheckpointError,
    ChecksumMismatchError,
    CodecError,
    CorruptCheckpointError,
    DynaQuantError,
    EntryNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    InvalidSettingError,
    MissingBaseError,
    MissingOptimizerStateError,
    MissingPretrainedError,
    MissingShardError,
    NonFiniteTensorError,
    NonFiniteTensorWarning,
    NoValidCheckpointError,
    StoreWriteError,
    UnknownCodecError,
    UnsafeInputError,
    UnsupportedFormatVersionError,
    UnsupportedSetupError,
    UnsupportedTensorError,
)
from .integrations import hf_quantizer as _hf_quantizer
from .integrations.hub import compress_pretrained, from_pretrained, pull, push_to_hub
from .pipeline import compress_state_dict
from .pretrained.folder import compress_folder, decompress_folder
from .pretrained.transfer import FineTuneCheck, FineTuneResult, topic_classification
from .pretrained.weights import PretrainedWeights
from .search import QualityMetric, SearchSpace
from .store import CheckpointStore, EntryInfo, EntryReader
from .training.checkpoint_dir import materialize_checkpoint
from .training.compressor import Compressor
from .training.manager import CheckpointManager
from .training.optimizer_state import MomentQuant
from .training.settings import CheckpointSettings
from .training.sharded import ShardedCompressor

materialize = materialize_checkpoint  # the short name of the README's resume recipe

__all__ = [
    "__version__",
    "CheckpointStore",
    "Compressor",
    "CheckpointManager",
    "ShardedCompressor",
    "CheckpointSettings",
    "QuantConfig",
    "QualityMetric",
    "SearchSpace",
    "PretrainedWeights",
    "compress_state_dict",
    "EntryInfo",
    "EntryReader",
    "Codec",
    "codec_names",
    "get_codec",
    "register_codec",
    "compress_folder",
    "decompress_folder",
    "materialize",
    "materialize_checkpoint",
    "MomentQuant",
    "DynaQuantCallback",
    "DynaQuantTrainer",
    "DynaQuantPlugin",
    "DynaQuantError",
    "MissingOptimizerStateError",
    "MissingShardError",
    "UnsupportedSetupError",
    "BackgroundCompressionError",
    "CheckpointError",
    "IncompleteCheckpointError",
    "InvalidSettingError",
    "NoValidCheckpointError",
    "StoreWriteError",
    "FormatError",
    "UnsupportedFormatVersionError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "MissingBaseError",
    "MissingPretrainedError",
    "EntryNotFoundError",
    "CodecError",
    "UnknownCodecError",
    "UnsupportedTensorError",
    "NonFiniteTensorError",
    "NonFiniteTensorWarning",
    "UnsafeInputError",
    "compress_pretrained",
    "push_to_hub",
    "pull",
    "from_pretrained",
    "FineTuneCheck",
    "FineTuneResult",
    "topic_classification",
]

# The one place hf_dynaquant registers with transformers, and it must be at import: the README and
# tests promise that `AutoModel.from_pretrained(<DynaQuant snapshot>)` works after
# `import hf_dynaquant` alone, and that call goes through transformers, not through us (see
# hf_quantizer.register for what is touched).
_hf_quantizer.register()


def __getattr__(name: str):
    """The Trainer and Accelerate integrations are imported on first use (both are heavy)."""
    if name in ("DynaQuantCallback", "DynaQuantTrainer"):
        from .integrations import trainer

        return getattr(trainer, name)
    if name == "DynaQuantPlugin":
        from .integrations import accelerate

        return accelerate.DynaQuantPlugin
    raise AttributeError(f"module 'hf_dynaquant' has no attribute {name!r}")
