"""A checkpoint's snapshot: what a save copies off the live training state, and where it is held.

Taking the snapshot is the only part of a checkpoint that stops training; encoding, the search
and the write read the snapshot, not the live model (see
:class:`~hf_dynaquant.training.manager.CheckpointManager`).

**On an accelerator.** When the model is held whole by one CUDA device, a background save with
``CheckpointSettings.use_accelerator`` (the default) copies the snapshot *on the device* if the
device has room for it: a device-to-device copy of weights and optimizer state takes
milliseconds, where a copy into host memory stalls training for seconds (4.2 GB at 353M
parameters on an H100: a stall of 0.04-0.10 s staged, 3.7 s into host memory; see
benchmarks/RESULTS.md). The background thread then moves the copy to the host
on a CUDA stream of its own (:meth:`Snapshot.settle`), after the copy the training thread
queued, and the configuration search evaluates its candidates on the device with those staged
weights (:meth:`Snapshot.search_model`) instead of on a CPU copy of the model (105 s per
checkpoint at 353M on 16 cores). Without room for the whole snapshot the search still goes to
the device if the weights fit there, copied from the host snapshot.

"Room" is free device memory outside PyTorch's cache of the copy plus a reserve of the device
(:func:`~hf_dynaquant.core.memory.has_room`): training's own cached blocks stay its own, so its
next step allocates as it did before.
A copy that fails anyway (``torch.OutOfMemoryError``) falls back to the host, as the search's does
to the CPU. The staged copy lives from the save until the background has moved it (and, for the
weights, until the search is done); only one checkpoint is ever in flight. A user short of
device memory sets ``use_accelerator=False``: the snapshot then goes straight to host memory (a
longer stall) and the search evaluates a CPU copy.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.dtypes import check_storable
from ..core.memory import Computed, release_freed
from ..core.ranking import sensitivity
from ..store.tree import flatten_tree

__all__ = [
    "Snapshot",
    "ModelSkeleton",
    "cpu_copies",
    "cpu_tree",
    "device_copies",
    "map_tree",
    "raw_optimizer_bytes",
    "raw_optimizer_size",
    "unique_nbytes",
    "unique_size",
]

logger = logging.getLogger("hf_dynaquant")


@dataclass
class Snapshot:
    """Everything one checkpoint needs, copied off the live training state.

    Taking it is the only part of a checkpoint that must stop training (a copy of the weights
    and of the optimizer state, the gradient EMA handed over); :meth:`Compressor.write` does the
    rest (sensitivity, the model copy the search evaluates, search, encoding), in the foreground
    or on a background thread, after :meth:`settle` has the copy in host memory."""

    step: int
    state: dict[str, torch.Tensor]  # copies (on the CPU once settled); tied weights share one tensor
    params: dict[str, str]  # state name -> parameter name, for the tensors that are parameters
    types: dict[str, str]
    # parameter name -> EMA of its gradient (flat; on the CPU once settled, except a sharded model's local shards)
    gradient_ema: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # copy of the optimizer's state_dict (on the CPU once settled)
    model: torch.nn.Module | ModelSkeleton | None  # what the search evaluates: the live model or a skeleton
    metadata: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, bytes] = field(default_factory=dict)
    optimizer_params: dict[int, str] | None = None  # optimizer state id -> parameter name (codec "excp")
    # recorded on the training thread's stream after the copies, while ``state`` and ``optimizer``
    # (and ``gradient_ema``, when it was kept there) are on a CUDA device (settle() moves them to the host)
    staged: torch.cuda.Event | None = None
    stream: torch.cuda.Stream | None = None  # the background's own stream on the model's CUDA device
    search_device: torch.device | None = None  # where a skeleton is evaluated (None: the CPU)
    # whether ``state`` holds copies; False: a foreground save's snapshot, whose CPU tensors are
    # the live model's own (Compressor.snapshot with copy=False)
    copied: bool = True
    # the staged weights, kept after settle() for a search on the device (released by it)
    device_state: dict[str, torch.Tensor] | None = None

    def nbytes(self) -> int:
        """Bytes of the snapshot's tensors (weights and optimizer state)."""
        return sum(t.numel() * t.element_size() for t in self.state.values()) + raw_optimizer_bytes(self.optimizer)

    def settle(self) -> None:
        """Move a snapshot staged on the accelerator into host memory (on any thread: on the
        staged stream, after the training thread's copies), with the gradient EMA if it was kept
        on the device, keeping the staged weights for a search on the device. Does nothing to a
        snapshot already on the host."""
        if self.staged is None:
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.staged)
            on_device = self.state
            self.state = cpu_copies(on_device.items())
            self.optimizer = cpu_tree(self.optimizer)
            self.gradient_ema = cpu_copies(self.gradient_ema.items(), copy=False)
            self.stream.synchronize()  # the device copies may be freed from here on
        self.staged = None
        if self.search_device is not None and isinstance(self.model, ModelSkeleton):
            self.device_state = on_device

    def release(self) -> None:
        """Drop the snapshot's tensors once its checkpoint is written and hand the memory they
        and the write freed back to the operating system (:func:`~hf_dynaquant.core.memory.release_freed`):
        the tensors of a model are mostly too small for malloc to give back on its own, so
        without this the resident set keeps about a checkpoint's size between checkpoints."""
        self.state, self.optimizer, self.gradient_ema, self.device_state = {}, None, {}, None
        release_freed()

    def sensitivity(self, reference: Mapping[str, torch.Tensor] | None = None) -> Computed | None:
        """``|EMA(g) * w|`` of every parameter with a recorded gradient (``None``: none recorded);
        with ``reference``, ``|EMA(g) * (w - ref)|`` for the tensors it holds one of their shape
        (the sensitivity of a residual: zeroing it moves the weight by ``w - ref``). Each is
        computed when read (:class:`~hf_dynaquant.core.memory.Computed`) from the snapshot's
        tensors as they are then: its host copies once settled; a read after :meth:`release`
        is a ``KeyError``, never a read of tensors the snapshot let go."""
        refs = reference or {}

        def of(name: str, param: str) -> torch.Tensor:
            w = self.state[name]
            ref = refs.get(name)
            if ref is not None and ref.shape == w.shape:
                w = w.float() - ref.float()
            return sensitivity(w, self.gradient_ema[param].view(w.shape))

        makers = {name: functools.partial(of, name, p) for name, p in self.params.items() if p in self.gradient_ema}
        return Computed(makers) if makers else None

    @contextmanager
    def search_model(self) -> Iterator[torch.nn.Module | None]:
        """The model the search evaluates: the live one, or (detached) a copy whose tensors are
        this snapshot's, made for the search and released after it: on :attr:`search_device`
        (evaluated on a stream of its own there), or on the CPU when that device has no room."""
        if not isinstance(self.model, ModelSkeleton):
            yield self.model
            return
        self.settle()
        skeleton, device, own = self.model, self.search_device, self.device_state
        self.device_state = None  # the skeleton holds them from here on, and drops them after
        if device is not None and self.stream is not None:
            stream, stack = self.stream, ExitStack()
            try:
                stack.enter_context(torch.cuda.stream(stream))
                model = stack.enter_context(skeleton.filled(self.state, device, own))
            except BaseException as exc:
                stack.close()
                if not isinstance(exc, torch.OutOfMemoryError):
                    raise
                logger.info("hf_dynaquant: step %d: no room on %s for the search: it evaluates a CPU copy", self.step, device)
                self.search_device, own = None, None
            else:
                with stack:
                    try:
                        yield model
                    finally:
                        stream.synchronize()  # the search's kernels are done before its copies are freed
                return
        with skeleton.filled(self.state) as model:
            yield model


class ModelSkeleton:
    """A copy of a model's structure, for the search to evaluate while training goes on.

    Made in the training thread (which owns the live model; copying the structure of GPT-2 small
    takes ~50 ms, so it is made once and reused while the model's tensors keep their names,
    shapes and dtypes). The tensors of the state dict are empty placeholders; :meth:`filled`
    gives them copies of a snapshot's values (on whichever thread searches, on the CPU or an
    accelerator) and empties them again afterwards, so the skeleton costs no memory between
    checkpoints. Tensors outside the state dict (non-persistent buffers) are copied to the host
    when the skeleton is made, and to the search's device while it is filled."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.signature = self.signature_of(model)
        state_names = set(model.state_dict(keep_vars=True))
        memo: dict[int, Any] = {}
        self._slots: list[tuple[torch.Tensor, str]] = []  # (placeholder, state name), one per tensor (ties shared)
        self._others: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its host value), outside the state
        for name, t in _named_tensors(model):
            if id(t) in memo:
                continue
            is_param = isinstance(t, torch.nn.Parameter)
            held = torch.empty(0, dtype=t.dtype) if name in state_names else t.detach().to("cpu", copy=True)
            memo[id(t)] = torch.nn.Parameter(held, requires_grad=False) if is_param else held
            if name in state_names:
                self._slots.append((memo[id(t)], name))
            else:
                self._others.append((memo[id(t)], held))
        self.module = copy.deepcopy(model, memo)

    @staticmethod
    def signature_of(model: torch.nn.Module) -> tuple:
        """What the skeleton depends on: the model object and each tensor's name, shape and dtype."""
        return (id(model), *((n, tuple(t.shape), t.dtype) for n, t in _named_tensors(model)))

    @contextmanager
    def filled(
        self,
        values: Mapping[str, torch.Tensor],
        device: torch.device | None = None,
        own: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[torch.nn.Module]:
        """The skeleton on ``device`` (default: the CPU) with copies of ``values`` (a snapshot's
        state) in its tensors; ``own``: copies already on ``device`` that are the search's to
        change (a staged snapshot's), taken as they are."""
        device = device or torch.device("cpu")
        try:
            for slot, name in self._slots:
                mine = (own or {}).get(name)
                slot.data = mine if mine is not None else values[name].to(device, copy=True)
            for tensor, host in self._others:
                tensor.data = host.to(device)
            yield self.module
        finally:
            for slot, _ in self._slots:
                slot.data = torch.empty(0, dtype=slot.dtype)
            for tensor, host in self._others:
                tensor.data = host


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def _copies(
    tensors: Iterable[tuple[str, torch.Tensor]], copy_one: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``copy_one`` of each named tensor; names sharing one tensor (tied weights) share one copy."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for name, t in tensors:
        check_storable(t, name)
        key = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen or t.numel() == 0:
            seen[key] = copy_one(t.detach())
        out[name] = seen[key]
    return out


def cpu_copies(tensors: Iterable[tuple[str, torch.Tensor]], *, copy: bool = True) -> dict[str, torch.Tensor]:
    """CPU copies of named tensors; names sharing one tensor (tied weights) share one copy.
    ``copy=False``: tensors already on the CPU are taken as they are (detached, not copied)."""
    return _copies(tensors, lambda t: _to_host(t, copy=copy))


def device_copies(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copies of named tensors where they are (on the accelerator: queued on the current stream);
    names sharing one tensor share one copy."""
    return _copies(tensors, torch.clone)


def cpu_tree(tree: Any, *, copy: bool = True, local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """A nested state (an optimizer's ``state_dict``) with every tensor on the CPU: copied, or
    with ``copy=False`` as it is where it is there already; ``local`` first maps each tensor
    (a DTensor to its local shard)."""
    return map_tree(tree, lambda t: _to_host((local(t) if local is not None else t).detach(), copy=copy))


def _to_host(t: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
    """``t`` in host memory: a tensor on the CPU copied (or, ``copy=False``, as it is); one on
    an accelerator copied into host memory that torch's threads first touched (``zero_``). A
    plain ``t.to("cpu")`` leaves the first touch of every page to the copy, one thread's work:
    on an H200 machine (``benchmarks/bench_settle.py``, session 44) a 4.24 GB snapshot moved in
    3.16 s that way and in 0.66 s with the pages touched first, at the same memory."""
    if t.device.type == "cpu":
        return t.to("cpu", copy=copy)
    host = torch.empty_like(t, device="cpu")
    host.zero_()
    host.copy_(t)
    return host


def map_tree(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A nested state with ``fn`` of each tensor in it (dicts, lists and tuples rebuilt)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tree(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(v, fn) for v in tree)
    return tree


def raw_optimizer_size(state: Any) -> tuple[int, int]:
    """``(bytes, values)`` of the tensors in an optimizer state (what an uncompressed save writes)."""
    if state is None:
        return 0, 0
    _, tensors = flatten_tree(state)
    return _size(tensors.values())


def raw_optimizer_bytes(state: Any) -> int:
    """Bytes of the tensors in an optimizer state (what an uncompressed save writes)."""
    return raw_optimizer_size(state)[0]


def unique_size(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(bytes, values)`` of ``tensors``, each storage counted once (tied weights share one)."""
    return _size({t.data_ptr(): t for t in tensors}.values())


def unique_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each storage counted once (tied weights share one)."""
    return unique_size(tensors)[0]


def _size(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(bytes, values)`` of ``tensors``, every one counted."""
    nbytes = values = 0
    for t in tensors:
        nbytes, values = nbytes + t.numel() * t.element_size(), values + t.numel()
    return nbytes, values


