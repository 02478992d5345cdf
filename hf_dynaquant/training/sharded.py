"""Sharded checkpoints: every rank of an FSDP2 model compresses its own shard.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) each parameter is a ``DTensor`` whose rows
are split over the ranks (``Shard(0)`` on a 1-D device mesh). :class:`ShardedCompressor` writes
a DynaQuant checkpoint of such a model without ever gathering a full tensor:

* **One plan for the whole model.** The quantization plan (protection and pruning thresholds,
  K-means codebooks) comes from :class:`~hf_dynaquant.core.sketch.LogSketch` sketches. A sketch
  is a histogram of bucket counts, so the sketches of the shards merge *exactly* (counts add):
  :func:`plan_sharded` all-gathers the per-shard sketches and plans from the merged ones, first
  for the thresholds, then for each tensor's remaining (neither pruned nor protected) values,
  whose merged sketch is what the approximate K-means clusters. The plan is therefore the very
  plan :func:`~hf_dynaquant.core.quantizer.plan_quantization` makes from the full tensors, and a
  shard's codes are the rows of the full tensor's codes.
* **Each rank writes its own shard** as an ordinary store entry (reference
  ``<name>.shard-<rank>-of-<world>``), a delta on its own previous shard entry between keyframes.
  The optimizer state is encoded by :mod:`hf_dynaquant.training.optimizer_state` with
  :class:`~hf_dynaquant.training.optimizer_state.Reductions` over the ranks: an Adam update's (or SGD
  momentum's) codebook comes from the merged sketches, the fidelity check that picks its bin
  count (or lossless) from dot products and squared norms summed over the ranks, a scale's grid
  from the maximum over the ranks; so every rank decides what one process encoding the full
  optimizer state decides, and the decoded state is the same. Tensors that are not
  sharded (buffers, parameters outside ``fully_shard``) are the same on every rank: rank 0
  stores them, losslessly.
* **Rank 0 writes the index last**: an entry with no tensors whose metadata ``sharded`` lists
  the shard entries and which rows of which full tensor each holds (FORMAT.md section 12),
  under the reference ``<name>``. Until it exists the checkpoint does not exist, so a crash
  never leaves one that looks complete.
* **Loading onto any number of processes.** With the same number of ranks and the same row
  split, each rank decodes only its own shard. Otherwise every rank decodes the rows it needs
  from all the shards (re-assembling full tensors) and keeps its new slice; a plain
  single-process checkpoint (:class:`~hf_dynaquant.training.compressor.Compressor`) loads onto an FSDP2
  model the same way, and a sharded one into a plain model.
* **Configuration search in lockstep.** Under FSDP every forward pass needs every rank, so the
  search evaluates each candidate on all ranks together (each on its own evaluation data), with
  the metric averaged and the code sizes summed over the ranks: every rank takes the same
  decisions (:class:`~hf_dynaquant.search.Lockstep`).

Supported: parameters that are ``DTensor`` with placement ``Shard(0)`` on a 1-D mesh of all the
ranks (FSDP2's default); tested on CPUs with gloo (under NCCL the small collectives use the
current GPU, untested here); the store must be on a filesystem every rank sees. In a model without
DTensor parameters nothing is sharded and nothing is quantized (use ``Compressor`` there).
Other layouts (HSDP, tensor parallelism) are refused with
:class:`~hf_dynaquant.errors.UnsupportedSetupError`. Residual coding is not available here yet:
sharded checkpoints code the weights directly (``QuantConfig(residual=...)`` or an explicit
``pretrained=`` is refused; the search offers direct coding only).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import Module
from torch.optim import Optimizer

from ..core.collectives import all_gather, all_max, all_sum, barrier, rank_world
from ..core.dtypes import all_finite
from ..core.quantizer import (
    EMBEDDING,
    QuantConfig,
    QuantPlan,
    codebook_of,
    infer_layer_type,
    is_quantizable,
    layer_types,
    plan_quantization,
    refuse_or_warn_non_finite,
    remaining_sketch,
)
from ..core.ranking import GradientEMA
from ..core.sketch import SAMPLE_FROM, LogSketch, sample
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    EntryNotFoundError,
    MissingShardError,
    NonFiniteTensorWarning,
    UnsupportedSetupError,
)
from ..pipeline import MODEL
from ..search import Lockstep, SearchResult
from ..store import CheckpointStore, EntryReader
from .compressor import OPTIMIZER, CheckpointReport, Compressor, read_optimizer_state
from .optimizer_state import Reductions
from .snapshot import Snapshot, cpu_copies, cpu_tree

__all__ = [
    "ShardedCompressor",
    "ShardLayout",
    "load_sharded",
    "merge_sketches",
    "plan_sharded",
    "shard_ref",
    "open_shared_store",
    "SHARDED_FORMAT",
]

SHARDED_FORMAT = "hf_dynaquant.sharded"  # the format name (the module it was first written by)
SHARDED_VERSION = 1


def merge_sketches(sketches: Mapping[Any, LogSketch]) -> dict[Any, LogSketch]:
    """The sketches of every rank merged by key (one all-gather for all of them). Merging adds
    bucket counts, so the result equals the sketch of all the ranks' values together, exactly."""
    gathered = all_gather({key: s.to_dict() for key, s in sketches.items()})
    merged: dict[Any, LogSketch] = {}
    for part in gathered:
        for key, d in part.items():
            s = LogSketch.from_dict(d)
            merged[key] = merged[key].merge(s) if key in merged else s
    return merged


# ---------------------------------------------------------------------------------------------
# layout


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (a view of the live storage), or ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


def _check_placement(name: str, t: Any, world: int) -> None:
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    if mesh.ndim != 1 or tuple(t.placements) != (Shard(0),) or mesh.mesh.flatten().tolist() != list(range(world)):
        raise UnsupportedSetupError(
            f"tensor {name!r} is a DTensor with placements {tuple(t.placements)} on mesh {mesh.mesh.tolist()}: "
            f"sharded checkpoints support Shard(0) on a 1-D mesh of all {world} ranks (FSDP2's fully_shard default)"
        )


@dataclass
class ShardLayout:
    """Which rows of which full tensor each rank holds.

    ``tensors[name] = {"shape": full shape, "dtype": str, "rows": rows per rank}`` for a tensor
    split by rows (a ``Shard(0)`` DTensor; rank ``r`` holds rows ``sum(rows[:r])`` onwards), or
    ``"rows": None`` for a tensor that every rank holds whole (rank 0 stores it).
    """

    world: int
    tensors: dict[str, dict[str, Any]]

    @classmethod
    def of_state(cls, state: Mapping[str, torch.Tensor]) -> ShardLayout:
        """The layout of a live state dict; collective when distributed (one all-gather of the
        local row counts)."""
        rank, world = rank_world()
        sharded = [n for n, t in state.items() if _is_dtensor(t)]
        for n in sharded:
            _check_placement(n, state[n], world)
        local_rows = [local_tensor(state[n]).shape[0] for n in sharded]
        rows = np.array(all_gather(local_rows), dtype=np.int64).reshape(world, len(sharded))
        tensors = {n: {"shape": list(t.shape), "dtype": str(t.dtype), "rows": None} for n, t in state.items()}
        for i, n in enumerate(sharded):
            tensors[n]["rows"] = rows[:, i].tolist()
            if int(rows[:, i].sum()) != state[n].shape[0]:
                raise UnsupportedSetupError(
                    f"the shards of {n!r} hold {rows[:, i].tolist()} rows of {state[n].shape[0]}"
                )
        return cls(world, tensors)

    def rows(self, name: str) -> list[int] | None:
        return self.tensors[name]["rows"]

    def span(self, name: str, rank: int) -> tuple[int, int]:
        """``(first row, row count)`` of a sharded tensor's rows on ``rank``."""
        rows = self.rows(name)
        assert rows is not None
        return sum(rows[:rank]), rows[rank]

    def stores(self, name: str, rank: int) -> bool:
        """Whether ``rank``'s shard entry holds (its rows of) ``name``."""
        return self.rows(name) is not None or rank == 0

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "tensors": self.tensors}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardLayout:
        return cls(int(d["world"]), {n: dict(v) for n, v in d["tensors"].items()})


def _layer_types(model: torch.nn.Module) -> dict[str, str]:
    """:func:`~hf_dynaquant.core.quantizer.layer_types` with FSDP's wrapper classes (``FSDPLinear``)
    named after the class they wrap, so pruning groups match the unsharded model's."""
    from torch.distributed.fsdp import FSDPModule  # fully_shard makes FSDP<Class>(FSDPModule, <Class>)

    renamed = {type(m).__name__: type(m).__bases__[-1].__name__ for m in model.modules() if isinstance(m, FSDPModule)}
    return {n: renamed.get(kind, kind) for n, kind in layer_types(model).items()}


def shard_ref(name: str, rank: int, world: int) -> str:
    """The reference of one rank's shard entry of sharded checkpoint ``name``."""
    return f"{name}.shard-{rank}-of-{world}"


# ---------------------------------------------------------------------------------------------
# planning


def _rank_offsets(local: dict[Any, int]) -> dict[Any, int]:
    """Where this rank's values of each tensor begin in the flat full tensor, from how many each
    rank holds (``local``, the same keys on every rank; collective): the sum over the ranks
    before it. Shards are rows, so this is the first row's flat index."""
    before = all_gather(local)[: rank_world()[0]]
    return {key: sum(held[key] for held in before) for key in local}


def plan_sharded(
    local: Mapping[str, torch.Tensor],
    config: QuantConfig,
    *,
    shapes: Mapping[str, Iterable[int]],
    types: Mapping[str, str] | None = None,
    sensitivity: Mapping[str, torch.Tensor] | None = None,
    sketch_cache: dict | None = None,
    where: str | None = None,
    sample_weights: Mapping[str, int] | None = None,
) -> QuantPlan:
    """The plan of the full tensors, from this rank's shards ``local`` (called on every rank
    together; ``shapes`` are the full shapes, ``sensitivity`` this rank's shards of it).
    A tensor with NaN or inf in any rank's shard is left out (stored losslessly) or refused,
    as ``config.non_finite`` says (``where``, e.g. ``"step 40"``, names the checkpoint).

    Thresholds come from the magnitude (and sensitivity) sketches merged over the ranks, the
    codebook of each tensor from the merged sketch of its remaining values: the result equals
    :func:`~hf_dynaquant.core.quantizer.plan_quantization` of the full tensors, exactly.
    ``sketch_cache`` (any dict, kept across configurations of one checkpoint) holds the merged
    per-tensor sketches, which do not depend on the configuration. ``sample_weights``: see
    :func:`~hf_dynaquant.core.quantizer.plan_quantization` (the same on every rank)."""
    cache = sketch_cache if sketch_cache is not None else {}
    shapes = {n: tuple(s) for n, s in shapes.items()}
    selected = {
        n: t for n, t in local.items() if is_quantizable(torch.empty(shapes[n], dtype=t.dtype, device="meta"), config)
    }
    if (non_finite := cache.get("non-finite")) is None:  # tensors with NaN or inf on any rank: lossless
        flags = all_sum(np.array([0.0 if all_finite(t) else 1.0 for t in selected.values()]))
        flags = flags if selected else []
        non_finite = cache["non-finite"] = [n for n, flag in zip(selected, flags) if flag > 0]
        refuse_or_warn_non_finite(map(repr, non_finite), config.non_finite, where)
    selected = {n: t for n, t in selected.items() if n not in non_finite}
    kinds = {n: (types or {}).get(n) or infer_layer_type(n, shapes[n]) for n in selected}
    sens = [n for n in selected if sensitivity is not None and n in sensitivity]  # (computed when read)
    if (sens_ok := cache.get("finite sensitivity")) is None:  # NaN/inf sensitivity on any rank: magnitude everywhere
        bad = [n for n in sens if not all_finite(sensitivity[n])]
        sens_ok = cache["finite sensitivity"] = all_sum(np.array([float(bool(bad))]))[0] == 0
        if not sens_ok:
            warnings.warn(
                f"the sensitivity (|EMA(g) * w|) {f'of {bad!r} ' if bad else 'on another rank '}holds NaN or infinite "
                f"values{f' at {where}' if where else ''} (a non-finite gradient in the EMA window): pruning and "
                "protection rank by magnitude",
                NonFiniteTensorWarning,
                stacklevel=2,
            )
    if not sens_ok:
        sens, config = [], replace(config, prune_by="magnitude")  # (warned above: no second warning)
    # where this rank's rows begin in each flat full tensor: a shard samples the values of its
    # sketches (and draws stochastic rounding's random numbers) where the full tensor would
    presampled = sample_weights or {}
    if presampled and config.rounding == "stochastic":  # (a sample's rows are not the shard's)
        raise ValueError("plan_sharded: tensors given as samples are planned for nearest rounding only")
    total = {n: math.prod(shapes[n]) for n in selected}
    offsets = dict.fromkeys(selected, 0)
    if config.rounding == "stochastic" or any(t >= SAMPLE_FROM for n, t in total.items() if n not in presampled):
        offsets = _rank_offsets({n: t.numel() for n, t in selected.items()})
    wanted = {(n, "magnitude", config.alpha): (n, True) for n in selected}
    wanted.update({(n, "sensitivity", config.alpha): (n, False) for n in sens})

    def sketch(name: str, magnitude: bool) -> LogSketch:
        values = selected[name] if magnitude else sensitivity[name]
        x, weight = sample(values, total[name], offsets[name], given=presampled.get(name))
        return LogSketch(config.alpha).add(x, magnitude=magnitude, weight=weight)

    cache.update(merge_sketches({key: sketch(*how) for key, how in wanted.items() if key not in cache}))
    # the thresholds (from the merged sketches in the cache); min_numel was applied to the full
    # shapes; the codebooks come from the ranks' sketches of the remaining values, merged below
    plan = plan_quantization(
        selected,
        replace(config, min_numel=0),
        types=kinds,
        sensitivity=sensitivity if sens else None,
        sketch_cache=cache,
        sample_weights=presampled,
        codebooks=False,
    )
    rest = {
        n: remaining_sketch(
            tp,
            tp.target(selected[n]),
            tp.sensitivity_values(),
            total[n],
            offsets[n],
            weight=presampled.get(n),
        )
        for n, tp in plan.tensors.items()
    }
    for n, merged in merge_sketches(rest).items():
        tp = plan.tensors[n]
        tp.centres = codebook_of(merged, config.embedding_bins if tp.layer_type == EMBEDDING else config.bins, config)
    if config.rounding == "stochastic":  # a shard draws the random numbers of its rows of the full tensor
        for n, tp in plan.tensors.items():
            tp.dither_offset = offsets[n]
    return QuantPlan(config, plan.tensors)


# ---------------------------------------------------------------------------------------------
# the compressor


def open_shared_store(store: CheckpointStore | str | Path) -> CheckpointStore:
    """A store every rank writes to: rank 0 creates it, the others open it after."""
    if isinstance(store, CheckpointStore):
        return store
    rank = rank_world()[0]
    opened = CheckpointStore(store) if rank == 0 else None
    barrier()
    return opened or CheckpointStore(store, create=False)


class _LocalGradientEMA(GradientEMA):
    """The gradient EMA of each parameter's local shard (FSDP2 gradients are DTensors)."""

    def start(self) -> None:
        for name, p in self.params:
            if p.grad is not None:
                self._fold(name, local_tensor(p.grad).detach())
        self.steps += 1


class ShardedCompressor(Compressor):
    """DynaQuant checkpoints of an FSDP2 model, each rank compressing its own shard (see the
    module docstring). Same arguments and loop calls as :class:`~hf_dynaquant.training.compressor.Compressor`;
    :meth:`compress` and :meth:`restore` are collective (call them on every rank).

    With ``threshold`` the configuration is searched at every checkpoint in lockstep: give each
    rank its own evaluation batches (``eval_data=``) or a ``metric`` that evaluates its own data
    (the value is averaged over the ranks); every forward is collective, so every rank must run it.

    Reports (:meth:`write`) give the index entry as ``entry`` and this rank's shard's sizes.

    ``CheckpointManager(sharded_compressor).save(step)`` (every rank) writes in the background:
    the snapshot (and the search, in lockstep) in the training thread, then each rank encodes and
    writes its shard on a background thread whose collectives go through a gloo group of their
    own, made when the manager is, so they never pair up with the training's FSDP collectives.
    """

    collective_write = True

    def __init__(self, model: torch.nn.Module, store: CheckpointStore | str | Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, None, *args, **kwargs)
        if self.settings.codec != "dynaquant":
            raise UnsupportedSetupError(
                f"ShardedCompressor plans with sketches merged over the ranks, which the {self.settings.codec!r} "
                "codec does not use: sharded checkpoints take codec='dynaquant'"
            )
        if self.config.residual != "none" or self.settings.pretrained not in ("auto", None):
            raise UnsupportedSetupError(
                "ShardedCompressor codes the weights directly: residual coding (QuantConfig.residual, pretrained=) "
                "is not available for sharded models"
            )
        self.store = open_shared_store(store)
        self.ema = _LocalGradientEMA(model.named_parameters(), beta=self.ema.beta)
        self.layout: ShardLayout | None = None
        self._optimizer_sharded: dict[str, list[str]] = {}

    def _residual_wanted(self, kind: str) -> bool:
        return False  # direct coding only (see the module docstring)

    # -- snapshot ---------------------------------------------------------------------------
    def snapshot(
        self,
        step: int,
        *,
        detach_model: bool = False,
        copy: bool = True,
        metadata: Mapping[str, Any] | None = None,
    ) -> Snapshot:
        """This rank's shards copied to the CPU (collective: the row layout is gathered). The
        search, if any, evaluates the live model (every rank together), so ``detach_model`` is
        ignored; ``copy``: see :meth:`Compressor.snapshot` (a search always copies)."""
        copy = copy or self.search is not None
        rank, world = rank_world()
        live = self.model.state_dict(keep_vars=True)
        self.layout = layout = ShardLayout.of_state(live)
        param_names = {id(p): n for n, p in self.model.named_parameters()}
        # quantized: the sharded parameters; the replicated tensors go to rank 0's entry, losslessly
        params = {n: param_names[id(t)] for n, t in live.items() if id(t) in param_names and layout.rows(n) is not None}
        state = cpu_copies(((n, local_tensor(t)) for n, t in live.items() if layout.stores(n, rank)), copy=copy)
        optimizer = None
        if self.optimizer is not None and self.settings.optimizer_state != "drop":
            full = self.optimizer.state_dict()
            self._optimizer_sharded = {
                str(pid): sorted(k for k, v in entry.items() if _is_dtensor(v)) for pid, entry in full["state"].items()
            }
            optimizer = cpu_tree(full, copy=copy, local=local_tensor)
        return Snapshot(
            step=step,
            state=state,
            params=params,
            types=_layer_types(self.model),
            gradient_ema=self.ema.take(),
            optimizer=optimizer,
            model=self.model if self.search is not None else None,
            metadata={"step": step, "shard": {"rank": rank, "world": world}, **dict(metadata or {})},
        )

    # -- planning and search ------------------------------------------------------------------
    def _planning(self, snap: Snapshot) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The local shards to plan from, and their sensitivity when every rank has it."""
        weights = {n: snap.state[n] for n in snap.params}
        sens = snap.sensitivity()
        complete = sens is not None and len(sens) == len(weights)
        everywhere = all_sum(np.array([float(complete)]))[0] == rank_world()[1]  # the ranks must agree
        return weights, (sens if everywhere else None)

    def _shapes(self) -> dict[str, list[int]]:
        assert self.layout is not None, "snapshot() first"
        return {n: v["shape"] for n, v in self.layout.tensors.items()}

    def plan_snapshot(self, snap: Snapshot) -> QuantPlan:
        """The fixed configuration's plan, from sketches merged over the ranks (collective)."""
        weights, sens = self._planning(snap)
        where = f"step {snap.step}"
        return plan_sharded(
            weights, self.config, shapes=self._shapes(), types=snap.types, sensitivity=sens, where=where
        )

    def search_snapshot(self, snap: Snapshot) -> SearchResult:
        """The configuration search on the live model, every rank in lockstep (collective)."""
        if self.search is None or snap.model is None:
            raise ValueError("this ShardedCompressor has no threshold (nothing to search)")
        weights, sens = self._planning(snap)
        cache: dict = {}
        shapes, types, where = self._shapes(), snap.types, f"step {snap.step}"

        def plan(config: QuantConfig) -> QuantPlan:
            return plan_sharded(
                weights, config, shapes=shapes, types=types, sensitivity=sens, sketch_cache=cache, where=where
            )

        lockstep = Lockstep(plan=plan, all_sum=all_sum, ranks=rank_world()[1])
        return self._searched(
            self.search.search(snap.model, weights, types=types, sensitivity=sens, lockstep=lockstep, where=where)
        )

    # -- writing ----------------------------------------------------------------------------
    def write(self, snap: Snapshot, *, ref: str | None = None, **options: Any) -> CheckpointReport:
        """Write this rank's shard entry, then (rank 0, once every shard is durable) the index
        under ``ref`` (default ``step-<step>``). Collective. ``options``: those of
        :meth:`Compressor.write <hf_dynaquant.training.compressor.Compressor.write>` (``searched``, ``progress``)."""
        rank, world = rank_world()
        name = ref or f"step-{snap.step}"
        report = super().write(snap, ref=shard_ref(name, rank, world), **options)
        shards = all_gather(report.entry)  # every shard entry is durable once this returns
        index = None
        if rank == 0:
            assert self.layout is not None
            shard_meta = self.store.info(report.entry).metadata
            meta = {k: shard_meta[k] for k in ("step", "quant_config", "search", "optimizer_state") if k in shard_meta}
            meta["sharded"] = {
                "format": SHARDED_FORMAT,
                "version": SHARDED_VERSION,
                "shards": shards,
                **self.layout.to_dict(),
                "optimizer": self._optimizer_sharded if snap.optimizer is not None else None,
            }
            index = self.store.write(metadata=meta, ref=name)
        index = all_gather(index)[0]  # also: nobody returns before the index is written
        self.last_report = replace(report, entry=index)
        return self.last_report

    def optimizer_reductions(self) -> Reductions:
        """How the optimizer encoder combines the ranks' rows: plans from merged sketches, sums
        and maxima over the ranks. A parameter's state counts on every rank when it is sharded
        (each rank holds its own rows), else on rank 0 only (every rank holds the same copy)."""
        rank = rank_world()[0]
        sharded = {pid for pid, keys in self._optimizer_sharded.items() if keys}
        return Reductions(
            plan=plan_sharded,
            total=all_sum,
            maximum=all_max,
            counts=lambda pid: str(pid) in sharded or rank == 0,
            offsets=_rank_offsets,
        )

    # -- loading ----------------------------------------------------------------------------
    def restore(self, step_or_ref: int | str, model: Module | None = None, optimizer: Optimizer | None = None) -> dict:
        """Load a checkpoint (sharded, or a plain one) into this rank's shards (collective); the
        next checkpoint is a delta on this rank's shard when the row split is the same."""
        ref = f"step-{step_or_ref}" if isinstance(step_or_ref, int) else step_or_ref
        meta = load_sharded(self.store, ref, model or self.model, optimizer or self.optimizer)
        rank, world = rank_world()
        own = meta.get("sharded", {}).get("shards", [])
        same_split = meta.get("_same_split", False)
        if same_split and len(own) == world:
            self.continue_chain(own[rank])
        else:
            self._forget_chain()
        if model is None or model is self.model:
            self.resumed_from(self.store.resolve(ref))  # one rounding seed on every rank: the index's
        self.step = int(meta.get("step", self.step))
        return meta


# ---------------------------------------------------------------------------------------------
# loading


class _Shards:
    """The shard entries of a checkpoint, opened on demand, with errors naming the shard."""

    def __init__(self, store: CheckpointStore, ref: str) -> None:
        self.store, self.ref = store, ref
        self._open: dict[int, EntryReader] = {}
        index = store.open(ref)
        with index:
            self.metadata = dict(index.metadata)
            self.index_id = index.id
        info = self.metadata.get("sharded")
        if info is None:  # a plain checkpoint: one "shard" holding every tensor whole
            self.ids = [self.index_id]
            with store.open(self.index_id) as entry:
                names = entry.names(MODEL) if MODEL in entry.sections else []
                self.layout = ShardLayout(
                    1, {n: {"shape": entry.record(MODEL, n)["shape"], "rows": None} for n in names}
                )
            self.optimizer_sharded: dict[str, list[str]] = {}
            return
        if info.get("format") != SHARDED_FORMAT or info.get("version") != SHARDED_VERSION:
            raise CorruptCheckpointError(
                f"{store.path}: checkpoint {ref!r} has a sharded index of format {info.get('format')!r} version "
                f"{info.get('version')!r}; this library reads {SHARDED_FORMAT!r} version {SHARDED_VERSION}"
            )
        self.ids = list(info["shards"])
        self.layout = ShardLayout.from_dict(info)
        self.optimizer_sharded = info.get("optimizer") or {}
        if len(self.ids) != self.layout.world:
            raise CorruptCheckpointError(
                f"{store.path}: index of {ref!r} lists {len(self.ids)} shards for {self.layout.world} ranks"
            )

    def entry(self, shard: int) -> EntryReader:
        if shard not in self._open:
            try:
                self._open[shard] = self.store.open(self.ids[shard])
            except EntryNotFoundError:
                raise MissingShardError(
                    f"{self.store.path}: shard {shard} of {len(self.ids)} of checkpoint {self.ref!r} (entry "
                    f"{self.ids[shard]}, {self.store.path / 'entries' / self.ids[shard]}) is missing; the checkpoint "
                    "cannot be restored"
                ) from None
        return self._open[shard]

    def _where(self, shard: int) -> str:
        return f"shard {shard} of {len(self.ids)} of checkpoint {self.ref!r}"

    def tensor(self, shard: int, name: str) -> torch.Tensor:
        try:
            return self.entry(shard).tensor(MODEL, name)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{self._where(shard)}: {exc}") from exc

    def optimizer(self, shard: int) -> dict[str, Any]:
        entry = self.entry(shard)
        if OPTIMIZER not in entry.trees:
            raise CheckpointError(f"{self._where(shard)} holds no optimizer state")
        try:
            return read_optimizer_state(entry, self._where(shard))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{self._where(shard)}: {exc}") from exc

    def full(self, name: str) -> torch.Tensor:
        """A tensor re-assembled from every shard's rows (or rank 0's whole copy)."""
        if self.layout.rows(name) is None:
            return self.tensor(0, name)
        parts = [self.tensor(s, name) for s, rows in enumerate(self.layout.rows(name)) if rows]
        return torch.cat(parts, dim=0) if parts else torch.empty(self.layout.tensors[name]["shape"])

    def close(self) -> None:
        for entry in self._open.values():
            entry.close()


def _take_rows(full: torch.Tensor, layout: ShardLayout, name: str, rank: int) -> torch.Tensor:
    if layout.rows(name) is None:
        return full
    first, count = layout.span(name, rank)
    return full[first : first + count]


def load_sharded(
    store: CheckpointStore | str | Path,
    ref: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load checkpoint ``ref`` (sharded or plain) into ``model`` (FSDP2 or plain) and ``optimizer``
    on every rank (collective when distributed); returns the checkpoint's metadata.

    With the same number of ranks and row split each rank decodes only its own shard (and rank
    0's whole tensors); otherwise it re-assembles the tensors it needs from every shard and keeps
    its slice. The decoded values are the same either way. The returned metadata also holds
    ``_same_split`` (whether this rank read only its own shard)."""
    store = store if isinstance(store, CheckpointStore) else CheckpointStore(store, create=False)
    rank, world = rank_world()
    live = model.state_dict(keep_vars=True)
    target = ShardLayout.of_state(live)
    shards = _Shards(store, ref)
    try:
        source = shards.layout
        missing = sorted(set(live) - set(source.tensors))
        if missing:
            raise CheckpointError(f"{store.path}: checkpoint {ref!r} lacks {missing[:5]} of the model's tensors")
        for n in live:
            if list(source.tensors[n]["shape"]) != list(target.tensors[n]["shape"]):
                raise CheckpointError(
                    f"{store.path}: tensor {n!r} of checkpoint {ref!r} has shape {source.tensors[n]['shape']}, "
                    f"the model's is {target.tensors[n]['shape']}"
                )
        same = source.world == world and all(source.rows(n) == target.rows(n) for n in live)
        with torch.no_grad():
            for n, t in live.items():
                if same and source.rows(n) is not None:
                    value = shards.tensor(rank, n)  # this rank's own rows, nothing else decoded
                else:
                    value = _take_rows(shards.full(n), target, n, rank)
                local_tensor(t).copy_(value)
        if optimizer is not None:
            _load_optimizer(shards, optimizer, model, target, same, rank)
        meta = dict(shards.metadata)
        meta["_same_split"] = same
        return meta
    finally:
        shards.close()


def _load_optimizer(
    shards: _Shards,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    target: ShardLayout,
    same: bool,
    rank: int,
) -> None:
    """Decode the optimizer state of this rank's shards and load it (DTensors where the
    parameters are)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    if same:
        state = shards.optimizer(rank)
        for pid, entry in state["state"].items():
            p = params[int(pid)]
            for key in shards.optimizer_sharded.get(str(pid), []):
                entry[key] = _as_dtensor(entry[key], p)
        optimizer.load_state_dict(state)
        return
    decoded = [shards.optimizer(s) for s in range(len(shards.ids))]
    state = decoded[0]
    for pid, entry in state["state"].items():
        p = params[int(pid)]
        for key, value in entry.items():
            if key in shards.optimizer_sharded.get(str(pid), []):  # re-assembled from every shard's rows
                value = torch.cat([d["state"][pid][key] for d in decoded], dim=0)
            if _is_dtensor(p) and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape):
                value = _as_dtensor(_take_rows(value, target, names[id(p)], rank), p)
            entry[key] = value
    optimizer.load_state_dict(state)


def _as_dtensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as the shard of a DTensor laid out like parameter ``like`` (or as it is)."""
    if not _is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(like.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
