"""Thread pools that survive ``fork``.

A ``ThreadPoolExecutor`` does not: its threads do not exist in a forked child, yet the child's
copy of the executor believes they do (and its locks may be held by them), so the first job a
child submits waits forever. Forking after an encode is common: DataLoader workers and
``multiprocessing`` with the ``fork`` start method. Every pool of ours is therefore a
:class:`ForkSafePool`: the executor is created on first use, and a child forgets its parent's
(``os.register_at_fork``), so it starts its own on first use too.

Objects holding other per-process state (a :class:`~hf_dynaquant.training.background.BackgroundWorker`'s
job in flight) register with :func:`reset_after_fork` the same way.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

__all__ = [
    "ForkSafePool",
    "reset_after_fork",
    "default_workers",
    "ordered_map",
    "completed_map",
    "weighed_batches",
    "tensor_weight",
    "VALUES_IN_FLIGHT",
]

T = TypeVar("T")
# Tensor values encoded or decoded at once on a pool (``ordered_map``'s budget, each tensor
# weighed by :func:`tensor_weight`): a tensor's temporaries take about 12 bytes per value
# (float32 values, codes, the dtype's copy, the raw bytes), so this keeps them near 400 MB,
# or, beside a tensor larger than that, at its own temporaries plus a quarter of that.
VALUES_IN_FLIGHT = 1 << 25
# Items in flight when a budget bounds their memory: enough that the pool's other threads keep
# working while the caller waits on a large tensor at the head of the queue (with one more than
# the threads, a 124M model's save and restore kept 1.35 of 2 cores busy; with 64, 1.5; with
# this and done items weighed by their results (``held``), a save's writing 1.9).
_AHEAD_WITH_BUDGET = 256
U = TypeVar("U")


def tensor_weight(numel: int, itemsize: int) -> int:
    """What a tensor of ``numel`` values of ``itemsize`` bytes each weighs against
    :data:`VALUES_IN_FLIGHT`: its values, each counted ``4 / itemsize`` times (a bfloat16 value
    twice, a float64 one half). The temporaries of encoding and decoding are mostly float32 and
    codes whatever the dtype, so counted so they stay about the same share of a bfloat16
    checkpoint as of a float32 one."""
    return numel * 4 // itemsize


class _ForkAware(Protocol):
    def after_fork(self) -> None: ...


_REGISTERED: weakref.WeakSet[_ForkAware] = weakref.WeakSet()


def _reset_all() -> None:
    for obj in list(_REGISTERED):
        obj.after_fork()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork
    os.register_at_fork(after_in_child=_reset_all)


def reset_after_fork(obj: _ForkAware) -> None:
    """Call ``obj.after_fork()`` in every forked child of this process (``obj`` is held weakly)."""
    _REGISTERED.add(obj)


def default_workers() -> int:
    """Threads for a CPU-bound pool: one per core, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


class ForkSafePool:
    """A ``ThreadPoolExecutor`` created on first use and forgotten in a forked child (see the
    module docstring). ``submit``, ``map`` and ``shutdown`` are the executor's."""

    def __init__(self, name: str, max_workers: int | None = None) -> None:
        self.name, self.max_workers = name, max_workers or default_workers()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        reset_after_fork(self)

    def after_fork(self) -> None:
        # the parent's threads are gone and a lock one of them held would stay held: start afresh
        self._executor, self._lock = None, threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        """This process's executor (created now if there is none yet)."""
        executor = self._executor
        if executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=self.name)
                executor = self._executor
        return executor

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self.executor().submit(fn, *args, **kwargs)

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any]) -> Iterator[T]:
        return self.executor().map(fn, *iterables)

    def shutdown(self, wait: bool = True) -> None:
        """Stop this process's threads (a later job starts new ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait)


def ordered_map(
    pool: ForkSafePool,
    fn: Callable[[U], T],
    items: Iterable[U],
    ahead: int | None = None,
    *,
    weight: Callable[[U], int] | None = None,
    budget: int | None = None,
    held: Callable[[T], int] | None = None,
    prepare: Callable[[U], Any] | None = None,
) -> Iterator[T]:
    """``fn(item)`` for each item, in order, computed on ``pool`` with at most ``ahead`` items
    in flight (default: one more than the pool's threads, so none idles while the caller takes
    a result; with a ``budget``, :data:`_AHEAD_WITH_BUDGET`, the budget bounding the memory):
    unlike ``Executor.map``, which submits every item at once, the items (and what
    ``fn`` makes of them) are held ``ahead`` at a time, so memory stays bounded while the pool's
    threads work on several tensors at once. With ``weight`` and ``budget`` the items in flight
    also weigh at most ``budget`` together, an item heavier than three quarters of the budget
    counting as three quarters (:func:`_admitted`): what ``fn`` holds while it works grows with
    the item (a tensor's temporaries with its values), and a few of the largest tensors at once
    would otherwise set the peak. ``held`` (with a budget) weighs what a result holds once
    ``fn`` is done: an item done behind one still working at the head then counts for that
    alone (and is itself let go), so lighter items go on beside a large one instead of the pool
    idling; without it a done item keeps its weight until taken. An item that does not fit
    beside those in flight waits while lighter items after it go past it (still yielded after
    it, in order). ``items`` is consumed in the calling thread. ``prepare`` (with a budget):
    ``fn(prepare(item))`` is computed instead, ``prepare`` called in the calling thread as the
    item goes in, so that what it makes is held only once the item fits beside those in
    flight (an item that waits for room is held as it was given)."""
    results = _bounded_map(pool, fn, items, ahead, weight, budget, in_order=True, held=held, prepare=prepare)
    try:
        for _, result in results:
            yield result
    finally:  # abandoned: its pending work is cancelled now, not whenever the inner loop is collected
        results.close()


def completed_map(
    pool: ForkSafePool, fn: Callable[[U], T], items: Iterable[U], *, weight: Callable[[U], int], budget: int
) -> Iterator[tuple[U, T]]:
    """``(item, fn(item))`` for each item as soon as it is done, in the order they finish, under
    the bounds of :func:`ordered_map` with a ``budget``. For callers that take the results in
    any order (a restore loading tensors by name): a large item in front no longer holds back
    the results behind it, and so the budget they weigh, while the pool's other threads idle."""
    return _bounded_map(pool, fn, items, None, weight, budget, in_order=False)


def _admitted(w: int, budget: int) -> int:
    """What an item of weight ``w`` counts for against ``budget``: its weight, but an item heavier
    than three quarters of the budget counts as three quarters. It then runs beside lighter
    items weighing up to the last quarter (a 124M model's embedding and its two moments, each
    over the budget, each left one of two threads idle while they ran alone), but never beside
    another item over a quarter, so the temporaries in flight stay under its own plus a quarter
    of the budget (with half, a pure-bf16 124M model's delta peaked at 0.8x its checkpoint,
    against 0.6-0.7x alone and 0.7x with a quarter)."""
    return min(w, budget - budget // 4)


def _bounded_map(
    pool: ForkSafePool,
    fn: Callable[[U], T],
    items: Iterable[U],
    ahead: int | None,
    weight: Callable[[U], int] | None,
    budget: int | None,
    *,
    in_order: bool,
    held: Callable[[T], int] | None = None,
    prepare: Callable[[U], Any] | None = None,
) -> Iterator[tuple[U | None, T]]:
    """The loop of :func:`ordered_map` (``in_order``) and :func:`completed_map`: submit the
    items while the bounds allow, and take results (the oldest, or any that are done) to make
    room. In order with ``held``, an item done but not yet taken weighs ``held(result)`` and is
    no longer referenced here (``None`` is yielded in its place). With a budget, an item that
    does not fit waits while the items after it that fit beside what runs go past it, as long
    as they leave it its room once the items before it are done (so it is never starved); it
    goes in first as soon as it fits. In order, the items that went past it are yielded after
    it all the same, and at most one a thread is working or queued at once: an item's input may
    be made as it is taken from ``items``, and queued by weight the items made ahead could add
    the budget's last quarter to what runs (a save's optimizer tensors are made by ``prepare``
    instead, as they go in: see :class:`~hf_dynaquant.store.tree.DeferredTensor`). A restore's
    optimizer state takes the large embedding's two moments first, each over half the budget:
    the second waited for the first while the other threads idled (a second of one thread at
    the end of a 124M delta chain); a save's two (Adam's update and scale of the embedding) left
    one of two threads idle for 0.15 s of a 124M delta."""
    ahead = (pool.max_workers + 1 if budget is None else _AHEAD_WITH_BUDGET) if ahead is None else ahead
    if ahead < 1:
        raise ValueError(f"ahead must be at least 1, got {ahead}")
    # an item's entry: [item, weight now, whether seen done, whether it went past the waiting item,
    # its future once submitted]; ``pending`` holds the submitted ones not yet taken, ``order``
    # (in order) every one not yet taken, the waiting one too, in the items' order
    pending: dict[Future[T], list[Any]] = {}
    order: deque[list[Any]] = deque()
    load = 0
    settles = in_order and held is not None and budget is not None
    waiting: list[Any] | None = None  # the entry of the item that waits for room (with a budget)
    passed = 0  # the weight of the items that went past it (once seen done, with held: what they hold)

    def wait_any() -> None:
        """Wait until an item is done that was not seen done before (unless one is already), and
        mark every such one seen; with ``held``, each then weighs what its result holds and is
        let go here."""
        nonlocal load, passed
        if not any(future.done() and not entry[2] for future, entry in pending.items()):
            wait([future for future in pending if not future.done()], return_when=FIRST_COMPLETED)
        for future, entry in pending.items():
            if not entry[2] and future.done():
                if settles:
                    now = entry[1] if future.exception() is not None else min(entry[1], held(future.result()))
                    load -= entry[1] - now
                    passed -= entry[1] - now if entry[3] else 0
                    entry[0], entry[1] = None, now
                entry[2] = True

    def taken(future: Future[T]) -> tuple[U | None, T]:
        nonlocal load, passed
        item, w, _, past, _ = pending.pop(future)
        load -= w
        passed -= w if past else 0
        return item, future.result()

    def take(block: bool) -> Iterator[tuple[U | None, T]]:
        """Results to make room: the oldest (in order: waiting for it, or for any item to be
        done when that makes room too; the waiting item at the head goes in once it fits), else
        those done (waiting for one if ``block``)."""
        if not in_order:
            done = [f for f in pending if f.done()]
            if block and not done:
                done = list(wait(list(pending), return_when=FIRST_COMPLETED).done)
            for future in done:
                yield taken(future)
            return
        while order:
            head = order[0][4]
            if head is None:  # the waiting item, all before it taken
                if not admit_waiting():
                    if block:
                        wait_any()
                    return
                head = order[0][4]
            if not head.done():  # (waiting for any item lets a light one pass, or weighs what it holds)
                if not block:
                    return
                wait_any()
                if not head.done():
                    return
            order.popleft()
            yield taken(head)
            if block:
                return

    def passing() -> int:
        """How many items that went past the waiting one are still working or queued."""
        return sum(1 for future, entry in pending.items() if entry[3] and not future.done())

    def submit(entry: list[Any], past: bool = False) -> None:
        nonlocal load, passed
        entry[3], entry[4] = past, pool.submit(fn, entry[0] if prepare is None else prepare(entry[0]))
        pending[entry[4]] = entry
        load += entry[1]
        passed += entry[1] if past else 0

    def admit_waiting() -> bool:
        """Submit the waiting item if it fits now (the items that passed it then count as any)."""
        nonlocal waiting, passed
        if waiting is None or (pending and (len(pending) >= ahead or load + waiting[1] > budget)):
            return waiting is None
        submit(waiting)
        waiting, passed = None, 0
        for entry in pending.values():
            entry[3] = False
        return True

    try:
        for item in items:
            w = _admitted(weight(item), budget) if weight is not None and budget is not None else 0
            entry = [item, w, False, False, None]
            if in_order:
                order.append(entry)
            if budget is None:
                while pending and len(pending) >= ahead:
                    yield from take(block=True)
                submit(entry)
                yield from take(block=False)
                continue
            while True:
                if admit_waiting():
                    if not pending or (len(pending) < ahead and load + w <= budget):
                        submit(entry)
                        break
                    if len(pending) < ahead:  # it does not fit: it waits, and the next items may pass
                        waiting = entry
                        break
                # (one place in flight is left for the waiting item: those that passed it are
                # taken after it in order)
                elif (
                    len(pending) + 1 < ahead
                    and load + w <= budget
                    and passed + w + waiting[1] <= budget
                    and (not in_order or passing() < pool.max_workers)
                ):
                    submit(entry, past=True)
                    break
                yield from take(block=True)
            yield from take(block=False)
        while waiting is not None:
            if not admit_waiting():
                yield from take(block=True)
        while pending:
            yield from take(block=True)
    finally:
        for future in pending:  # a failure or an abandoned loop: no work goes on for nobody
            future.cancel()


def weighed_batches(items: Iterable[U], weight: Callable[[U], int], budget: int) -> Iterator[list[U]]:
    """``items`` in order, cut into consecutive lists that weigh at most ``budget`` together (an
    item heavier than that makes a list of its own): work done a list at a time holds one list's
    worth of memory, however many items there are."""
    batch: list[U] = []
    load = 0
    for item in items:
        w = weight(item)
        if batch and load + w > budget:
            yield batch
            batch, load = [], 0
        batch.append(item)
        load += w
    if batch:
        yield batch
