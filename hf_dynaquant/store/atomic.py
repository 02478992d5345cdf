"""Crash-safe file operations: write to a temporary name, fsync, rename, fsync the directory.

A reader never sees half a file, and a crash at any point leaves the previous version intact.

Temporary items and their owners
--------------------------------
Every temporary item (a file, or a folder an entry or a whole compressed folder is built in) is
named ``.tmp-<host>-<pid>-<token>-<name>``: ``<host>`` is 8 hex digits of a hash of the host
name, ``<pid>`` the writer's process id, ``<token>`` a random start token, ``<name>`` what the
item becomes (empty for store entries, whose name is their content id). Its writer holds an
exclusive ``fcntl.flock`` on it for as long as it lives: on the file itself, or on the folder's
``.lock`` file. The kernel drops that lock when the writer dies (SIGKILL, power loss), so a
temporary item whose lock *can* be taken is a leftover of a dead writer (:func:`owner_is_dead`)
and may be removed; one whose lock cannot be taken belongs to a live writer and is never touched.
Both sides check after locking that the lock file is still the one at that path, which closes
the race between a writer creating an item and a cleaner locking it. An item without its lock
(the instant between ``mkdir`` and creating ``.lock``, or one left by an older version) is dead
only when its pid is gone on this host, or, from another host or with no pid, after an hour.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DynaQuantError

__all__ = [
    "LOCK_FILE",
    "TempDir",
    "atomic_write_bytes",
    "atomic_write_json",
    "dead_leftovers",
    "fsync_dir",
    "fsync_file",
    "owner_is_dead",
    "publish_folder",
    "remove_dead_leftovers",
    "size_on_disk",
    "staging_folder",
    "target_name",
    "temp_name",
]

LOCK_FILE = ".lock"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# .tmp-<host>-<pid>-<token>[-<name>]; older versions wrote .tmp-<hex>[-<name>] (no owner)
_OWNED = re.compile(r"^\.tmp-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<token>[0-9a-f]{12})(?:-(?P<name>.+))?$")
_LEGACY = re.compile(r"^\.tmp-[0-9a-f]{8,32}(?:-(?P<name>.+))?$")
# An item with no lock we can check and no pid on this host is declared dead after this long.
STALE_SECONDS = 3600.0


def _owned_name(name: str) -> str:
    """A fresh temporary item's name, with this process as its owner, for what becomes ``name``."""
    return f".tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}" + (f"-{name}" if name else "")


def temp_name(path: Path) -> Path:
    """A unique temporary sibling of ``path`` (same directory, so rename is atomic), named with
    this process as its owner."""
    return path.with_name(_owned_name(path.name))


def target_name(item: Path) -> str | None:
    """The name a temporary item was to become (``None`` for a store entry's folder, or for a
    name that is not a temporary item's)."""
    m = _OWNED.match(item.name) or _LEGACY.match(item.name)
    return m.group("name") if m else None


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


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _lock_new(path: Path, *, directory: bool) -> int:
    """Create the lock of a new temporary item at ``path`` (the file itself, or a folder and its
    ``.lock``) and hold it; returns the locked fd. Raises FileNotFoundError when a cleaner
    removed the item before it was locked (the caller picks a new name)."""
    if directory:
        path.mkdir()
        lock = path / LOCK_FILE
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
    else:
        lock = path
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # waits out a cleaner that locked it in between, if any
    if not _same_file(fd, lock):  # that cleaner judged it dead and removed it
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "temporary item removed while being created", str(path))
    return fd


def _create_owned(parent: Path, name: str, *, directory: bool) -> tuple[Path, int]:
    """A new temporary item in ``parent`` for ``name``, locked: ``(path, lock fd)``."""
    while True:
        path = parent / _owned_name(name)
        try:
            return path, _lock_new(path, directory=directory)
        except FileNotFoundError:  # a cleaner took it in the instant before our lock: a new name
            if not parent.is_dir():
                raise


class TempDir:
    """A temporary folder owned by this process (see the module docstring), built beside where
    it will be published: ``TempDir(parent, name)`` -> ``parent/.tmp-<host>-<pid>-<token>-<name>``.

    :meth:`publish` renames it into place; :meth:`discard` deletes it. Until either, the
    process holds the folder's lock, so no cleaner removes it.
    """

    def __init__(self, parent: Path, name: str = "") -> None:
        self.path, self._fd = _create_owned(Path(parent), name, directory=True)

    def publish(self, dst: Path) -> None:
        """Rename the folder to ``dst`` (which must not exist), dropping the lock file first."""
        (self.path / LOCK_FILE).unlink()  # a cleaner now sees no lock: our pid is alive, it waits
        try:
            self.path.rename(dst)
        finally:
            self._release()

    def discard(self) -> None:
        """Delete the folder and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


@contextlib.contextmanager
def _dead_lock(item: Path) -> Iterator[bool]:
    """Yields whether ``item`` is a leftover of a dead writer, holding its lock while it is
    (so no second cleaner races on it)."""
    owned = _OWNED.match(item.name)
    lock = item / LOCK_FILE if item.is_dir() else item
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    except OSError:  # unreadable: not ours to judge
        yield False
        return
    if fd < 0:  # no lock to test: the instant after mkdir, mid-publish, or an older version's item
        same_host = owned is not None and owned.group("host") == _HOST
        yield not _pid_alive(int(owned.group("pid"))) if same_host else _old(item)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # a live writer holds it
            return
        yield _same_file(fd, lock) and (owned is not None or _old(item))
    finally:
        os.close(fd)


def _old(item: Path) -> bool:
    """Whether ``item`` is older than :data:`STALE_SECONDS`: what tells an unlocked item (an
    older version's, or one from another host) is dead."""
    try:
        return time.time() - item.lstat().st_mtime > STALE_SECONDS
    except FileNotFoundError:
        return False


def owner_is_dead(item: Path) -> bool:
    """Whether the temporary item ``item`` is a leftover of a writer that no longer runs."""
    with _dead_lock(item) as dead:
        return dead


def _temp_items(folder: Path, name: str | None) -> list[Path]:
    """Temporary items in ``folder`` (only those that were to become ``name``, when given)."""
    try:
        items = sorted(folder.glob(".tmp-*"))
    except FileNotFoundError:
        return []
    return [p for p in items if name is None or target_name(p) == name]


def dead_leftovers(folder: Path, name: str | None = None) -> list[Path]:
    """Leftovers of dead writers in ``folder`` (those that were to become ``name``, when given)."""
    return [p for p in _temp_items(folder, name) if owner_is_dead(p)]


def remove_dead_leftovers(folder: Path, name: str | None = None) -> list[Path]:
    """Delete the leftovers of dead writers in ``folder`` (see :func:`dead_leftovers`); items of
    live writers are left alone. Returns what was removed."""
    removed = []
    for item in _temp_items(folder, name):
        with _dead_lock(item) as dead:  # held while deleting: a second cleaner sees it live
            if dead:
                if item.is_dir() and not item.is_symlink():
                    shutil.rmtree(item, ignore_errors=True)
                else:
                    item.unlink(missing_ok=True)
                removed.append(item)
    if removed:
        fsync_dir(folder)
    return removed


def size_on_disk(item: Path) -> int:
    """Bytes of the files under ``item`` (or of the file itself)."""
    if item.is_file():
        return item.stat().st_size
    return sum(p.stat().st_size for p in item.rglob("*") if p.is_file() and not p.is_symlink())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    path = Path(path)
    tmp, fd = _create_owned(path.parent, path.name, directory=False)
    try:
        with open(fd, "wb", closefd=False) as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, *, sort_keys: bool = False) -> None:
    """Replace ``path`` with ``obj`` as indented JSON (two spaces, a final newline), atomically and
    durably (:func:`atomic_write_bytes`): the small JSON files people read, such as a checkpoint
    folder's marker or a snapshot's ``config.json``. (Store references and manifests are canonical
    JSON instead, see :mod:`.manifest`.)"""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n").encode())


@contextlib.contextmanager
def staging_folder(dst: Path) -> Iterator[Path]:
    """An empty folder to build ``dst`` in, inside a temporary folder beside ``dst`` that this
    process owns (``.tmp-<host>-<pid>-<token>-<dst name>``, see the module docstring) and that is
    deleted on leaving, published (:func:`publish_folder`) or not. Leftovers of killed earlier runs
    for the same destination are deleted first; a live run's are left alone."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(dst.parent, dst.name)
    owner = TempDir(dst.parent, dst.name)
    try:
        (owner.path / dst.name).mkdir()
        yield owner.path / dst.name
    finally:
        owner.discard()


def publish_folder(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move a finished folder built in :func:`staging_folder` to ``dst`` (replacing it only when
    ``overwrite``; :class:`~hf_dynaquant.errors.DynaQuantError` when it exists otherwise)."""
    if dst.exists():
        if not overwrite:
            raise DynaQuantError(f"{dst} already exists; choose another destination or pass overwrite=True")
        old = dst.with_name(f".old-{uuid.uuid4().hex[:8]}-{dst.name}")
        dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        tmp.rename(dst)
    fsync_dir(dst.parent)
