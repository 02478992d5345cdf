"""Streaming writer for the safetensors format, and a checked reader around ``safe_open``.

``safetensors.save_file`` needs every tensor in memory at once. Writing a compressed checkpoint
should need no more than one tensor's worth, so :class:`StreamingWriter` appends each tensor's
bytes as soon as it exists and writes the header last: into space reserved at the front (the
safetensors spec allows the header JSON to be padded with spaces), or, when the reservation
was too small, by moving the data once behind a larger header. Files it writes are ordinary
safetensors files; the ``safetensors`` library validates each when it is opened, and its blobs
are then read at the header's offsets (:class:`PayloadFile`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from ..errors import ChecksumMismatchError, CorruptCheckpointError

__all__ = [
    "PayloadFile",
    "StreamingWriter",
    "header_size_estimate",
    "read_blob",
    "read_checked_blob",
]

# Unused header reservation kept as padding: beyond this (and 1% of the data) the file is
# rewritten with an exact header, which costs a copy of the data (cheap when it is that small).
_MAX_PADDING = 1024


def header_size_estimate(keys: list[str], per_key_shape_digits: int = 40) -> int:
    """Bytes a header for ``keys`` (1-D or small tensors) is very unlikely to exceed."""
    return 64 + sum(len(json.dumps(k)) + 64 + per_key_shape_digits for k in keys)


class StreamingWriter:
    """Appends tensors to a safetensors file one at a time; :meth:`close` writes the header.

    The file is complete only after :meth:`close`; the caller makes it visible atomically
    (it is written inside a temporary entry directory, see :mod:`.store`). The header space is
    reserved from an upper-bound estimate; what it leaves unused stays as padding only when
    that is small (see ``_MAX_PADDING``), else the file is rewritten with the exact header.
    """

    def __init__(self, path: Path, header_reserve: int) -> None:
        self.path = Path(path)
        self._reserve = max(8, (header_reserve + 7) // 8 * 8)
        self._fh = open(self.path, "wb")
        self._fh.seek(8 + self._reserve)
        self._entries: dict[str, dict[str, Any]] = {}
        self._offset = 0

    def add(
        self, key: str, dtype: str, shape: tuple[int, ...] | list[int], data: bytes | memoryview | np.ndarray
    ) -> None:
        """Append one tensor's raw little-endian bytes under ``key``."""
        if key in self._entries:
            raise ValueError(f"duplicate tensor key {key!r} in {self.path}")
        view = (
            memoryview(data).cast("B")
            if not isinstance(data, np.ndarray)
            else memoryview(np.ascontiguousarray(data)).cast("B")
        )
        self._fh.write(view)
        end = self._offset + view.nbytes
        self._entries[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [self._offset, end]}
        self._offset = end

    def close(self, metadata: dict[str, str] | None = None) -> int:
        """Write the header and flush to disk; returns the file size."""
        header: dict[str, Any] = dict(self._entries)
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        unused = self._reserve - len(raw)
        if 0 <= unused <= max(_MAX_PADDING, self._offset // 100):  # else the padding would be waste worth a copy
            raw = raw + b" " * (self._reserve - len(raw))
            self._fh.seek(0)
            self._fh.write(struct.pack("<Q", len(raw)) + raw)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        else:  # the reservation was too small, or too large to keep as padding
            self._fh.close()
            raw = raw + b" " * (-len(raw) % 8)
            self._rewrite_with_header(raw)
        return 8 + len(raw) + self._offset

    def abort(self) -> None:
        """Close and delete a file that will not be finished."""
        self._fh.close()
        self.path.unlink(missing_ok=True)

    def _rewrite_with_header(self, raw: bytes) -> None:
        moved = self.path.with_name(self.path.name + ".grow")
        with open(self.path, "rb") as src, open(moved, "wb") as dst:
            dst.write(struct.pack("<Q", len(raw)) + raw)
            src.seek(8 + self._reserve)
            shutil.copyfileobj(src, dst, 1 << 22)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(moved, self.path)


class PayloadFile:
    """An open payload file whose blobs are read with ``pread``, each into memory of its own;
    damage found when it is opened is a :class:`CorruptCheckpointError` naming the file.

    ``safe_open`` validates the file when it is opened (the header, the offsets against the
    file's size) and is let go at once; the blobs are then read at the offsets of that header.
    Read through ``safe_open``'s memory map instead, every page of the file a reader had read
    stayed in the process's resident set until the reader closed: a restore keeps each entry of
    its chain open while it replays every tensor through them, so a pure-bf16 124M restore grew
    from 0.88x its checkpoint after a keyframe to 1.14x after nine deltas, most of it the
    payload files' pages. ``pread`` works from several threads at once on one descriptor; where
    the platform has none (Windows), a lock orders a seek and a read instead."""

    def __init__(self, path: Path) -> None:
        self.path, self._fd, self._lock = path, -1, threading.Lock()
        try:
            safe_open(str(path), framework="numpy")  # (validates the header; holds nothing once dropped)
            # (held for the reader's life: closed by close or when collected)
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            (size,) = struct.unpack("<Q", self._pread(memoryview(bytearray(8)), 0))
            header = json.loads(bytes(self._pread(memoryview(bytearray(size)), 8)))
        except FileNotFoundError:
            self.close()
            raise CorruptCheckpointError(f"{path}: payload file is missing") from None
        except (SafetensorError, OSError, ValueError, struct.error) as exc:
            self.close()
            raise CorruptCheckpointError(
                f"{path}: not a readable safetensors file, truncated or damaged ({exc})"
            ) from None
        start = 8 + size
        self._blobs = {
            key: (start + int(info["data_offsets"][0]), int(info["data_offsets"][1]) - int(info["data_offsets"][0]))
            for key, info in header.items()
            if key != "__metadata__"
        }

    def read(self, key: str) -> np.ndarray:
        """The blob ``key``'s bytes (``KeyError`` for a key the file does not hold, ``OSError``
        for a file shorter than its header says, or one closed)."""
        offset, n = self._blobs[key]
        out = np.empty(n, dtype=np.uint8)
        self._pread(memoryview(out), offset)
        return out

    def _pread(self, view: memoryview, offset: int) -> memoryview:
        """``view`` filled with the file's bytes from ``offset`` (``OSError`` where it ends first)."""
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                got = os.preadv(self._fd, [view[done:]], offset + done)
            else:
                with self._lock:
                    os.lseek(self._fd, offset + done, os.SEEK_SET)
                    data = os.read(self._fd, len(view) - done)
                view[done : done + len(data)] = data
                got = len(data)
            if got <= 0:
                raise OSError(f"the file ends {len(view) - done} bytes before the blob does")
            done += got
        return view

    _os_close = staticmethod(os.close)  # (held by the class: at interpreter exit the module's globals may be gone)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self._os_close(fd)

    def __del__(self) -> None:
        self.close()


def read_blob(handle: PayloadFile, key: str, tensor: str) -> np.ndarray:
    """One uint8 blob from an open payload file."""
    try:
        return handle.read(key)
    except (KeyError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{handle.path}: blob {key!r} of tensor {tensor!r} cannot be read ({exc})"
        ) from None


def read_checked_blob(handle: PayloadFile, info: dict[str, Any], tensor: str, blob: str) -> np.ndarray:
    """One uint8 blob from an open payload file, checked against its manifest record ``info``
    (``key``, ``nbytes``, ``sha256``; FORMAT.md): a :class:`ChecksumMismatchError` naming the
    file, tensor and blob when its bytes are not the recorded ones. The one checksum check of
    every reader of a payload (entry readers, and transformers loading a Hub snapshot)."""
    data = read_blob(handle, info["key"], tensor)
    actual = hashlib.sha256(data).hexdigest()
    if actual != info["sha256"] or data.size != info["nbytes"]:
        raise ChecksumMismatchError(str(handle.path), tensor, blob, info["sha256"], actual)
    return data
