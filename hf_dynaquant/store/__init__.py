"""The on-disk container: manifest, payload, checksums, chains, references, atomic writes."""

from .store import CheckpointStore, EntryInfo, EntryReader, set_pretrained_resolver
from .tree import flatten_tree, unflatten_tree

__all__ = [
    "STORE_DIR",
    "CheckpointStore",
    "EntryInfo",
    "EntryReader",
    "flatten_tree",
    "set_pretrained_resolver",
    "unflatten_tree",
]

# The name of the folder holding a store beside what it compresses: <output_dir>/dynaquant for a
# training run's checkpoints, <model folder>/dynaquant for a compressed model folder.
STORE_DIR = "dynaquant"
