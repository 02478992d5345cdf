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

import numpy as np
import torch

from ..errors import UnsupportedTensorError

__all__ = ["DeferredTensor", "flatten_tree", "unflatten_tree"]


@dataclass(frozen=True, eq=False)
class DeferredTensor:
    """A tree leaf made only when the store encodes it, and dropped once encoded: a tree can
    then hold tensors derived from others (Adam's update and scale, from the moments) without
    all of them in memory at once. ``make()`` returns a tensor of ``shape`` and ``dtype`` whose
    memory no other leaf holds (a new tensor, or a view of one the tree does not store, as Adam's
    ``v`` is for its scale): the store does not look for tied tensors among deferred leaves.

    The store weighs it against its encoding pool's memory budget by its declared shape and
    dtype, and makes it only as the pool takes it. Made as the store's list of tensors reached
    it, a tensor too heavy to go in beside those encoding waited made: a pure-bfloat16 124M
    GPT-2's embedding's scale (a float32 copy of ``v``, 0.21x the checkpoint) beside its update,
    and its keyframes peaked at 0.74-1.05x the checkpoint."""

    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]
    dtype: torch.dtype = torch.float32
    # float32 only: the same values made a part at a time, ``fill(start, stop, out)`` writing the
    # flat values ``start:stop`` into ``out``; a codec that reads parts (DynaQuant's partition,
    # :class:`~hf_dynaquant.core.dtypes.ValuesInParts`) is given them so, and the tensor is never
    # made whole. None: ``make`` alone
    fill: Callable[[int, int, np.ndarray], None] | None = None

    def __post_init__(self) -> None:
        if self.fill is not None and self.dtype != torch.float32:
            raise ValueError(f"a deferred tensor made in parts is float32, not {self.dtype}")

    def numel(self) -> int:
        return math.prod(self.shape)


def flatten_tree(tree: Any, where: str = "tree") -> tuple[Any, dict[str, torch.Tensor | DeferredTensor]]:
    """Split ``tree`` into a JSON-serialisable skeleton and ``{key: tensor}`` (deferred leaves as they are)."""
    tensors: dict[str, torch.Tensor | DeferredTensor] = {}
    return _encode(tree, "", tensors, where), tensors


# The recursions below are module-level functions, not closures: a nested function that calls
# itself is a reference cycle (function -> closure cell -> function) holding everything else it
# closes over, here a whole optimizer state's tensors, until the cyclic garbage collector happens
# to run: measured, 0.66x of a checkpoint kept between checkpoints.
def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor | DeferredTensor], where: str) -> Any:
    """``obj``'s skeleton, its tensors added to ``tensors`` (see :func:`flatten_tree`)."""
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
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors, where) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors, where) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors, where) for k, v in obj.items()}
        return {
            "__dict__": [
                [_encode(k, f"{path}/key{i}", tensors, where), _encode(v, f"{path}/{k}", tensors, where)]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    raise UnsupportedTensorError(
        f"{where}: value of type {type(obj).__name__} at {path or '/'} cannot be stored without pickle; "
        "store it as bytes in 'extras' or convert it to tensors, numbers and strings"
    )


def unflatten_tree(skeleton: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild the tree; ``tensor(key)`` supplies each tensor."""
    if isinstance(skeleton, list):
        return [unflatten_tree(v, tensor) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensor(skeleton["__tensor__"])
        if "__float__" in skeleton:
            return float(skeleton["__float__"])
        if "__tuple__" in skeleton:
            return tuple(unflatten_tree(v, tensor) for v in skeleton["__tuple__"])
        if "__dict__" in skeleton:
            return {_hashable(unflatten_tree(k, tensor)): unflatten_tree(v, tensor) for k, v in skeleton["__dict__"]}
        return {k: unflatten_tree(v, tensor) for k, v in skeleton.items()}
    return skeleton


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
