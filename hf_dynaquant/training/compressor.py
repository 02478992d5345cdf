"""Plain-PyTorch checkpoint compression with DynaQuant (the paper's Listing 1).

>>> compressor = Compressor(model, "ckpts", QuantConfig(bins=16, prune=0.2), checkpoint_every=500)
>>> for step in range(1, steps + 1):                                  # doctest: +SKIP
...     loss = model(batch).loss
...     loss.backward()
...     compressor.on_backward_pass_end()     # record gradients for sensitivity (in the window)
...     optimizer.step()
...     compressor.before_gradient_flush()    # finish any gradient copies before they are zeroed
...     optimizer.zero_grad()
...     if step % 500 == 0:
...         compressor.compress(step)
>>> compressor.restore(step, model)                                   # doctest: +SKIP

The configuration is given explicitly here (the search that adapts it comes separately).
Gradients are recorded only during the ``ema_steps`` optimizer steps before each scheduled
checkpoint (with ``checkpoint_every``), or always when the schedule is unknown.

Residual coding (``QuantConfig.residual``, or the search's ``SearchSpace.residuals``): the
compressor keeps the last checkpoint's *decoded* weights (what a restore will have, never the
exact previous weights: closed loop, so quantization errors do not add up along the chain) to
code ``"previous"`` residuals against, and the pre-trained weights (``pretrained=``) for
``"pretrained"`` residuals. A keyframe has no previous checkpoint (and an anchor, a delta coded on
the keyframe to bound the deltas a restore replays, ``restore_depth``, does not code against it):
it offers ``"none"`` and ``"pretrained"`` only; a fixed ``QuantConfig(residual="previous")`` falls
back to direct coding there (and ``"pretrained"`` without pre-trained weights likewise).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..codecs import get_codec
from ..codecs.dynaquant import DynaQuantCodec, KeptState, QuantState
from ..core.collectives import is_distributed
from ..core.dtypes import from_raw, storage_key
from ..core.memory import Computed, ReleaseFreed, has_room, release_freed, save_allowance
from ..core.quantizer import (
    QuantConfig,
    QuantPlan,
    coded_values,
    decoded_values,
    is_quantizable,
    layer_types,
    plan_quantization,
)
from ..core.ranking import GradientEMA
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidSettingError,
    MissingOptimizerStateError,
    UnsupportedSetupError,
)
from ..pipeline import MODEL, for_section, plan_key, write_planned
from ..search import ConfigurationSearch, Reference, SearchResult
from ..search.peers import PEER_CUBES, PeerSearch
from ..search.quality import device_of
from ..store import CheckpointStore, EntryReader
from .optimizer_state import (
    MomentQuant,
    Reductions,
    TensorKey,
    as_codes,
    decode_optimizer_state,
    encode_optimizer_state,
)
from .excp import excp_checkpoint
from .settings import CheckpointSettings
from .snapshot import (
    ModelSkeleton,
    Snapshot,
    cpu_copies,
    cpu_tree,
    device_copies,
    map_tree,
    raw_optimizer_bytes,
    raw_optimizer_size,
    unique_nbytes,
    unique_size,
)

__all__ = [
    "Compressor",
    "CheckpointReport",
    "Snapshot",
    "ModelSkeleton",
    "read_checkpoint",
    "load_weights",
    "read_optimizer_state",
]

OPTIMIZER = "optimizer"
logger = logging.getLogger("hf_dynaquant")


@dataclass
class CheckpointReport:
    """What writing one checkpoint did (for logs and benchmarks). Sizes are bytes."""

    step: int
    entry: str
    keyframe: bool
    weights_raw: int
    weights_stored: int
    optimizer_raw: int
    optimizer_stored: int
    other_stored: int
    seconds: float
    search: dict[str, Any] | None = None
    optimizer_state: dict[str, Any] | None = None
    anchor: bool = False  # a delta coded on its chain's keyframe (restore_depth), not on the last checkpoint
    stall_seconds: float = 0.0  # training stopped this long for the checkpoint (with a CheckpointManager)

    @property
    def raw(self) -> int:
        return self.weights_raw + self.optimizer_raw

    @property
    def stored(self) -> int:
        return self.weights_stored + self.optimizer_stored + self.other_stored


# Bytes of decoded weights handed to ``load_state_dict`` at once by :func:`load_weights`: each call
# walks the module tree (milliseconds), and this much is all a restore holds besides the model.
_LOAD_CHUNK = 64 << 20


def load_weights(model: torch.nn.Module, entry: EntryReader, where: str, *, progress: bool = False) -> None:
    """Load a stored checkpoint's weights into ``model``, streaming: tensors are decoded a few
    at a time, so a restore holds no second copy of the weights. A quantized float32 tensor
    whose parameter plain ``load_state_dict`` would copy into (:func:`_filled_in_place`) comes
    from the pool as its codes and is dequantized straight into the parameter, in this thread
    (a 124M model's weights otherwise took a fresh 0.5 GB, paged in, then a copy); the others are
    copied into the model in chunks of :data:`_LOAD_CHUNK` bytes. Raises
    :class:`~hf_dynaquant.errors.CheckpointError` naming ``where`` when the stored weights do not
    fit the model (a tied weight the entry stores once may be missing under its other names)."""
    targets = model.state_dict(keep_vars=True)
    expected = set(targets)
    in_place = {name: t for name, t in targets.items() if _filled_in_place(model, name, t)}
    loaded: set[str] = set()
    chunk: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        try:
            model.load_state_dict(chunk, strict=False)
        except RuntimeError as exc:  # a shape that does not fit
            raise CheckpointError(f"{where}: the stored weights do not fit the model: {exc}") from exc
        chunk.clear()

    filled: dict[int, Any] = {}  # id of a parameter written in place -> the codes written into it
    for name, tensor in entry.iter_section(MODEL, progress=progress, coded=in_place.__contains__):
        loaded.add(name)
        if name not in expected:
            continue
        if not isinstance(tensor, torch.Tensor):  # codes (a tied weight's alias comes as its target's)
            target = in_place.get(name)
            if target is not None and tuple(target.shape) == tuple(tensor.shape):
                if filled.get(id(target)) is not tensor:  # (tied: the same codes into the same parameter once)
                    try:
                        decoded_values(
                            tensor.codes, tensor.centres, tensor.protected, out=target.detach().view(-1).numpy()
                        )
                    except ValueError as exc:
                        raise CorruptCheckpointError(f"{where}: tensor {name!r}: {exc}") from None
                    torch.autograd.graph.increment_version(target)  # modified in place, as copy_ marks it
                    filled[id(target)] = tensor
                continue
            # a shape that does not fit (load_state_dict names it), or a tied weight's other name
            # that load_state_dict loads (its target's codes came)
            tensor = coded_values(tensor)
        chunk[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= _LOAD_CHUNK:
            flush()
            size = 0
    flush()
    missing = sorted(expected - loaded - _tied_names(model))
    unexpected = sorted(loaded - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the stored weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


def _filled_in_place(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether ``load_weights`` may write a stored tensor straight into the model's tensor
    ``name`` (of ``model.state_dict(keep_vars=True)``): a plain contiguous float32 tensor in host
    memory (not a DTensor or another subclass), loaded by ``torch.nn.Module``'s own
    ``_load_from_state_dict`` on its module and every module above it (a parent's runs on the
    entries of its children too), with no state-dict or load hook on any of them, so that
    ``load_state_dict`` would do nothing but copy the values in (not an inference tensor, which it
    refuses to write into). Written in place, a tensor whose codes turn out not to decode is left
    half written (the restore fails; tensors loaded before it stay loaded, as with
    ``load_state_dict``)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
        return False
    if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.is_inference():
        return False
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict or "load_state_dict" in vars(model):
        return False
    path = name.split(".")[:-1]
    module = model
    for depth in range(len(path) + 1):
        if depth:
            module = getattr(module, path[depth - 1], None)
            if not isinstance(module, torch.nn.Module):
                return False
        hooks = (
            module._load_state_dict_pre_hooks,
            module._load_state_dict_post_hooks,
            module._state_dict_hooks,
            getattr(module, "_state_dict_pre_hooks", {}),
        )
        if any(hooks) or type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict:
            return False
    return True


def _tied_names(model: torch.nn.Module) -> set[str]:
    """The names under which a parameter appears a second time (tied weights)."""
    seen: set[int] = set()
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied


def read_optimizer_state(entry: EntryReader, where: str) -> dict[str, Any] | None:
    """The optimizer state of a stored checkpoint (``None``: saved with ``optimizer_state="drop"``
    or without an optimizer; the metadata says which)."""
    if OPTIMIZER not in entry.trees:
        return None
    tree = entry.tree(OPTIMIZER, leaf=TensorKey)
    tensors = entry.iter_section(OPTIMIZER, coded=as_codes) if OPTIMIZER in entry.sections else iter(())
    return decode_optimizer_state(tree, tensors, lambda key: entry.tensor(OPTIMIZER, key), where=where)


def read_checkpoint(
    store: CheckpointStore, ref: str, *, progress: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, Any]]:
    """``(model state, optimizer state or None, metadata)`` of a stored checkpoint.

    The optimizer state is ``None`` only when the checkpoint was written with
    ``optimizer_state="drop"`` or without an optimizer (the metadata says which)."""
    with store.open(ref) as entry:
        model_state = entry.load_section(MODEL, progress=progress)
        meta = dict(entry.metadata)
        return model_state, read_optimizer_state(entry, f"optimizer state of {ref!r} in {store.path}"), meta


class Compressor:
    """DynaQuant checkpoints of one model into a :class:`CheckpointStore`.

    Args:
        model: the model being trained.
        store: a store or its directory (``None``: a process that only takes part in the search).
        config: the quantization configuration (bins, prune, protect, prune_by, ...); a shortcut
            for ``CheckpointSettings(config=...)``.
        optimizer: saved with each checkpoint (see ``optimizer_state``) and restored by
            :meth:`restore`.
        settings: a :class:`~hf_dynaquant.training.settings.CheckpointSettings` (every setting
            documented there: threshold and its metric or eval data, search space, optimizer
            state, keyframes, delta coding, pre-trained weights, gradient window).
        **shortcuts: instead of ``settings``, its fields as keyword arguments. Here ``threshold``
            defaults to ``None``: like the paper's Listing 1, the plain API stores every
            checkpoint with ``config`` unless it is given a threshold (and a metric or eval data)
            to search against.
    """

    #: whether :meth:`write` is a collective that every rank calls (each writing its own part)
    collective_write: bool = False

    def __init__(
        self,
        model: torch.nn.Module,
        store: CheckpointStore | str | Path | None,
        config: QuantConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        settings: CheckpointSettings | None = None,
        **shortcuts: Any,
    ) -> None:
        if settings is None:
            settings = CheckpointSettings(config=config, **{"threshold": None, **shortcuts})
        elif config is not None or shortcuts:
            raise InvalidSettingError(
                f"pass either settings= or the settings as keyword arguments, not both (got settings= and "
                f"{', '.join(['config'] * (config is not None) + sorted(shortcuts))})"
            )
        self.settings = settings
        metric = settings.quality_metric()
        self.search: ConfigurationSearch | None = None
        # a peer's knob searched as the DynaQuant paper searched its baselines (None: its defaults)
        self.peer_search: PeerSearch | None = None
        if metric is not None and settings.codec in PEER_CUBES:
            if is_distributed():
                raise UnsupportedSetupError(
                    f"codec={settings.codec!r} with a threshold searches its knob in the writing process, on the "
                    "live model while the other ranks train: with several processes run the peer with threshold=None"
                )
            self.peer_search = PeerSearch(settings.codec, metric, settings.threshold, seconds=settings.search_seconds)
        elif metric is not None:
            self.search = ConfigurationSearch(
                metric,
                settings.threshold,
                search_space=settings.search_space,
                config=settings.config,
                seconds=settings.search_seconds,
            )
        self.last_search: SearchResult | None = None
        self.last_report: CheckpointReport | None = None
        self.model, self.optimizer = model, optimizer
        self.moment_quant = settings.moment_quant or MomentQuant()
        self.store: CheckpointStore | None = (
            store if isinstance(store, CheckpointStore) or store is None else CheckpointStore(store)
        )
        self.config = settings.config or QuantConfig()  # rounding changes on a resume (resumed_from)
        self.ema = GradientEMA(model.named_parameters(), beta=settings.ema_beta, on_device=settings.use_accelerator)
        self.step = 0  # optimizer steps seen (counted in before_gradient_flush)
        self.last_entry: str | None = None
        self._chain_length = 0  # entries written since the chain's keyframe, the keyframe included
        self._depth = 0  # deltas a restore of last_entry replays (settings.restore_depth bounds them)
        self._keyframe: str | None = None  # the chain's keyframe: the base of an anchor (restore_depth)
        self._states: dict[tuple[str, str], Any] = {}  # codes of the last checkpoint, for the next delta
        # the keyframe's codes as kept, for the anchors (restore_depth; None: read from the store when needed)
        self._keyframe_states: dict[tuple[str, str], Any] | None = None
        self._skeleton: ModelSkeleton | None = None  # the structure a detached search evaluates
        self._stream: torch.cuda.Stream | None = None  # see _side_stream
        self.pretrained = self._pretrained_weights(settings.pretrained)
        # the last checkpoint's quantizable weights, for "previous" residuals: their codes (the
        # kept states of _states, decoded to float32 when a search asks) or exact values; None: not
        # known in this process (read back from the store when needed)
        self._previous: dict[str, QuantState | KeptState | torch.Tensor] | None = None

    def _pretrained_weights(self, setting: Any) -> Any:
        """The :class:`~hf_dynaquant.pretrained.weights.PretrainedWeights` of a ``pretrained=`` setting
        (``None`` when off, or when ``"auto"`` finds none)."""
        if setting is None or not self._residual_wanted("pretrained"):
            return None
        from ..pretrained.weights import PretrainedWeights

        if isinstance(setting, PretrainedWeights):
            return setting
        if setting == "auto":
            return PretrainedWeights.from_model(self.model)
        shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        return PretrainedWeights.from_source(setting, shapes)

    def _residual_wanted(self, kind: str) -> bool:
        """Whether checkpoints may code residuals of ``kind``: the fixed configuration's, or one
        the search offers."""
        if self.search is not None:
            return kind in self.search.search_space.residuals
        return self.config.residual == kind

    def _writable(self) -> CheckpointStore:
        if self.store is None:
            raise CheckpointError("this Compressor has no store (a process that only takes part in the search)")
        return self.store

    def _collecting(self) -> bool:
        every = self.settings.checkpoint_every
        if not every:
            return True
        to_next = -(self.step + 1) % every
        return to_next < self.settings.ema_steps

    def on_backward_pass_end(self) -> None:
        """Call after ``loss.backward()``: records the gradients in the window before a
        checkpoint (:class:`~hf_dynaquant.core.ranking.GradientEMA`: folded in on a CUDA device
        with room, else their copies to the host begun)."""
        if self._collecting():
            self.ema.start()

    def before_gradient_flush(self) -> None:
        """Call before ``optimizer.zero_grad()``: completes this step's gradient copies to the host, if any."""
        self.ema.finish()
        self.step += 1

    def continue_chain(self, ref_or_id: str) -> None:
        """Make the next checkpoint a delta on a stored entry (after a resume in a new process):
        the chain goes on instead of starting with a keyframe."""
        store = self._writable()
        self.last_entry = store.resolve(ref_or_id)
        chain = store.chain(self.last_entry)  # (newest first: the entry, its bases, the keyframe)
        self._depth, self._keyframe, self._keyframe_states = len(chain) - 1, chain[-1], None
        self._states, self._previous = {}, None
        with store.open(self.last_entry) as entry:
            # entries since the keyframe: recorded by the compressor that wrote it (in entries written
            # before it was recorded, which had no anchors, the chain's length); a self-contained
            # entry (a compacted one, say) starts a chain whatever it records
            position = entry.metadata.get("chain_position") if len(chain) > 1 else 0
            self._chain_length = position + 1 if isinstance(position, int) and position >= 0 else len(chain)
            if "pretrained" in entry.metadata and self._residual_wanted("pretrained"):
                self.pretrained = entry.pretrained()  # the chain keeps the pre-trained weights it was coded against
            if self.peer_search is not None:
                self.peer_search.continue_from(entry.metadata.get("search"))
            if self.search is not None:
                record = entry.metadata.get("search")  # a fixed configuration's entry leaves the search exhaustive
                self.search.continue_from(
                    entry.metadata.get("quant_config") if record is not None else None, (record or {}).get("delta_bits")
                )
        if self._next_on_last():
            # the next delta's base codes, kept as a run keeps them between saves: its search sizes
            # candidates as stored, and its write does not decode the chain tensor by tensor beside
            # the codes it makes (at 124M a save after a resume so took twice a delta's time and up
            # to 1.04x a pure-bf16 checkpoint's memory)
            self._states = self._stored_states(self.last_entry)
            if self.last_entry == self._keyframe and self._anchors_may_come():
                self._keyframe_states = dict(self._states)  # (not read from the store again for an anchor)
        self.resumed_from(self.last_entry)

    def _stored_states(self, entry_id: str) -> dict[tuple[str, str], Any]:
        """The codes of a stored entry's quantized tensors, kept as a run keeps them between
        saves (packed by their levels: 1, 2 or 4 bits a code up to 16, a byte past that, where a
        run keeps a wider tensor as its keyframe's stream packed it)."""
        store = self._writable()
        states: dict[tuple[str, str], Any] = {}
        with store.open(entry_id) as entry:
            for section in entry.sections:
                for n in entry.names(section):  # (each packed as it is read: not all held a byte a code at once)
                    if not _is_quantized(entry.record(section, n)):
                        continue
                    if isinstance(st := entry.state(section, n), QuantState):
                        states[(section, n)] = _kept(st, f"{store.path}: entry {entry_id}: {section}/{n}")
        return states

    def _forget_chain(self) -> None:
        """Start the next checkpoint afresh, with a keyframe."""
        self.last_entry, self._chain_length, self._depth, self._keyframe = None, 0, 0, None
        self._states, self._keyframe_states, self._previous = {}, None, None

    def resumed_from(self, entry: str) -> None:
        """Training goes on from the decoded weights of stored ``entry``: from now on round
        stochastically (:mod:`hf_dynaquant.core.rounding`), with random numbers of this resume's
        own, seeded by ``entry`` (an id or a reference; with several processes every rank must
        pass the same, so that all search and encode alike). Every weight now sits on a centre,
        and rounding to the nearest one again would erase each update smaller than half a bin
        made since."""
        seed = zlib.crc32(entry.encode())
        self.config = replace(self.config, rounding="stochastic", rounding_seed=seed)
        if self.search is not None:
            self.search.config = replace(self.search.config, rounding="stochastic", rounding_seed=seed)

    def snapshot(
        self,
        step: int,
        *,
        detach_model: bool = False,
        copy: bool = True,
        metadata: Mapping[str, Any] | None = None,
    ) -> Snapshot:
        """Copy what checkpoint ``step`` needs. With ``detach_model`` the search (if any)
        evaluates a copy of the model, so :meth:`write` may run while training goes on;
        otherwise it evaluates the live model (restored bit-exactly afterwards). ``copy=False``
        takes tensors already on the CPU as they are, with no copy: only for a :meth:`write`
        that finishes before training changes them (a foreground save), which then holds no
        second copy of the checkpoint. A search that evaluates the live model (not
        ``detach_model``) writes candidates into its weights, so the snapshot copies then anyway.

        A detached snapshot of a model on one CUDA device (with ``settings.use_accelerator``) is
        copied on the device when it has room, and its search evaluates there (see
        :mod:`hf_dynaquant.training.snapshot`); otherwise it is copied to the CPU."""
        searching = self.search is not None or self.peer_search is not None
        copy = copy or (searching and not detach_model)
        live = self.model.state_dict(keep_vars=True)
        by_ptr = {p.data_ptr(): n for n, p in self.model.named_parameters()}
        params = {n: by_ptr[t.data_ptr()] for n, t in live.items() if t.data_ptr() in by_ptr}
        opt_state = None
        if self.optimizer is not None and self.settings.optimizer_state != "drop":
            opt_state = self.optimizer.state_dict()
        device = device_of(self.model)
        # one CUDA device holding the whole model (a model spread over devices is copied to the host)
        accelerated = (
            detach_model
            and self.settings.use_accelerator
            and device.type == "cuda"
            and all(t.device == device for t in live.values())
        )
        staged = self._stage(live, opt_state, device) if accelerated and copy else None
        if staged is not None:
            state, optimizer, ready = staged
        else:
            state, ready = cpu_copies(live.items(), copy=copy), None
            optimizer = cpu_tree(opt_state, copy=copy) if opt_state is not None else None
        ema = self.ema.take()
        if staged is None:  # (a staged snapshot's settle() moves an EMA kept on the device with the weights)
            ema = cpu_copies(ema.items(), copy=False)
        # a fixed config with prune_by="sensitivity" has the planner warn; a search that offers it warns here
        if not ema and self.search is not None and "sensitivity" in self.search.search_space.prune_by:
            warnings.warn(
                "no gradients were recorded before this checkpoint: the search tries pruning by magnitude "
                "only (call on_backward_pass_end() after backward)",
                stacklevel=3,
            )
        search_device = None
        if accelerated and self.search is not None:
            if ready is not None or has_room(device, unique_nbytes(state[n] for n in params)):
                search_device = device
        return Snapshot(
            step=step,
            copied=copy,
            state=state,
            params=params,
            types=layer_types(self.model),
            gradient_ema=ema,
            optimizer=optimizer,
            model=self._search_model(detach_model) if searching else None,
            metadata={"step": step, **dict(metadata or {})},
            optimizer_params=self._optimizer_params() if self.settings.codec == "excp" and optimizer else None,
            staged=ready,
            stream=self._side_stream(device) if ready is not None or search_device is not None else None,
            search_device=search_device,
        )

    def _optimizer_params(self) -> dict[int, str]:
        """The parameter name of each parameter id of the optimizer's ``state_dict`` (numbered in
        the order of its parameter groups, as ``torch.optim.Optimizer.state_dict`` does)."""
        assert self.optimizer is not None
        names = {id(p): n for n, p in self.model.named_parameters()}
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {pid: names[id(p)] for pid, p in enumerate(params) if id(p) in names}

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The CUDA stream the background moves snapshots and evaluates the search on: one per
        compressor and device (each stream gets a cuBLAS workspace of its own, kept)."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _stage(
        self, live: Mapping[str, torch.Tensor], opt_state: Any, device: torch.device
    ) -> tuple[dict[str, torch.Tensor], Any, torch.cuda.Event] | None:
        """Copies of the model's state and the optimizer's on CUDA ``device``, queued on the
        training thread's stream, and the event after them; ``None`` when the device has no room."""
        if not has_room(device, unique_nbytes(live.values()) + raw_optimizer_bytes(opt_state)):
            return None
        try:
            state = device_copies(live.items())
            optimizer = map_tree(opt_state, lambda t: t.detach().clone()) if opt_state is not None else None
        except torch.OutOfMemoryError:
            logger.info("hf_dynaquant: no room on %s for the snapshot: it is copied to host memory", device)
            return None
        return state, optimizer, torch.cuda.current_stream(device).record_event()

    def _search_model(self, detached: bool) -> torch.nn.Module | ModelSkeleton:
        """The live model, or (detached) the skeleton of it, made again when the model changed."""
        if not detached:
            return self.model
        if self._skeleton is None or self._skeleton.signature != ModelSkeleton.signature_of(self.model):
            self._skeleton = ModelSkeleton(self.model)
        return self._skeleton

    def _next_is_keyframe(self) -> bool:
        return self.last_entry is None or self._chain_length >= self.settings.keyframe_every

    def _next_is_anchor(self) -> bool:
        """Whether the next checkpoint is a delta on the keyframe rather than on the last one (an
        anchor): a delta on the last would make its restore replay more than ``restore_depth``."""
        depth = self.settings.restore_depth
        return not self._next_is_keyframe() and depth is not None and self._depth >= depth

    def _anchors_may_come(self) -> bool:
        """Whether an anchor may still come before the next keyframe (the keyframe's codes are
        kept for it only then): the chain's entries left after the last one reach
        ``restore_depth`` deltas deep."""
        depth = self.settings.restore_depth
        return depth is not None and self._chain_length + depth - self._depth < self.settings.keyframe_every

    def _next_base(self) -> str | None:
        """The entry the next checkpoint is a delta on (None: a keyframe)."""
        if self._next_is_keyframe():
            return None
        return self._keyframe if self._next_is_anchor() else self.last_entry

    def _next_on_last(self) -> bool:
        """Whether the next checkpoint is a delta on the last one (neither a keyframe nor an anchor)."""
        return self.last_entry is not None and self._next_base() == self.last_entry

    def _next_base_states(self) -> dict[tuple[str, str], Any]:
        """The codes of the next checkpoint's base, kept (those of an anchor's keyframe read from
        the store if this process did not write it). The write consumes the dict it is given."""
        if not self._next_is_anchor():
            return self._states
        assert self._keyframe is not None
        if self._keyframe_states is None:
            self._keyframe_states = self._stored_states(self._keyframe)
        return dict(self._keyframe_states)  # (the keyframe's stay for the next anchor)

    def references(self, snap: Snapshot) -> dict[str, Reference]:
        """The residual references available to the next checkpoint, by kind: ``"previous"``
        (the last checkpoint's decoded weights; not at a keyframe or an anchor, which are coded on
        no checkpoint or on the keyframe, nor when the search is spread over several processes,
        which do not all keep them) and ``"pretrained"``."""
        weights = {n: snap.state[n] for n in snap.params}
        out: dict[str, dict[str, torch.Tensor]] = {}
        if self._residual_wanted("previous") and self._next_on_last() and not is_distributed():
            out["previous"] = self._previous_values(weights)
        if self._residual_wanted("pretrained") and self.pretrained is not None:
            have = set(self.pretrained.names())
            out["pretrained"] = {n: self.pretrained.tensor(n) for n in weights if n in have}
        return {kind: Reference(values, snap.sensitivity(values)) for kind, values in out.items() if values}

    def _base_codes(self) -> dict[str, np.ndarray] | None:
        """The codes of the entry the next checkpoint will be a delta on (kept since this process
        wrote or resumed from it; an anchor's keyframe's read from the store after a resume), so
        the search sizes candidates as stored; not when the search is spread over several
        processes, which do not all keep them."""
        if self._next_is_keyframe() or is_distributed():
            return None
        # (unpacked now, held for the search, which reads each tensor's for every candidate)
        return {
            n: st.unpacked().codes
            for (sec, n), st in self._next_base_states().items()
            if sec == MODEL and isinstance(st, (QuantState, KeptState))
        }

    def _previous_values(
        self, weights: Mapping[str, torch.Tensor], entry_id: str | None = None
    ) -> Mapping[str, torch.Tensor]:
        """The last entry's (or ``entry_id``'s) decoded values of ``weights``' tensors: the last
        entry's decoded from the codes this process kept when it wrote it (:meth:`_keep_previous`)
        each time one is read (:class:`~hf_dynaquant.core.memory.Computed`: the search reads them
        a tensor at a time), else read back from the store once (kept for the last entry)."""
        entry_id = entry_id or self.last_entry
        previous = self._previous if entry_id == self.last_entry else None
        if previous is None:
            assert entry_id is not None
            with self._writable().open(entry_id) as entry:
                stored = set(entry.names(MODEL)) if MODEL in entry.sections else set()
                floats = [n for n, t in weights.items() if n in stored and t.is_floating_point()]
                previous = {n: entry.tensor(MODEL, n).float() for n in floats}
            if entry_id == self.last_entry:
                self._previous = previous
        return Computed({n: functools.partial(_decoded, kept) for n, kept in previous.items()})

    def _keep_previous(self, snap: Snapshot, states: Mapping[tuple[str, str], Any]) -> None:
        """Keep what the next ``"previous"`` residuals need of the checkpoint just written: a
        quantized tensor's codes (the ones kept for the next delta anyway: decoded only when a
        search asks, so that 4 bytes a weight are not held between checkpoints), any other
        tensor's exact values (stored losslessly)."""
        if not self._residual_wanted("previous") or is_distributed():  # (several processes: not used, see references)
            self._previous = None
            return
        out: dict[str, QuantState | KeptState | torch.Tensor] = {}
        first: dict[Any, str] = {}
        for name in snap.params:
            t = snap.state[name]
            if not is_quantizable(t, self.config):
                continue
            key = storage_key(t)
            if key is not None and key in first:  # a tied weight: stored (and decoded) under its first name
                out[name] = out[first[key]]
                continue
            first[key] = name
            state = states.get((MODEL, name))
            if isinstance(state, (QuantState, KeptState)):
                out[name] = state
            else:  # a snapshot that holds the live tensors (a foreground save's) is copied: training moves them
                exact = t.float()
                out[name] = exact.clone() if exact is t and not snap.copied else exact
        self._previous = out

    def plan_snapshot(self, snap: Snapshot) -> QuantPlan:
        """The plan of the fixed configuration for a snapshot (without a threshold); a residual
        configuration codes against its reference where available, directly elsewhere. A hook:
        :class:`~hf_dynaquant.training.sharded.ShardedCompressor` plans from sketches merged over the ranks."""
        weights = {n: snap.state[n] for n in snap.params}
        ref = self.references(snap).get(self.config.residual)
        config = self.config if ref is not None else replace(self.config, residual="none")
        return plan_quantization(
            weights,
            config,
            types=snap.types,
            sensitivity=ref.sensitivity if ref is not None else snap.sensitivity(),
            where=f"step {snap.step}",
            reference=ref.values if ref is not None else None,
        )

    def optimizer_reductions(self) -> Reductions | None:
        """How the optimizer encoder combines processes' rows (None: one process holds all). A
        hook: :class:`~hf_dynaquant.training.sharded.ShardedCompressor` reduces over the ranks."""
        return None

    def search_snapshot(self, snap: Snapshot) -> SearchResult:
        """Run the configuration search on a snapshot (every rank together when distributed)."""
        if self.search is None or snap.model is None:
            raise ValueError("this Compressor has no threshold (nothing to search) or the snapshot has no model")
        snap.settle()
        weights = {n: snap.state[n] for n in snap.params}
        with snap.search_model() as model:
            result = self.search.search(
                model,
                weights,
                types=snap.types,
                sensitivity=snap.sensitivity(),
                where=f"step {snap.step}",
                references=self.references(snap),
                base_codes=self._base_codes(),
                base_is_last=self._next_on_last(),
            )
        return self._searched(result)

    def _searched(self, result: SearchResult) -> SearchResult:
        """A finished search's result, returned; kept as :attr:`last_search` without its plan,
        whose sensitivities and references (up to the weights' size in float32 each) are the
        write's alone, and the memory the search freed (candidates, the model copy it evaluated)
        handed back."""
        self.last_search = replace(result, plan=None)
        release_freed()
        return result

    def write(
        self,
        snap: Snapshot,
        *,
        ref: str | None = None,
        progress: bool = False,
        searched: SearchResult | None = None,
    ) -> CheckpointReport:
        """Search (if a threshold was given and ``searched`` is not the result already), encode
        and store a snapshot; the reference is ``ref`` or ``step-<step>``."""
        started = time.perf_counter()
        snap.settle()
        store = self._writable()
        # one pace of handing freed memory back for the save's decisions and write, counted from here
        state_raw, state_values = unique_size(snap.state.values())
        optimizer_raw, optimizer_values = raw_optimizer_size(snap.optimizer)
        freed = ReleaseFreed(allowance=save_allowance(state_raw + optimizer_raw, state_values + optimizer_values))
        keyframe, anchor, base = self._next_is_keyframe(), self._next_is_anchor(), self._next_base()
        meta = dict(snap.metadata)
        meta["chain_position"] = 0 if keyframe else self._chain_length  # (continue_chain reads it)
        search = None
        peer = self.settings.codec != "dynaquant"  # a peer's codec quantizes the weights itself
        options: dict[str, Any] | None = {}  # the peer codec's (None: nothing passed its search)
        if peer:
            plan, chosen = None, None
            meta["codec"] = self.settings.codec
            if self.peer_search is not None:
                with snap.search_model() as model:
                    picked = self.peer_search.search(model, {n: snap.state[n] for n in snap.params}, where=f"step {snap.step}")
                search = meta["search"] = picked.to_dict()
                options = picked.options
        elif self.search is None:
            plan: QuantPlan | None = self.plan_snapshot(snap)
            chosen: QuantConfig | None = plan.config
        else:
            result = searched if searched is not None else self.search_snapshot(snap)
            search = meta["search"] = result.to_dict()
            plan, chosen = result.plan, result.config
        plans = dict(for_section(plan).tensors) if plan is not None else {}
        if any(tp.residual == "pretrained" for tp in plans.values()):
            meta["pretrained"] = self.pretrained.descriptor
        trees = None
        fallback: Any = {MODEL: get_codec(self.settings.codec, **options) if peer and options is not None else "lossless"}
        if self.settings.codec == "excp":  # ExCP codes the weights with Adam's moments
            if snap.optimizer is None or snap.optimizer_params is None:
                raise CheckpointError(f"step {snap.step}: codec='excp' codes the optimizer's moments: it needs an optimizer")
            previous = None if base is None else self._previous_values({n: snap.state[n] for n in snap.params}, base)
            tree, fallback, meta["optimizer_state"] = excp_checkpoint(snap, previous, OPTIMIZER)
            trees = {OPTIMIZER: tree}
            self._previous = None  # the next checkpoint's residuals are on this one as restored
        elif snap.optimizer is not None:
            encoded = encode_optimizer_state(
                snap.optimizer,
                self.settings.optimizer_state,
                self.moment_quant,
                self.optimizer_reductions(),
                non_finite=self.config.non_finite,
                where=f"step {snap.step}",
                freed=freed,
            )
            assert encoded is not None
            trees = {OPTIMIZER: encoded.tree}
            plans.update({plan_key(OPTIMIZER, n): tp for n, tp in encoded.plans.items()})
            meta["optimizer_state"] = encoded.report
        elif self.optimizer is not None:
            meta["optimizer_state"] = {"mode": "drop"}
        # the base's codes are consumed by the write as the new entry's replace them (and a
        # keyframe needs none): the two are never all held at once
        base_states = self._next_base_states() if base is not None else None
        self._states = {}
        if keyframe:
            self._keyframe_states = None  # (the last chain's: not held beside this write's codes)
        states: dict[tuple[str, str], Any] = {}
        entry = write_planned(
            store,
            {MODEL: snap.state},
            QuantPlan(self.config, plans),
            config=chosen,
            delta_coding=self.settings.delta_coding,
            metadata=meta,
            trees=trees,
            extras=snap.extras,
            base=base,
            ref=ref or f"step-{snap.step}",
            progress=progress,
            base_states=base_states,
            keep_states=states,
            fallback=fallback,
            freed=freed,
        )
        self._states = states
        self._keep_previous(snap, states)
        self.last_entry = entry
        if keyframe:
            self._keyframe, self._chain_length, self._depth = entry, 1, 0
        else:
            self._chain_length, self._depth = self._chain_length + 1, 1 if anchor else self._depth + 1
        if not self._anchors_may_come():
            self._keyframe_states = None
        elif keyframe:  # (the same kept states as the next delta's base, held once more for the anchors)
            self._keyframe_states = dict(states)
        info = store.info(entry)
        sizes = info.sections
        weights_raw, weights_stored = sizes.get(MODEL, (0, 0))
        opt_stored = sizes.get(OPTIMIZER, (0, 0))[1]
        total = info.nbytes
        self.last_report = CheckpointReport(
            step=snap.step,
            entry=entry,
            keyframe=keyframe,
            anchor=anchor,
            weights_raw=weights_raw,
            weights_stored=weights_stored,
            optimizer_raw=optimizer_raw,
            optimizer_stored=opt_stored,
            other_stored=max(total - weights_stored - opt_stored, 0),
            seconds=time.perf_counter() - started,
            search=search,
            optimizer_state=meta.get("optimizer_state"),
        )
        return self.last_report

    def compress(
        self, step: int, *, extras: Mapping[str, bytes] | None = None, metadata: Mapping[str, Any] | None = None
    ) -> str:
        """Write checkpoint ``step`` (reference ``step-<step>``) now; returns the entry id."""
        snap = self.snapshot(step, copy=False, metadata=metadata)  # written before this returns
        snap.extras = dict(extras or {})
        return self.write(snap).entry

    def restore(
        self,
        step_or_ref: int | str,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into ``model`` (default: this compressor's) and the optimizer;
        returns the checkpoint's metadata. Raises if an optimizer is given but the checkpoint
        holds no optimizer state (written with ``optimizer_state="drop"``)."""
        ref = f"step-{step_or_ref}" if isinstance(step_or_ref, int) else step_or_ref
        model = model or self.model
        optimizer = optimizer or self.optimizer
        store = self._writable()
        where = f"checkpoint {ref!r} in {store.path}"
        with store.open(ref) as entry:
            meta = dict(entry.metadata)
            if optimizer is not None and OPTIMIZER not in entry.trees:
                raise MissingOptimizerStateError(
                    f"{where} holds no optimizer state "
                    f"(optimizer_state={meta.get('optimizer_state', {}).get('mode', 'absent')!r}); "
                    "pass optimizer=None to restore the weights alone"
                )
            load_weights(model, entry, where)
            if optimizer is not None:
                optimizer.load_state_dict(read_optimizer_state(entry, f"optimizer state of {where}"))
            entry_id = entry.id
        if model is self.model:
            self.resumed_from(entry_id)
        return meta


def _kept(state: QuantState, where: str) -> QuantState | KeptState:
    """A stored tensor's decoded state as a compressor keeps it (:meth:`DynaQuantCodec.kept`)."""
    try:
        return DynaQuantCodec().kept(state)
    except ValueError:
        raise CorruptCheckpointError(f"{where}: codes past the tensor's {state.levels} levels") from None


def _decoded(kept: QuantState | KeptState | torch.Tensor) -> torch.Tensor:
    """A kept tensor of the last checkpoint as a restore decodes it (float32)."""
    if isinstance(kept, torch.Tensor):
        return kept
    return from_raw(DynaQuantCodec().to_raw(kept.unpacked())).float()


def _is_quantized(record: Mapping[str, Any]) -> bool:
    """Whether a stored tensor record holds DynaQuant codes of its own (not an alias, not lossless)."""
    return "alias_of" not in record and record.get("codec") == DynaQuantCodec.name
