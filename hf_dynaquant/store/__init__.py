"""The on-disk container: manifest, payload, checksums, chains, references, atomic writes."""

from .store import CheckpointStore, EntryInfo, EntryReader
from .tree import flatten_tree, unflatten_tree

__all__ = ["CheckpointStore", "EntryInfo", "EntryReader", "flatten_tree", "unflatten_tree"]
