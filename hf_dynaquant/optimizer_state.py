"""Optimizer state in a checkpoint: compressed, lossless, or dropped.

Modes (``optimizer_state=``):

* ``"compress"``: Adam/AdamW moments become an update and a scale (:mod:`hf_dynaquant.core.moments`),
  SGD momentum is quantized like a weight; both go through the DynaQuant codec (and its delta
  encoder) under :class:`MomentQuant`. Each tensor's fidelity is checked at every checkpoint
  (cosine similarity and relative error of the decoded Adam update, or of the decoded momentum,
  against the original); a tensor that fails at every bin count is stored losslessly. Anything
  the module does not recognise (other optimizers' state, step counters, small tensors) is
  lossless too.
* ``"lossless"``: the state dict as it is (lossless codec, XOR delta against the previous
  checkpoint where that pays).
* ``"drop"``: nothing stored. A restore then has no optimizer state and says so loudly.

The transformed tree marks each compressed entry (``"dq_moments": "adam-v1"`` or
``"sgd-v1"``) so :func:`decode_optimizer_state` inverts it with no other information.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .core.moments import adam_to_update_scale, fidelity, scale_plan, update_scale_to_adam
from .core.quantizer import QuantConfig, TensorPlan, dequantize, plan_quantization, quantize
from .errors import FormatError
from .store.tree import flatten_tree

__all__ = ["OPTIMIZER_MODES", "MomentQuant", "OptimizerEncoding", "encode_optimizer_state", "decode_optimizer_state"]

OPTIMIZER_MODES = ("compress", "lossless", "drop")
ADAM, SGD = "adam-v1", "sgd-v1"
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


@dataclass(frozen=True)
class MomentQuant:
    """How optimizer moments are quantized in mode ``"compress"``.

    Args:
        bins: bin counts tried in order for an Adam update or an SGD momentum until the
            fidelity check passes (then the tensor is stored losslessly).
        prune: fraction of each update's smallest values set to zero.
        scale_step: step of the log grid of ``log(sqrt(v) + eps)``; 0.5 bounds the relative
            error of ``sqrt(v) + eps`` by ``exp(0.25) - 1 = 28%`` (14% RMS): a per-weight factor on
            the step size, of the order of v's own noise, and the grid that makes v's slow drift
            delta-code to under one bit per value.
        min_cosine: the decoded update's cosine similarity to the original must reach this.
        max_rel_error: and its relative L2 error stay within this.
        min_numel: smaller tensors (biases, norms) stay lossless: they cost little.

    The defaults accept a coarse update (6 bins when they keep cosine 0.9) because an error in
    Adam's first moment fades at rate ``beta1`` per step after a restore (a 45% error is under 5%
    twenty steps later); ``benchmarks/bench_trainer.py`` measures the end-to-end effect over a
    training run with ten restores, and the bit budget (about 2.2 bits per update, 0.9 per
    scale on deltas) in ``benchmarks/RESULTS.md``.
    """

    bins: tuple[int, ...] = (6, 8, 16, 32)
    prune: float = 0.0
    scale_step: float = 0.5
    min_cosine: float = 0.9
    max_rel_error: float = 0.45
    min_numel: int = 256

    def __post_init__(self) -> None:
        if not self.bins or any(not 2 <= b <= 254 for b in self.bins):
            raise ValueError(f"bins must be a non-empty sequence of counts in [2, 254], got {self.bins}")
        if not -1 <= self.min_cosine <= 1:
            raise ValueError(f"min_cosine must be in [-1, 1], got {self.min_cosine}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class OptimizerEncoding:
    """A state dict ready for the store: the (transformed) tree, the plans of its quantized
    tensors keyed by their tree key, and a fidelity report for the checkpoint's metadata."""

    tree: Any
    plans: dict[str, TensorPlan]
    report: dict[str, Any]


def _group_eps(state_dict: Mapping[str, Any]) -> dict[Any, float | None]:
    out: dict[Any, float | None] = {}
    for group in state_dict.get("param_groups", []):
        for pid in group.get("params", []):
            out[pid] = group.get("eps")
    return out


def encode_optimizer_state(
    state_dict: Mapping[str, Any], mode: str = "compress", settings: MomentQuant | None = None
) -> OptimizerEncoding | None:
    """Prepare an optimizer ``state_dict`` for storage in ``mode`` (``None`` for ``"drop"``)."""
    if mode not in OPTIMIZER_MODES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_MODES}, got {mode!r}")
    if mode == "drop":
        return None
    if mode == "lossless":
        return OptimizerEncoding(dict(state_dict), {}, {"mode": "lossless"})
    settings = settings or MomentQuant()
    eps_of = _group_eps(state_dict)
    new_state: dict[Any, Any] = {}
    candidates: dict[Any, tuple[str, torch.Tensor, torch.Tensor | None]] = {}  # pid -> (kind, target, scale)
    for pid, entry in state_dict.get("state", {}).items():
        new_state[pid] = entry
        if not isinstance(entry, Mapping):
            continue
        m, v, buf = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("momentum_buffer")
        if (
            isinstance(m, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and m.is_floating_point()
            and m.shape == v.shape
            and m.numel() >= settings.min_numel
            and eps_of.get(pid) is not None
            and set(entry) <= {"step", "exp_avg", "exp_avg_sq"}
        ):
            u, s = adam_to_update_scale(m, v, eps_of[pid])
            candidates[pid] = (ADAM, u, s)
        elif (
            isinstance(buf, torch.Tensor)
            and buf.is_floating_point()
            and buf.numel() >= settings.min_numel
            and set(entry) == {"momentum_buffer"}
        ):
            candidates[pid] = (SGD, buf.detach().to("cpu", torch.float32).reshape(-1), None)

    chosen: dict[Any, tuple[TensorPlan, int]] = {}
    pending = dict(candidates)
    for bins in settings.bins:
        if not pending:
            break
        config = QuantConfig(
            bins=bins, prune=settings.prune, protect=0.0, min_numel=settings.min_numel, embedding_bins=bins
        )
        targets = {str(pid): c[1].reshape(-1, 1) for pid, c in pending.items()}
        plan = plan_quantization(targets, config, types={n: "moment" for n in targets})
        for pid in list(pending):
            tp = plan.tensors[str(pid)]
            target = pending[pid][1].reshape(-1)
            codes, kept = quantize(target, tp)
            decoded = torch.from_numpy(dequantize(codes, tp.centres, kept))
            cos, rel = fidelity(target, decoded)
            if cos >= settings.min_cosine and rel <= settings.max_rel_error:
                chosen[pid] = (tp, bins)
                del pending[pid]

    report: dict[str, Any] = {"mode": "compress", "settings": settings.to_dict(), "lossless": [], "bins": {}}
    plan_by_tensor: dict[int, TensorPlan] = {}
    for pid, (kind, target, scale) in candidates.items():
        if pid not in chosen:
            report["lossless"].append(pid)  # failed every bin count: kept as it is
            continue
        tp, bins = chosen[pid]
        report["bins"][str(pid)] = bins
        original = state_dict["state"][pid]
        if kind == ADAM:
            u = target.reshape(original["exp_avg"].shape)
            s = scale.reshape(u.shape)
            new_state[pid] = {
                "step": original["step"],
                "dq_moments": ADAM,
                "dq_dtype": str(original["exp_avg"].dtype),
                "dq_update": u,
                "dq_scale": s,
            }
            plan_by_tensor[id(u)] = tp
            plan_by_tensor[id(s)] = scale_plan(s, eps_of[pid], settings.scale_step)
        else:
            buf = target.reshape(original["momentum_buffer"].shape)
            new_state[pid] = {"dq_moments": SGD, "dq_dtype": str(original["momentum_buffer"].dtype), "dq_momentum": buf}
            plan_by_tensor[id(buf)] = tp
    tree = {**state_dict, "state": new_state}
    _, tensors = flatten_tree(tree)
    plans = {key: plan_by_tensor[id(t)] for key, t in tensors.items() if id(t) in plan_by_tensor}
    report["quantized"] = len(chosen)
    return OptimizerEncoding(tree, plans, report)


def decode_optimizer_state(tree: Mapping[str, Any], *, where: str = "optimizer state") -> dict[str, Any]:
    """The optimizer ``state_dict`` back from a stored tree (any mode but ``"drop"``)."""
    eps_of = _group_eps(tree)
    state: dict[Any, Any] = {}
    for pid, entry in tree.get("state", {}).items():
        kind = entry.get("dq_moments") if isinstance(entry, Mapping) else None
        if kind is None:
            state[pid] = entry
            continue
        dtype = _DTYPES.get(entry.get("dq_dtype", ""))
        if dtype is None:
            raise FormatError(f"{where}: parameter {pid} has an unknown moment dtype {entry.get('dq_dtype')!r}")
        if kind == ADAM:
            if eps_of.get(pid) is None:
                raise FormatError(f"{where}: parameter {pid} has Adam moments but its param group has no eps")
            m, v = update_scale_to_adam(entry["dq_update"], entry["dq_scale"], eps_of[pid], dtype)
            state[pid] = {"step": entry["step"], "exp_avg": m, "exp_avg_sq": v}
        elif kind == SGD:
            state[pid] = {"momentum_buffer": entry["dq_momentum"].to(dtype)}
        else:
            raise FormatError(f"{where}: parameter {pid} uses moment encoding {kind!r}, unknown to this version")
    return {**tree, "state": state}
