"""Plain-PyTorch checkpoint compression with DynaQuant (the paper's Listing 1).

>>> compressor = Compressor(model, "ckpts", QuantConfig(bins=16, prune=0.2), checkpoint_every=500)
>>> for step in range(1, steps + 1):                                  # doctest: +SKIP
...     loss = model(batch).loss
...     loss.backward()
...     compressor.on_backward_pass_end()     # record gradients for sensitivity (in the window)
...     optimizer.step()
...     compressor.before_gradient_flush()    # finish the gradient copies before they are zeroed
...     optimizer.zero_grad()
...     if step % 500 == 0:
...         compressor.compress(step)
>>> compressor.restore(step, model)                                   # doctest: +SKIP

The configuration is given explicitly here (the search that adapts it comes separately).
Gradients are recorded only during the ``ema_steps`` optimizer steps before each scheduled
checkpoint (with ``checkpoint_every``), or always when the schedule is unknown.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .codecs.base import Codec
from .codecs.dynaquant import DynaQuantCodec
from .core.quantizer import QuantConfig, QuantPlan, layer_types, plan_quantization
from .core.ranking import GradientEMA
from .search import ConfigurationSearch, QualityMetric, SearchResult, SearchSpace, mean_loss
from .store import CheckpointStore

__all__ = ["Compressor", "compress_state_dict", "quantized_codecs"]

MODEL = "model"


def quantized_codecs(
    plan: QuantPlan,
    section: str = MODEL,
    delta_coding: str = "regroup",
    key: Callable[[str, str], str] | None = None,
) -> Callable[[str, str], Codec | str]:
    """A ``codecs=`` function for :meth:`CheckpointStore.write`: the plan's tensors through
    ``dynaquant``, everything else ``lossless``. A tensor's plan is ``plan.tensors[name]`` for
    tensors of ``section``, or ``plan.tensors[key(section, name)]`` when ``key`` is given."""

    def choose(sec: str, name: str) -> Codec | str:
        planned = key(sec, name) if key is not None else (name if sec == section else None)
        if planned in plan.tensors:
            return DynaQuantCodec(plan.tensors[planned], delta_coding)
        return "lossless"

    return choose


def compress_state_dict(
    store: CheckpointStore,
    state: Mapping[str, torch.Tensor],
    config: QuantConfig,
    *,
    types: Mapping[str, str] | None = None,
    sensitivity: Mapping[str, torch.Tensor] | None = None,
    quantize_only: set[str] | None = None,
    base: str | None = None,
    ref: str | None = None,
    trees: Mapping[str, Any] | None = None,
    extras: Mapping[str, bytes] | None = None,
    metadata: Mapping[str, Any] | None = None,
    delta_coding: str = "regroup",
    progress: bool = False,
    base_states: Mapping[tuple[str, str], Any] | None = None,
    keep_states: dict[tuple[str, str], Any] | None = None,
) -> str:
    """Quantize a state dict with ``config`` and write it to ``store``; returns the entry id.
    (``base_states`` / ``keep_states``: see :meth:`CheckpointStore.write`.)"""
    selected = {n: t for n, t in state.items() if quantize_only is None or n in quantize_only}
    plan = plan_quantization(selected, config, types=types, sensitivity=sensitivity)
    meta = {"quant_config": config.to_dict(), "quantized_tensors": len(plan.tensors), **dict(metadata or {})}
    return store.write(
        {MODEL: state},
        trees=trees,
        extras=extras,
        metadata=meta,
        codecs=quantized_codecs(plan, MODEL, delta_coding),
        base=base,
        ref=ref,
        progress=progress,
        base_states=base_states,
        keep_states=keep_states,
    )


class Compressor:
    """DynaQuant checkpoints of one model into a :class:`CheckpointStore`.

    Args:
        model: the model being trained.
        store: a store or its directory.
        config: the quantization configuration (bins, prune, protect, metric, ...).
        optimizer: saved (lossless) with each checkpoint and restored by :meth:`restore`.
        checkpoint_every: the checkpoint interval in optimizer steps, if regular; gradients are
            then recorded only in the ``ema_steps`` steps before each checkpoint.
        ema_steps: length of that window (the paper's N = 50).
        ema_beta: EMA weight of the newest gradient (0.9).
        keyframe_every: every this many checkpoints is self-contained, which bounds the chain a
            restore replays; the others are deltas on the previous checkpoint.
        delta_coding: ``regroup`` (the paper's), ``rle`` or ``entropy`` (for comparisons).
        threshold: with it, the configuration is searched at every checkpoint (``config`` then
            only sets the fixed knobs): the most compressive one whose relative degradation of
            ``metric`` stays within ``threshold``.
        metric: a :class:`~hf_dynaquant.search.QualityMetric`, or a callable ``model -> float``
            (lower is better unless ``higher_is_better``); default: mean loss on ``eval_data``.
        eval_data: evaluation batches (a DataLoader or a list) for the default metric.
        search_space: the configuration cube (Table 7 by default).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        store: CheckpointStore | str | Path,
        config: QuantConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        checkpoint_every: int | None = None,
        ema_steps: int = 50,
        ema_beta: float = 0.9,
        keyframe_every: int = 10,
        delta_coding: str = "regroup",
        threshold: float | None = None,
        metric: QualityMetric | Callable[[torch.nn.Module], float] | None = None,
        higher_is_better: bool = False,
        eval_data: Iterable[Any] | None = None,
        search_space: SearchSpace | None = None,
    ) -> None:
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be at least 1, got {keyframe_every}")
        self.search: ConfigurationSearch | None = None
        if threshold is not None:
            if metric is None:
                if eval_data is None:
                    raise ValueError("a threshold needs a metric or eval_data (batches for the default mean loss)")
                metric = mean_loss(eval_data)
            elif not isinstance(metric, QualityMetric):
                metric = QualityMetric(metric, higher_is_better=higher_is_better)
            self.search = ConfigurationSearch(metric, threshold, space=search_space, base=config)
        self.last_search: SearchResult | None = None
        self.model, self.optimizer = model, optimizer
        self.store = store if isinstance(store, CheckpointStore) else CheckpointStore(store)
        self.config = config or QuantConfig()
        self.checkpoint_every, self.ema_steps = checkpoint_every, ema_steps
        self.keyframe_every, self.delta_coding = keyframe_every, delta_coding
        self.ema = GradientEMA(model.named_parameters(), beta=ema_beta)
        self.step = 0  # optimizer steps seen (counted in before_gradient_flush)
        self.saves = 0
        self.last_entry: str | None = None
        self._states: dict[tuple[str, str], Any] = {}  # codes of the last checkpoint, for the next delta

    def _collecting(self) -> bool:
        if not self.checkpoint_every:
            return True
        to_next = -(self.step + 1) % self.checkpoint_every
        return to_next < self.ema_steps

    def on_backward_pass_end(self) -> None:
        """Call after ``loss.backward()``: starts copying gradients off the accelerator."""
        if self._collecting():
            self.ema.start()

    def before_gradient_flush(self) -> None:
        """Call before ``optimizer.zero_grad()``: completes this step's gradient copies."""
        self.ema.finish()
        self.step += 1

    def _sensitivity(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Sensitivity of every state entry that is a parameter (tied names included)."""
        by_ptr = {p.data_ptr(): n for n, p in self.model.named_parameters()}
        out = {}
        for name, tensor in state.items():
            pname = by_ptr.get(tensor.data_ptr())
            if pname is not None and self.ema.get(pname) is not None:
                out[name] = self.ema.sensitivity(pname, tensor)
        if not out and self.config.metric != "sensitivity":  # (with it, the planner warns)
            warnings.warn(
                "no gradients were recorded before this checkpoint: sensitivity falls back to magnitude "
                "(call on_backward_pass_end() after backward)",
                stacklevel=3,
            )
        return out or None

    def compress(
        self, step: int, *, extras: Mapping[str, bytes] | None = None, metadata: Mapping[str, Any] | None = None
    ) -> str:
        """Write checkpoint ``step`` (reference ``step-<step>``); returns the entry id."""
        state = self.model.state_dict()
        params = {p.data_ptr() for p in self.model.parameters()}
        quantizable = {n for n, t in state.items() if t.data_ptr() in params}
        base = None if self.saves % self.keyframe_every == 0 else self.last_entry
        types, sensitivity = layer_types(self.model), self._sensitivity(state)
        meta: dict[str, Any] = {"step": step, **dict(metadata or {})}
        trees = {"optimizer": self.optimizer.state_dict()} if self.optimizer is not None else None
        if self.search is None:
            plan: QuantPlan | None = plan_quantization(
                {n: state[n] for n in quantizable}, self.config, types=types, sensitivity=sensitivity
            )
            meta["quant_config"] = self.config.to_dict()
        else:
            # the originals the search restores after each candidate: the checkpoint's CPU snapshot
            snapshot = {n: state[n].detach().to("cpu", copy=True) for n in quantizable}
            result = self.last_search = self.search.search(self.model, snapshot, types=types, sensitivity=sensitivity)
            meta["search"] = result.to_dict()
            if result.config is not None:
                meta["quant_config"] = result.config.to_dict()
            plan = result.plan
        states: dict[tuple[str, str], Any] = {}
        entry = self.store.write(
            {MODEL: state},
            trees=trees,
            extras=extras,
            base=base,
            ref=f"step-{step}",
            metadata=meta,
            codecs=quantized_codecs(plan, MODEL, self.delta_coding) if plan is not None else "lossless",
            base_states=self._states,
            keep_states=states,
        )
        self._states = states
        self.ema.reset()
        self.saves += 1
        self.last_entry = entry
        return entry

    def restore(
        self,
        step_or_ref: int | str,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into ``model`` (default: this compressor's) and, if it holds one,
        the optimizer; returns the checkpoint's metadata."""
        ref = f"step-{step_or_ref}" if isinstance(step_or_ref, int) else step_or_ref
        model = model or self.model
        optimizer = optimizer or self.optimizer
        with self.store.open(ref) as entry:
            model.load_state_dict(entry.load_section(MODEL))
            if optimizer is not None and "optimizer" in entry.trees:
                optimizer.load_state_dict(entry.tree("optimizer"))
            return dict(entry.metadata)
