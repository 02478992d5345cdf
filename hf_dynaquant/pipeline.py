"""The one pipeline from tensors to a store entry: plan → codecs → store.

Every path that writes DynaQuant entries ends here: training checkpoints
(:meth:`Compressor.write <hf_dynaquant.training.compressor.Compressor.write>`, and the sharded
compressor through it), plain state dicts (:func:`compress_state_dict`), model folders and Hub
snapshots (:func:`~hf_dynaquant.pretrained.folder.compress_folder`, which the CLI and
:func:`~hf_dynaquant.integrations.hub.compress_pretrained` call). What differs between them is
only how the plan is chosen (a fixed configuration, the training search, the calibration search);
how a plan becomes an entry, and what the entry records of it, is written once, here:

* the planned tensors go through the DynaQuant codec (a delta on the base entry's codes where the
  store writes a delta), every other tensor through the fallback codec (lossless by default);
* the entry's metadata records the configuration the plan was made with (``quant_config``) and
  how many tensors it quantizes (``quantized_tensors``).

A plan covering several sections names its tensors :func:`plan_key` ``(section, name)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .codecs.base import Codec
from .codecs.dynaquant import DEFAULT_DELTA_CODING, DynaQuantCodec
from .core.quantizer import QuantConfig, QuantPlan, plan_quantization
from .store import CheckpointStore

__all__ = ["MODEL", "plan_key", "for_section", "write_planned", "compress_state_dict"]

MODEL = "model"  # the section of a model's weights


def plan_key(section: str, name: str) -> str:
    """The name of tensor ``name`` of ``section`` in a plan covering several sections."""
    return f"{section}::{name}"


def for_section(plan: QuantPlan, section: str = MODEL) -> QuantPlan:
    """A plan of one section's tensors (named as in the section) renamed for :func:`write_planned`."""
    return QuantPlan(plan.config, {plan_key(section, n): tp for n, tp in plan.tensors.items()})


def write_planned(
    store: CheckpointStore,
    sections: Mapping[str, Mapping[str, torch.Tensor]],
    plan: QuantPlan | None,
    *,
    config: QuantConfig | None = None,
    delta_coding: str = DEFAULT_DELTA_CODING,
    fallback: Codec | str | Mapping[str, Codec | str] | Callable[[str, str], Codec | str] = "lossless",
    metadata: Mapping[str, Any] | None = None,
    **write: Any,
) -> str:
    """Write ``sections`` (section → tensor name → tensor; a lazy mapping is fine) as one entry
    of ``store``; returns the entry id.

    Args:
        plan: the tensors to quantize, named :func:`plan_key` ``(section, name)``; ``None``:
            none (everything through ``fallback``).
        config: the configuration recorded as the entry's ``quant_config`` (the one the plan
            was made with; ``None`` records none, e.g. when a search found nothing that passes).
        delta_coding: how the DynaQuant codec codes a delta on its base entry's codes.
        fallback: the codec of every tensor outside the plan, or ``{section: codec}`` (sections
            not named: lossless), or a function of ``(section, name)`` giving each one's.
        metadata: more metadata for the entry.
        write: the other options of :meth:`CheckpointStore.write <hf_dynaquant.store.CheckpointStore.write>`
            (``trees``, ``extras``, ``base``, ``ref``, ``progress``, ``base_states``, ``keep_states``,
            ``freed``).
    """
    meta = dict(metadata or {})
    if config is not None:
        meta["quant_config"] = config.to_dict()
    if plan is not None:
        meta["quantized_tensors"] = len(plan.tensors)
    return store.write(sections, codecs=_codecs(plan, delta_coding, fallback), metadata=meta, **write)


def _codecs(
    plan: QuantPlan | None,
    delta_coding: str,
    fallback: Codec | str | Mapping[str, Codec | str] | Callable[[str, str], Codec | str],
) -> Callable[[str, str], Codec | str]:
    """The ``codecs=`` function of :meth:`CheckpointStore.write`: a tensor's codec by its section and name."""
    tensors = plan.tensors if plan is not None else {}

    def choose(section: str, name: str) -> Codec | str:
        planned = tensors.get(plan_key(section, name))
        if planned is not None:
            return DynaQuantCodec(planned, delta_coding)
        if isinstance(fallback, Mapping):
            return fallback.get(section, "lossless")
        return fallback(section, name) if callable(fallback) else fallback

    return choose


def compress_state_dict(
    store: CheckpointStore,
    state: Mapping[str, torch.Tensor],
    config: QuantConfig,
    *,
    types: Mapping[str, str] | None = None,
    sensitivity: Mapping[str, torch.Tensor] | None = None,
    quantize_only: set[str] | None = None,
    delta_coding: str = DEFAULT_DELTA_CODING,
    **write: Any,
) -> str:
    """Quantize a state dict with the fixed configuration ``config`` and write it to ``store``
    (section ``model``); returns the entry id. ``quantize_only`` limits the quantized tensors
    (the others are stored losslessly); ``types``, ``sensitivity``: see
    :func:`~hf_dynaquant.core.quantizer.plan_quantization`; ``write``: see :func:`write_planned`."""
    selected = {n: t for n, t in state.items() if quantize_only is None or n in quantize_only}
    plan = plan_quantization(selected, config, types=types, sensitivity=sensitivity)
    return write_planned(store, {MODEL: state}, for_section(plan), config=config, delta_coding=delta_coding, **write)
