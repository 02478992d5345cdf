"""Nested Python state (an optimizer's ``state_dict``, say) as JSON plus named tensors.

Optimizer state is a tree of dicts with integer keys, lists, tuples, floats and tensors. JSON
holds the tree, the tensors go into the payload like model weights, so the whole thing round
trips without pickle. The encoding (documented in FORMAT.md):

* ``str``, ``bool``, ``None``, finite ``int``/``float``: themselves;
* a non-finite float: ``{"__float__": "nan" | "inf" | "-inf"}``;
* a tensor: ``{"__tensor__": "<key>"}`` where ``<key>`` names it in the tree's tensor section
  (a :class:`DeferredTensor` too: the store computes it when it encodes it);
* a tuple: ``{"__tuple__": [...]}``; a list: a JSON array;
* a dict whose keys are all strings and none starts with ``__``: a JSON object; any other dict:
  ``{"__dict__": [[key, value], ...]}`` with keys encoded by the same rules.

Anything else (arbitrary objects) is refused: we never fall back to pickle.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedTensorError

__all__ = ["DeferredTensor", "flatten_tree", "unflatten_tree"]


@dataclass(frozen=True, eq=False)
class DeferredTensor:
    """A tree leaf made only when the store encodes it, and dropped once encoded: a tree can
    then hold tensors derived from others (Adam's update and scale, from the moments) without
    all of them in memory at once. ``make()`` returns a tensor of ``shape`` whose memory no other
    leaf holds (a new tensor, or a view of one the tree does not store, as Adam's ``v`` is
    for its scale): the store does not look for tied tensors among deferred leaves."""

    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)


def flatten_tree(tree: Any, where: str = "tree") -> tuple[Any, dict[str, torch.Tensor | DeferredTensor]]:
    """Split ``tree`` into a JSON-serialisable skeleton and ``{key: tensor}`` (deferred leaves as they are)."""
    tensors: dict[str, torch.Tensor | DeferredTensor] = {}

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, (torch.Tensor, DeferredTensor)):
            key = path if path not in tensors else f"{path}#{len(tensors)}"
            tensors[key] = obj
            return {"__tensor__": key}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, numbers.Integral):
            return int(obj)
        if isinstance(obj, numbers.Real):
            value = float(obj)
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(obj, tuple):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: enc(v, f"{path}/{k}") for k, v in obj.items()}
            return {
                "__dict__": [[enc(k, f"{path}/key{i}"), enc(v, f"{path}/{k}")] for i, (k, v) in enumerate(obj.items())]
            }
        raise UnsupportedTensorError(
            f"{where}: value of type {type(obj).__name__} at {path or '/'} cannot be stored without pickle; "
            "store it as bytes in 'extras' or convert it to tensors, numbers and strings"
        )

    return enc(tree, ""), tensors


def unflatten_tree(skeleton: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild the tree; ``tensor(key)`` supplies each tensor."""

    def dec(obj: Any) -> Any:
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if isinstance(obj, dict):
            if "__tensor__" in obj:
                return tensor(obj["__tensor__"])
            if "__float__" in obj:
                return float(obj["__float__"])
            if "__tuple__" in obj:
                return tuple(dec(v) for v in obj["__tuple__"])
            if "__dict__" in obj:
                return {_hashable(dec(k)): dec(v) for k, v in obj["__dict__"]}
            return {k: dec(v) for k, v in obj.items()}
        return obj

    return dec(skeleton)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
