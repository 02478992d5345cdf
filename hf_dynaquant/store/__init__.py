"""The on-disk container: manifest, payload, checksums, chains, references, atomic writes."""

from .store import CheckpointStore, EntryInfo, EntryReader, set_pretrained_resolver
from .tree import flatten_tree, unflatten_tree

__all__ = ["CheckpointStore", "EntryInfo", "EntryReader", "flatten_tree", "set_pretrained_resolver", "unflatten_tree"]
