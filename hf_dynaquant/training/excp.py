"""ExCP through the training path (``CheckpointSettings(codec="excp")``), for comparisons.

ExCP (:mod:`hf_dynaquant.codecs.peers.excp`) codes a checkpoint's weights *together with* Adam's
moments: the residual against the previous checkpoint as restored and the moments are pruned by
one joint rule, then K-means quantized. So it replaces both the weights' codec and the optimizer
state's coding. :func:`excp_checkpoint` turns a snapshot into what
:meth:`~hf_dynaquant.training.compressor.Compressor.write` stores: the optimizer ``state_dict``
with each Adam parameter's ``exp_avg`` and ``exp_avg_sq`` shrunk, and the codec of every tensor
(ExCP's for the weights' residuals and the shrunk moments; lossless for the rest, and for the
weights of a keyframe, which ExCP stores exactly). A restore needs nothing of its own: the
stored moments decode to ExCP's values and load like any optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..codecs.base import Codec
from ..codecs.peers.excp import ExCPCodec, excp_state
from ..pipeline import MODEL
from ..store.tree import flatten_tree
from .snapshot import Snapshot

__all__ = ["excp_checkpoint"]


def excp_checkpoint(
    snap: Snapshot, previous: Mapping[str, torch.Tensor] | None, optimizer_section: str, *, bits: int = 4
) -> tuple[dict[str, Any], Callable[[str, str], Codec | str], dict[str, Any]]:
    """``(optimizer tree, codec of each (section, tensor name), report)`` of an ExCP checkpoint of
    ``snap`` (whose ``optimizer`` and ``optimizer_params`` it needs). ``previous``: the previous
    checkpoint's restored weights by state name, or, for an anchor (``restore_depth``), the
    keyframe's (``None``: a keyframe, stored exactly); the write's ``base`` must then be that
    entry."""
    assert snap.optimizer is not None and snap.optimizer_params is not None
    by_param: dict[str, str] = {}  # parameter name -> its first state name (a tied weight's is stored)
    for name, param in snap.params.items():
        by_param.setdefault(param, name)
    state = snap.optimizer.get("state", {})
    adam: dict[int, str] = {}  # optimizer state id -> state name, for the parameters with Adam's moments
    for pid, entry in state.items():
        name = by_param.get(snap.optimizer_params.get(pid, ""))
        if name is None or not isinstance(entry, Mapping):
            continue
        m, v = entry.get("exp_avg"), entry.get("exp_avg_sq")
        if isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and m.shape == snap.state[name].shape:
            adam[pid] = name
    weights = {name: snap.state[name] for name in adam.values()}
    sections, choose = excp_state(
        weights,
        None if previous is None else {n: previous[n] for n in weights},
        {name: state[pid]["exp_avg"] for pid, name in adam.items()},
        {name: state[pid]["exp_avg_sq"] for pid, name in adam.items()},
        bits=bits,
    )
    shrunk = {
        pid: {**state[pid], "exp_avg": sections["exp_avg"][name], "exp_avg_sq": sections["exp_avg_sq"][name]}
        for pid, name in adam.items()
    }
    tree = {**snap.optimizer, "state": {pid: shrunk.get(pid, entry) for pid, entry in state.items()}}
    moments = {id(entry[k]) for entry in shrunk.values() for k in ("exp_avg", "exp_avg_sq")}
    coded = {key for key, t in flatten_tree(tree)[1].items() if id(t) in moments}  # the store's names

    def codec(section: str, name: str) -> Codec | str:
        if section == MODEL:
            return choose(MODEL, name)  # ExCP's residual codec, or lossless (a keyframe, no moments)
        if section == optimizer_section and name in coded:
            return ExCPCodec(bits)
        return "lossless"

    report = {"mode": "excp", "bits": bits, "parameters": len(adam), "keyframe": previous is None}
    return tree, codec, report
