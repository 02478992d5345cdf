"""The entry manifest: its JSON schema version, canonical bytes, content id, validation.

A manifest is canonical JSON (sorted keys, no whitespace, UTF-8); the entry's content id is
the SHA-256 of those bytes, so an entry's id covers every blob checksum it lists and a chain's
base reference pins the exact base content. On disk it is one zstd frame of those bytes
(``manifest.json.zst``): per-tensor records (checksums, codebooks, stream sizes) make a
manifest as large as a small model's whole compressed delta, and they compress about 8x.
FORMAT.md is the specification.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import zstandard

from ..errors import CorruptCheckpointError, UnsupportedFormatVersionError

__all__ = [
    "FORMAT_VERSION",
    "ENTRY_FORMAT",
    "STORE_FORMAT",
    "MANIFEST",
    "LEGACY_MANIFEST",
    "canonical_json",
    "content_id",
    "manifest_file",
    "pack_manifest",
    "read_manifest_bytes",
    "parse_manifest",
    "check_store_marker",
    "store_marker",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json.zst"  # one zstd frame of the canonical JSON
LEGACY_MANIFEST = "manifest.json"  # the plain canonical JSON (stores written before manifests were compressed)
_MAX_MANIFEST_BYTES = 1 << 30
_SMALL_MANIFEST = 1 << 16  # canonical bytes up to which a manifest is packed at zstd level 19
ENTRY_FORMAT = "hf_dynaquant.entry"
STORE_FORMAT = "hf_dynaquant.store"


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, compact separators, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def content_id(manifest_bytes: bytes) -> str:
    """An entry's id: hex SHA-256 of its canonical manifest bytes."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def pack_manifest(data: bytes) -> bytes:
    """The on-disk bytes of canonical manifest bytes: zstd, level 19 up to
    :data:`_SMALL_MANIFEST` bytes (a toy model's manifest weighs in its checkpoint), level 15
    above. Level 19 takes about 1 us a byte: 0.3 s of a save's end at GPT-2's 124M parameters
    (a 320 KB manifest), where level 15 takes 0.03 s for 2 KB more of a 100 MB entry."""
    return zstandard.ZstdCompressor(level=19 if len(data) <= _SMALL_MANIFEST else 15).compress(data)


def manifest_file(entry_dir: Path) -> Path | None:
    """The manifest file of an entry directory (compressed, or a legacy plain one), or None."""
    for name in (MANIFEST, LEGACY_MANIFEST):
        if (entry_dir / name).is_file():
            return entry_dir / name
    return None


def read_manifest_bytes(path: Path) -> bytes:
    """The canonical JSON bytes of a manifest file (decompressed when it is ``.zst``)."""
    data = path.read_bytes()
    if path.name != MANIFEST:
        return data
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=_MAX_MANIFEST_BYTES)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{path}: manifest is not a valid zstd frame ({exc})") from None


def _check_version(doc: Any, kind: str, path: Path) -> None:
    if not isinstance(doc, dict) or doc.get("format") != kind:
        raise CorruptCheckpointError(f"{path}: not an {kind} document")
    if doc.get("format_version") != FORMAT_VERSION:
        raise UnsupportedFormatVersionError(str(path), doc.get("format_version"), FORMAT_VERSION)


def parse_manifest(data: bytes, path: Path, expected_id: str | None) -> dict[str, Any]:
    """Validate manifest bytes (id, JSON, format, version) and return the document."""
    if expected_id is not None and content_id(data) != expected_id:
        raise CorruptCheckpointError(
            f"{path}: manifest does not match its content id {expected_id[:16]}; it is corrupt"
        )
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest is not valid JSON ({exc})") from None
    _check_version(doc, ENTRY_FORMAT, path)
    for key in ("files", "sections", "trees", "extras", "metadata"):
        if key not in doc:
            raise CorruptCheckpointError(f"{path}: manifest lacks {key!r}")
    return doc


def _marker_checksum(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()[:16]


def store_marker() -> bytes:
    """The bytes of a new store's ``store.json``: format, version, and a checksum of both, so
    that a damaged version number is told apart from a newer one."""
    doc = {"format": STORE_FORMAT, "format_version": FORMAT_VERSION}
    return canonical_json({**doc, "checksum": _marker_checksum(doc)})


def check_store_marker(path: Path) -> None:
    """Validate a store's ``store.json``: damage raises :class:`CorruptCheckpointError`, a
    newer format (intact checksum) :class:`UnsupportedFormatVersionError`."""
    data = b""
    try:
        data = path.read_bytes()
        doc = json.loads(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: the store marker is damaged ({exc}); read {data[:200]!r}") from None
    if not isinstance(doc, dict) or doc.get("format") != STORE_FORMAT:
        raise CorruptCheckpointError(
            f"{path}: the store marker is damaged (not an {STORE_FORMAT} document); read {data[:200]!r}"
        )
    if "checksum" in doc:
        if doc["checksum"] != _marker_checksum(doc):
            raise CorruptCheckpointError(
                f"{path}: the store marker is damaged (its checksum does not match); read {data[:200]!r}"
            )
    elif set(doc) != {"format", "format_version"} or doc["format_version"] != FORMAT_VERSION:
        # markers without a checksum were written by format version 1 only, with these two keys
        raise CorruptCheckpointError(
            f"{path}: the store marker is damaged (format_version {doc.get('format_version')!r} in a marker "
            f"without a checksum, which only version {FORMAT_VERSION} wrote); read {data[:200]!r}"
        )
    _check_version(doc, STORE_FORMAT, path)
