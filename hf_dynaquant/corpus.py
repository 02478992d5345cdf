"""An offline English corpus for demos, examples and benchmarks: the standard library's own
docstrings (about 1.5 MB of text, always present, never downloaded), with a character-level
tokenizer small enough for tiny language models.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import warnings
from functools import lru_cache
from typing import Any

import torch

__all__ = ["docstring_corpus", "CharTokenizer", "lm_batches", "docstring_lm_datasets"]

_SKIP = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "venv", "antigravity", "this", "__")


@lru_cache(maxsize=1)
def docstring_corpus() -> str:
    """Docstrings of the standard library's modules, classes and functions, in a stable order."""
    seen, parts = set(), []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    names += sorted(n for n in sys.builtin_module_names if n in sys.stdlib_module_names)
    for name in names:
        if name.startswith(_SKIP):
            continue
        # importing a module and reading its attributes may warn (deprecated modules and aliases
        # such as typing.io): they are read, not used, so the user is not told about them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # some stdlib modules need platform features  # noqa: BLE001
                continue
            objects = [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]
            objects += [
                getattr(c, a, None)
                for c in objects
                if inspect.isclass(c)
                for a in sorted(vars(c))
                if not a.startswith("_")
            ]
            docs = [inspect.getdoc(obj) if obj is not None else None for obj in objects]
        for doc in docs:
            if doc and len(doc) > 40 and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)


class CharTokenizer:
    """Characters to ids over a fixed printable alphabet (unknown characters map to id 0)."""

    def __init__(self) -> None:
        alphabet = "\n" + "".join(chr(c) for c in range(32, 127))
        self.vocab = ["<unk>"] + list(alphabet)
        self._ids = {ch: i for i, ch in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids.get(ch, 0) for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def lm_batches(ids: torch.Tensor, block: int, batch: int, *, seed: int = 0) -> torch.Tensor:
    """Shuffled non-overlapping blocks of ``block`` tokens, as ``(n_batches, batch, block)``."""
    n = ids.numel() // block
    blocks = ids[: n * block].view(n, block)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    usable = n // batch * batch
    return blocks[order[:usable]].view(-1, batch, block)


def docstring_lm_datasets(block: int = 64, eval_blocks: int = 64, max_blocks: int | None = None) -> tuple[Any, Any]:
    """``(train, eval)`` ``datasets.Dataset`` of character blocks of the docstring corpus, with
    ``input_ids`` and ``labels`` (a causal LM shifts them itself), for Trainer runs. The last
    ``eval_blocks`` blocks are held out; ``max_blocks`` caps the training set."""
    from datasets import Dataset

    ids = CharTokenizer().encode(docstring_corpus())
    n = ids.numel() // block
    blocks = ids[: n * block].view(n, block)
    train, held = blocks[: n - eval_blocks], blocks[n - eval_blocks :]
    if max_blocks is not None:
        train = train[:max_blocks]

    def as_dataset(rows: torch.Tensor) -> Any:
        data = rows.tolist()
        return Dataset.from_dict({"input_ids": data, "labels": data}).with_format("torch")

    return as_dataset(train), as_dataset(held)
