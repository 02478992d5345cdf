"""Crash-safe file operations: write to a temporary name, fsync, rename, fsync the directory.

A reader never sees half a file, and a crash at any point leaves the previous version intact.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["atomic_write_bytes", "fsync_dir", "fsync_file", "temp_name"]


def temp_name(path: Path) -> Path:
    """A unique temporary sibling of ``path`` (same directory, so rename is atomic)."""
    return path.with_name(f".tmp-{uuid.uuid4().hex[:12]}-{path.name}")


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry table (makes renames and creations durable)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms without directory fds (Windows) make renames durable themselves
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
