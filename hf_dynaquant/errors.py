"""One small exception hierarchy for everything hf_dynaquant raises on purpose.

Every error names the file, tensor or step at fault, so a user can act on it without a debugger.
Catch :class:`DynaQuantError` to handle them all.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "DynaQuantError",
    "FormatError",
    "UnsupportedFormatVersionError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "MissingBaseError",
    "MissingPretrainedError",
    "MissingShardError",
    "EntryNotFoundError",
    "CodecError",
    "UnknownCodecError",
    "UnsupportedTensorError",
    "NonFiniteTensorError",
    "NonFiniteTensorWarning",
    "UnsafeInputError",
    "CheckpointError",
    "MissingOptimizerStateError",
    "IncompleteCheckpointError",
    "NoValidCheckpointError",
    "StoreWriteError",
    "BackgroundCompressionError",
    "InvalidSettingError",
    "UnsupportedSetupError",
]


class DynaQuantError(Exception):
    """Base class of every error raised by hf_dynaquant."""


class FormatError(DynaQuantError):
    """A checkpoint container is not what the format specification (FORMAT.md) says."""


class UnsupportedFormatVersionError(FormatError):
    """A manifest or store was written by a format version this library cannot read."""

    def __init__(self, path: str, found: object, supported: int) -> None:
        super().__init__(
            f"{path}: format version {found!r} is not supported (this library reads version "
            f"{supported}); upgrade hf_dynaquant to read it"
        )
        self.path, self.found, self.supported = path, found, supported


class CorruptCheckpointError(FormatError):
    """A file of a checkpoint is damaged: truncated, unreadable or inconsistent."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A blob's bytes do not match the checksum its manifest recorded."""

    def __init__(self, path: str, tensor: str, blob: str, expected: str, actual: str) -> None:
        super().__init__(
            f"{path}: checksum mismatch in tensor {tensor!r} (blob {blob!r}): expected "
            f"sha256 {expected[:16]}..., found {actual[:16]}...; the file is corrupt"
        )
        self.path, self.tensor, self.blob = path, tensor, blob


class MissingBaseError(FormatError):
    """A delta entry names a base entry that is not in the store."""

    def __init__(self, entry: str, base: str, store: str) -> None:
        super().__init__(
            f"entry {entry[:16]} in store {store} is a delta on base {base[:16]}, which is "
            "missing: the chain is broken and this checkpoint cannot be restored"
        )
        self.entry, self.base, self.store = entry, base, store


class MissingPretrainedError(DynaQuantError):
    """The pre-trained weights a fine-tune's checkpoints are coded against (residuals, see
    :mod:`hf_dynaquant.pretrained.weights`) cannot be found, or are not the files that were recorded
    (size or SHA-256 differ). The message names the source (folder or Hub repo and revision),
    the file, the entry or setting at fault, and how to fix it."""

    def __init__(
        self, where: str, source: str, problem: str, file: str | None = None, revision: str | None = None
    ) -> None:
        at = f"{source} (revision {revision})" if revision else source
        what = f"file {file!r} of " if file else ""
        if os.path.isabs(source):
            back = f"put the folder {source} back as it was"
        else:
            back = (
                f"put the Hub repo {source} at revision {revision or 'main'} back in the local Hugging Face "
                f"cache (hf download {source}" + (f" --revision {revision}" if revision else "") + ")"
            )
        super().__init__(
            f"{where}: {what}the pre-trained weights {at} {problem}; {back}, or pass pretrained=PATH "
            "naming a folder that holds the same files"
        )
        self.where, self.source, self.file, self.revision = where, source, file, revision


class MissingShardError(FormatError):
    """A sharded checkpoint's index names a shard entry that is not in the store (a rank's
    files were lost): the message names the shard, the entry and the checkpoint."""


class EntryNotFoundError(FormatError, KeyError):
    """No entry or reference of that name exists in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CodecError(DynaQuantError):
    """A codec cannot encode or decode a tensor."""


class UnknownCodecError(CodecError):
    """A manifest or a caller names a codec that is not registered."""


class UnsupportedTensorError(CodecError):
    """A tensor's dtype or layout cannot be stored."""


class NonFiniteTensorError(CodecError, ValueError):
    """A tensor to quantize holds NaN or infinite values and ``QuantConfig(non_finite="raise")``
    refuses to store it losslessly instead; the message names the tensors and the step."""

    def __init__(self, message: str, tensors: list[str], where: str | None = None) -> None:
        super().__init__(message)
        self.tensors, self.where = tensors, where


class NonFiniteTensorWarning(UserWarning):
    """A tensor holding NaN or infinite values is stored losslessly instead of quantized
    (``QuantConfig(non_finite="lossless")``, the default); the message names it and the step."""


class UnsafeInputError(DynaQuantError):
    """An input would need unpickling (or another unsafe load) to be read; we refuse."""


class CheckpointError(DynaQuantError):
    """A training checkpoint cannot be written or resumed as asked."""


class MissingOptimizerStateError(CheckpointError):
    """A resume needs optimizer state that the checkpoint does not hold (we never fall back to a
    fresh optimizer silently)."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint folder lacks its weights: its compression had not finished (a crash), or
    its files were removed."""


class NoValidCheckpointError(IncompleteCheckpointError, ValueError):
    """``resume_from_checkpoint=True`` found no complete checkpoint in the output directory. A
    ``ValueError`` worded as ``transformers.Trainer``'s own ("No valid checkpoint found in output
    directory ..."), so code that catches the Trainer's error catches ours."""


class StoreWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed in the file system (disk full, permission denied, ...). The
    message names the store and the file; ``errno`` is the system's. Nothing of the failed
    write is visible, and every earlier checkpoint is intact. Also an ``OSError``."""

    def __init__(self, where: str, exc: OSError, path: object = None) -> None:
        name = errno.errorcode.get(exc.errno or 0, "")
        super().__init__(
            exc.errno,
            f"{where}: cannot write {exc.filename or path or 'a file'}: {exc.strerror or exc}"
            + (f" ({name})" if name else "")
            + "; nothing of this checkpoint was kept and earlier ones are intact",
        )

    def __str__(self) -> str:  # OSError would prefix "[Errno N]"
        return str(self.strerror)


class BackgroundCompressionError(CheckpointError):
    """Compressing a checkpoint on the background worker failed; raised in the training loop at
    the next step, naming the checkpoint (the original exception is its ``__cause__``)."""


class InvalidSettingError(DynaQuantError, ValueError):
    """A setting (an argument or its ``ACCELERATE_DYNAQUANT_*`` environment variable) has a value
    that cannot be used; the message names the setting and the value."""


class UnsupportedSetupError(CheckpointError):
    """The training set-up (a distributed mode, a model or optimizer not prepared by the
    accelerator) is one the integration cannot checkpoint correctly; the message says why."""
