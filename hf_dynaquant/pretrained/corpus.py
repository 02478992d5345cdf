"""An offline English corpus for demos, examples and benchmarks: the standard library's own
docstrings (about 1.5 MB of text, always present, never downloaded), with a character-level
tokenizer small enough for tiny language models.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
import warnings
from functools import lru_cache
from typing import Any

import torch

__all__ = [
    "docstring_corpus",
    "CharTokenizer",
    "lm_batches",
    "docstring_lm_datasets",
    "TOPICS",
    "docstring_topics",
    "package_descriptions",
]

_SKIP = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "venv", "antigravity", "this", "__")


def _module_docstrings(name: str) -> list[str | None]:
    """Docstrings of module ``name``, its public attributes and their classes' public members,
    in a stable (sorted) order; ``None`` where an object has none."""
    # importing a module and reading its attributes may warn (deprecated modules and aliases
    # such as typing.io): they are read, not used, so the user is not told about them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(name)
        objects = [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]
        objects += [
            getattr(c, a, None) for c in objects if inspect.isclass(c) for a in sorted(vars(c)) if not a.startswith("_")
        ]
        return [inspect.getdoc(obj) if obj is not None else None for obj in objects]


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
        try:
            docs = _module_docstrings(name)
        except Exception:  # some stdlib modules need platform features  # noqa: BLE001
            continue
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


#: The labels of :func:`docstring_topics`: six areas of the standard library, each the modules
#: whose docstrings give its sentences. The areas share much vocabulary (files are read over
#: sockets, numbers are parsed from text, ...), so telling them apart is a real task.
TOPICS: dict[str, tuple[str, ...]] = {
    "files": ("os", "shutil", "pathlib", "glob", "tempfile", "io", "zipfile", "tarfile", "stat", "filecmp"),
    "text": ("string", "re", "textwrap", "difflib", "unicodedata", "codecs", "locale", "gettext", "shlex", "fnmatch"),
    "network": (
        "socket", "http.client", "http.server", "urllib.request", "urllib.parse", "ftplib",
        "smtplib", "ssl", "imaplib", "email.message", "socketserver", "poplib",
    ),  # fmt: skip
    "concurrency": (
        "threading", "multiprocessing", "asyncio", "concurrent.futures", "queue", "subprocess",
        "signal", "sched", "selectors",
    ),  # fmt: skip
    "formats": (
        "json", "csv", "pickle", "xml.etree.ElementTree", "xml.dom.minidom", "configparser",
        "plistlib", "base64", "struct", "marshal", "html.parser", "tomllib",
    ),  # fmt: skip
    "numbers": (
        "math", "statistics", "decimal", "fractions", "random", "cmath", "numbers", "operator",
        "array", "bisect", "heapq",
    ),  # fmt: skip
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@lru_cache(maxsize=4)
def docstring_topics(splits: tuple[int, int, int] = (240, 40, 100), seed: int = 0) -> dict:
    """A labelled sentence-classification task built offline from the standard library: which
    area of :data:`TOPICS` a docstring sentence comes from (6 classes, balanced).

    Sentences are the docstrings' sentences of 30-200 characters and at least 5 words (white
    space collapsed); one found in two areas is dropped. Each area contributes ``splits`` =
    (train, validation, test) sentences, drawn with ``seed`` (the same on every machine running
    the same Python minor version, whose standard library it reads: modules a version lacks,
    such as ``tomllib`` before 3.11, are left out; each area has 460 or more on 3.11). Returns
    ``{"labels": [area names], "train" | "validation" | "test": {"text": [...], "label": [...]}}``,
    each split shuffled with ``seed``. The test split is for a final, held-out figure: tune on
    the validation split.
    """
    per_label = sum(splits)
    found: dict[str, set[str]] = {}
    for label, modules in TOPICS.items():
        present = [name for name in modules if importlib.util.find_spec(name) is not None]  # tomllib: 3.11+
        docs = [d for name in present for d in _module_docstrings(name) if d]
        found[label] = {s for d in docs for s in _SENTENCE_END.split(" ".join(d.split()))}
        found[label] = {s for s in found[label] if 30 <= len(s) <= 200 and len(s.split()) >= 5}
    shared = {s for a in found for b in found if a < b for s in found[a] & found[b]}
    rng = torch.Generator().manual_seed(seed)
    parts: dict[str, list[tuple[str, int]]] = {"train": [], "validation": [], "test": []}
    for index, label in enumerate(TOPICS):
        pool = sorted(found[label] - shared)
        if len(pool) < per_label:
            raise ValueError(f"area {label!r} has {len(pool)} sentences, fewer than the splits {splits} need")
        chosen = [pool[i] for i in torch.randperm(len(pool), generator=rng)[:per_label].tolist()]
        bounds = [0, splits[0], splits[0] + splits[1], sum(splits)]
        for split, lo, hi in zip(parts, bounds, bounds[1:]):
            parts[split] += [(text, index) for text in chosen[lo:hi]]
    result: dict[str, Any] = {"labels": list(TOPICS)}
    for split, rows in parts.items():
        order = torch.randperm(len(rows), generator=rng).tolist()
        result[split] = {"text": [rows[i][0] for i in order], "label": [rows[i][1] for i in order]}
    return result


def package_descriptions(n: int = 600, seed: int = 0) -> list[str]:
    """Up to ``n`` English sentences from the descriptions (``METADATA``) of the installed Python
    packages, in a seeded order: held-out text for a snapshot calibrated on the standard library's
    docstrings, which never reads them. Sentences of 30-200 characters and 5+ words, nine tenths
    letters and spaces (prose, not code or tables), code blocks dropped. Which sentences depends
    on the packages installed; hf_dynaquant's own description (its README, which changes with
    every edit of the project) is left out."""
    import random
    from importlib.metadata import distributions

    found: set[str] = set()
    for dist in distributions():
        if re.sub(r"[-_.]+", "_", (dist.metadata["Name"] or "").lower()) == "hf_dynaquant":
            continue  # our own README: it changes with every edit of this project
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        text = " ".join(re.sub(r"```.*?```", "", body or "", flags=re.S).split())
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            letters = sum(c.isalpha() or c == " " for c in sentence)
            if 30 <= len(sentence) <= 200 and len(sentence.split()) >= 5 and letters > 0.9 * len(sentence):
                found.add(sentence)
    chosen = sorted(found)
    random.Random(seed).shuffle(chosen)
    return chosen[:n]
