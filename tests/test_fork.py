"""Our thread pools survive ``fork``: a forked child (a DataLoader worker, a multiprocessing
user) can encode, decode and sketch after the parent has used every pool."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from hf_dynaquant.codecs import MemoryBlobs, get_codec
from hf_dynaquant.codecs.lossless import CHUNK
from hf_dynaquant.core.dtypes import to_raw
from hf_dynaquant.core.sketch import LogSketch
from hf_dynaquant.training.background import BackgroundWorker

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")

# how long a child may take before it counts as hung (it needs well under a second)
HANG = 120
# a background worker made before the fork, kept alive across it as a Trainer callback's is
WORKERS: list[BackgroundWorker] = []


def _lossless_roundtrip(t: torch.Tensor) -> bool:
    codec = get_codec("lossless")
    raw = to_raw(t)
    enc = codec.encode(raw)
    assert len(enc.blobs) > 1  # several chunks: the pool did the work
    out = codec.decode(raw.dtype, raw.shape, enc.params, MemoryBlobs(enc.blobs, "test"))
    return bool(np.array_equal(out.bits, raw.bits))


def _use_every_pool() -> None:
    """Encode, decode and sketch enough values that every pool runs jobs, and use a worker."""
    t = torch.randn(3 * CHUNK)
    assert _lossless_roundtrip(t)
    assert LogSketch().add(t).count == t.numel()
    worker = BackgroundWorker("test-fork")
    worker.submit("job", lambda: 1)
    assert worker.wait() == 1
    WORKERS.append(worker)


def _child(queue: multiprocessing.Queue) -> None:
    # numpy values: torch's own OpenMP threads do not survive fork either (DataLoader workers
    # set torch.set_num_threads(1) for that); here only our pools are under test
    t = torch.from_numpy(np.random.default_rng(1).standard_normal(3 * CHUNK, dtype=np.float32))
    worker = WORKERS[-1]
    worker.submit("child job", lambda: 2)
    fresh = BackgroundWorker("test-fork-child")
    fresh.submit("fresh job", lambda: 3)
    queue.put((_lossless_roundtrip(t), LogSketch().add(t).count == t.numel(), worker.wait(), fresh.wait()))


def test_pools_work_in_a_forked_child() -> None:
    _use_every_pool()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    child.join(HANG)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung, "the forked child hung in an encode, decode, sketch or background job"
    assert child.exitcode == 0
    assert queue.get(timeout=10) == (True, True, 2, 3)
    WORKERS.pop().close()


def test_ordered_map_keeps_order_and_bounds_what_is_in_flight() -> None:
    """Results come in order; at most ``ahead`` items run at once, and with a weight budget the
    items running weigh at most the budget together, where one heavier than three quarters of
    the budget counts as three quarters: it runs beside light ones, never beside another over a
    quarter."""
    import threading
    import time

    from hf_dynaquant.core.pool import ForkSafePool, ordered_map

    pool = ForkSafePool("test-ordered", max_workers=4)
    lock, running, peaks = threading.Lock(), {}, []

    def work(item: tuple[int, int]) -> int:
        with lock:
            running[item[0]] = item[1]
            peaks.append(sorted(running.values()))
        time.sleep(0.01)
        with lock:
            del running[item[0]]
        return item[0]

    items = [(i, w) for i, w in enumerate([1, 1, 5, 1, 1, 9, 1, 2, 2, 2, 6, 7])]
    try:
        assert list(ordered_map(pool, work, items, ahead=3)) == list(range(12))
        assert max(len(p) for p in peaks) <= 3
        peaks.clear()
        out = list(ordered_map(pool, work, items, weight=lambda it: it[1], budget=8))
        assert out == list(range(12))
        for weights in peaks:
            assert len([w for w in weights if w > 2]) <= 1  # the 5, the 9, the 6 and the 7 never together
            assert sum(min(w, 6) for w in weights) <= 8  # the 9 and the 7 count as 6 of the 8
        assert any(len(p) > 1 and max(p) > 6 for p in peaks)  # and run beside light ones
    finally:
        pool.shutdown()


def test_completed_map_gives_results_as_they_finish_under_the_same_bounds() -> None:
    """Each item once, with its result, as soon as it is done: a slow item at the head holds
    back neither the results behind it nor, through their weight, the items after them."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, completed_map

    pool = ForkSafePool("test-completed", max_workers=2)
    release, lock, running, peak = threading.Event(), threading.Lock(), [0], [0]

    def work(item: tuple[int, int]) -> int:
        with lock:
            running[0] += item[1]
            peak[0] = max(peak[0], running[0])
        if item[0] == 0:
            release.wait(timeout=10)
        with lock:
            running[0] -= item[1]
        return -item[0]

    items = [(0, 3)] + [(i, 2) for i in range(1, 21)]
    seen = []
    try:
        for item, result in completed_map(pool, work, items, weight=lambda it: it[1], budget=8):
            assert result == -item[0]
            seen.append(item[0])
            if len(seen) == 15:  # fifteen results behind the head, each light ones' weight reused
                release.set()
        assert sorted(seen) == list(range(21)) and seen.index(0) >= 15
        assert peak[0] <= 8
    finally:
        release.set()
        pool.shutdown()


def test_completed_map_lets_light_items_pass_a_heavy_one_that_waits_and_never_starves_it() -> None:
    """In any order with a budget, a heavy item that does not fit beside a heavy one running
    waits while light items after it go past (a restore's two large moments, each over half the
    budget, left a thread idle while the second waited for the first); once the first is done
    it goes in before any more light ones, and what runs never weighs more than the budget."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, completed_map

    pool = ForkSafePool("test-passing", max_workers=2)
    release, lock = threading.Event(), threading.Lock()
    running, peak, started = [0], [0], []

    def work(item: tuple[int, int]) -> int:
        with lock:
            started.append(item[0])
            running[0] += min(item[1], 6)  # (what the budget counts an item over three quarters as)
            peak[0] = max(peak[0], running[0])
        if item[0] == 0:
            release.wait(timeout=10)
        with lock:
            running[0] -= min(item[1], 6)
            if item[0] == 0:
                started.append(-1)  # (the first heavy one done)
        return item[0]

    items = [(0, 7), (1, 7)] + [(i, 1) for i in range(2, 40)]
    seen: list[int] = []
    try:
        for item, result in completed_map(pool, work, items, weight=lambda it: it[1], budget=8):
            assert result == item[0]
            seen.append(item[0])
            if len(seen) == 6:  # six light items went past the waiting heavy one
                release.set()
        assert sorted(seen) == list(range(40)) and seen.index(0) >= 6 and 1 not in seen[:6]
        # next in once the first heavy one is done: at most the two light ones that may pass it at
        # once (and as many more while the first one's result is on its way) start in between
        assert started.index(1) - started.index(-1) <= 5
        assert peak[0] <= 8
    finally:
        release.set()
        pool.shutdown()


def test_ordered_map_lets_light_items_pass_a_heavy_one_that_waits_and_keeps_the_order() -> None:
    """In order with a budget, a heavy item that does not fit beside a heavy one running waits
    while light items after it go past (a save's two large Adam tensors of the embedding left a
    thread idle while the second waited for the first); the results still come in the items'
    order, the waiting item goes in once the first is done, and what runs never weighs more
    than the budget. With ``held``, light items done behind it weigh what they hold, so more of
    them pass than the budget's last quarter."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, ordered_map

    def run(pool: ForkSafePool, held, passing: int) -> None:
        release, lock = threading.Event(), threading.Lock()
        running, peak, started, finished = [0], [0], [], [0]

        def work(item: tuple[int, int]) -> int:
            with lock:
                started.append(item[0])
                running[0] += min(item[1], 6)  # (what the budget counts an item over three quarters as)
                peak[0] = max(peak[0], running[0])
            if item[0] == 0:  # the first heavy one: done once enough light items are (or at the timeout)
                release.wait(timeout=2)
            with lock:
                running[0] -= min(item[1], 6)
                if item[0] == 0:
                    started.append(-1)  # (the first heavy one done)
                elif item[0] > 1:
                    finished[0] += 1
                    if finished[0] == passing:
                        release.set()
            return item[0]

        items = [(0, 7), (1, 7)] + [(i, 1) for i in range(2, 40)]
        out = list(ordered_map(pool, work, items, weight=lambda it: it[1], budget=8, held=held))
        assert out == list(range(40))
        assert release.is_set()  # (not the timeout): that many light items went past the waiting one
        assert started.index(-1) > passing and started.index(1) > started.index(-1)
        assert peak[0] <= 8

    pool = ForkSafePool("test-ordered-passing", max_workers=2)
    try:
        run(pool, lambda result: 0, 12)
        run(pool, None, 2)
    finally:
        pool.shutdown()


def test_ordered_map_prepares_an_item_only_as_it_goes_in() -> None:
    """With ``prepare``, each item is prepared in the calling thread as it goes in, and ``fn``
    gets what it made: a heavy item waiting for room beside a heavy one is not prepared until
    that one is done (a save makes its optimizer tensors so: made while waiting, a pure-bf16
    embedding's float32 scale was held beside its update)."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, ordered_map

    first_done, prepared = threading.Event(), []
    caller = threading.current_thread()

    def prepare(item: tuple[int, int]) -> tuple[int, int, str]:
        assert threading.current_thread() is caller
        prepared.append((item[0], first_done.is_set()))
        return (*item, "prepared")

    def work(item: tuple[int, int, str]) -> int:
        assert item[2] == "prepared"
        if item[0] == 0:
            first_done.wait(timeout=0.2)  # (light items pass the waiting heavy one meanwhile)
            first_done.set()
        return item[0]

    items = [(0, 7), (1, 7)] + [(i, 1) for i in range(2, 10)]
    pool = ForkSafePool("test-ordered-prepare", max_workers=2)
    try:
        out = list(ordered_map(pool, work, items, weight=lambda it: it[1], budget=8, held=lambda r: 0, prepare=prepare))
    finally:
        pool.shutdown()
    assert out == list(range(10))
    assert sorted(i for i, _ in prepared) == list(range(10))
    assert dict(prepared)[1] and not dict(prepared)[0]  # the waiting heavy item: prepared once the first was done


def test_ordered_map_takes_items_past_a_waiting_one_only_as_threads_free_up() -> None:
    """In order, the items that go past a waiting one are taken from ``items`` (where a save makes
    its optimizer tensors) one a thread at most, however much of the budget they leave free:
    taken ahead by weight, the items made early could add the budget's last quarter to a save's
    peak."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, ordered_map

    pool = ForkSafePool("test-ordered-ahead", max_workers=2)
    release, lock = threading.Event(), threading.Lock()
    taken, finished, ahead = [0], [0], []

    def items():
        for item in [(0, 70), (1, 70)] + [(i, 1) for i in range(2, 30)]:
            with lock:
                taken[0] += 1
                if not release.is_set():
                    ahead.append(taken[0] - finished[0])
            yield item

    def work(item: tuple[int, int]) -> int:
        if item[0] == 0:
            release.wait(timeout=2)
        with lock:
            finished[0] += 1
            if finished[0] == 10:
                release.set()
        return item[0]

    try:
        out = list(ordered_map(pool, work, items(), weight=lambda it: it[1], budget=80, held=lambda r: 0))
        assert out == list(range(30))
        assert release.is_set() and finished[0] == 30
        # the two heavy ones, the two that passed (a thread's, and one ready for it), the one in hand
        assert max(ahead) <= 5
    finally:
        pool.shutdown()


def test_a_slow_item_at_the_head_leaves_the_other_threads_working() -> None:
    """With a budget, items behind a slow one keep running on the other threads while the
    caller waits for it (the budget, not a count of one more than the threads, bounds them)."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, ordered_map

    pool = ForkSafePool("test-ahead", max_workers=2)
    finished, lock, done = [0], threading.Lock(), threading.Event()

    def work(item: tuple[int, int]) -> bool:
        if item[0] == 0:  # the head: done only once eight items behind it are
            return done.wait(timeout=10)
        with lock:
            finished[0] += 1
            if finished[0] == 8:
                done.set()
        return True

    items = [(0, 50)] + [(i, 1) for i in range(1, 11)]
    try:
        assert all(ordered_map(pool, work, items, weight=lambda it: it[1], budget=100))
    finally:
        pool.shutdown()


def test_items_done_behind_a_slow_head_weigh_what_their_results_hold() -> None:
    """In order, with ``held``: an item done while a heavy one still works at the head weighs
    what its result holds (here nothing), so the light items behind go on under the budget
    until the head is done; without ``held`` they keep their weight and stop once the budget is
    spent. The items running never weigh more than the budget."""
    import threading

    from hf_dynaquant.core.pool import ForkSafePool, ordered_map

    def run(pool: ForkSafePool, held, timeout: float) -> tuple[list[bool], int]:
        finished, lock, done, running, peak = [0], threading.Lock(), threading.Event(), [0], [0]

        def work(item: tuple[int, int]) -> bool:
            with lock:
                running[0] += min(item[1], 6)
                peak[0] = max(peak[0], running[0])
            if item[0] == 0:  # the head: done once six light items behind it are (or at the timeout)
                ok = done.wait(timeout=timeout)
            else:
                with lock:
                    finished[0] += 1
                    if finished[0] == 6:
                        done.set()
                ok = True
            with lock:
                running[0] -= min(item[1], 6)
            return ok

        items = [(0, 7)] + [(i, 2) for i in range(1, 11)]
        return list(ordered_map(pool, work, items, weight=lambda it: it[1], budget=8, held=held)), peak[0]

    pool = ForkSafePool("test-held", max_workers=3)  # three threads: the budget, not the threads, bounds them
    try:
        for held, timeout, expect in ((lambda result: 0, 10.0, True), (None, 1.0, False)):
            results, peak = run(pool, held, timeout)
            assert results[0] is expect and all(results[1:]) and len(results) == 11
            assert peak <= 8
    finally:
        pool.shutdown()


def test_weighed_batches_cut_in_order_under_the_budget() -> None:
    from hf_dynaquant.core.pool import weighed_batches

    items = [1, 1, 5, 1, 1, 9, 1, 2, 2, 2]
    batches = list(weighed_batches(items, lambda w: w, 4))
    assert [w for b in batches for w in b] == items  # every item, in order
    assert batches == [[1, 1], [5], [1, 1], [9], [1, 2], [2, 2]]  # a heavy item alone
    assert list(weighed_batches([], lambda w: w, 4)) == []


def test_freed_memory_is_released_every_so_many_values(monkeypatch) -> None:
    import platform

    from hf_dynaquant.core import memory

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert memory._TRIM is not None  # glibc's malloc_trim, found
        memory.ReleaseFreed(every=1).processed(1)  # the real call returns normally
    calls: list[int] = []
    monkeypatch.setattr(memory, "_TRIM", lambda pad: calls.append(pad) or 1)
    freed = memory.ReleaseFreed(every=10)
    for values in (3, 3, 3, 3, 9, 1, 2):
        freed.processed(values)
    assert calls == [0, 0]  # after 12 values, then after 10 more


def test_freed_memory_is_kept_while_the_resident_set_grows_within_the_allowance(monkeypatch) -> None:
    """With an allowance, a count that comes due trims only once the resident set has grown
    past it since the ReleaseFreed was made; where the resident set cannot be read, it trims as
    one without an allowance does."""
    from hf_dynaquant.core import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "_TRIM", lambda pad: calls.append(pad) or 1)
    resident: list[int | None] = [1000]
    monkeypatch.setattr(memory, "resident_bytes", lambda: resident[0])
    freed = memory.ReleaseFreed(every=10, allowance=500)
    freed.processed(10)
    resident[0] = 1500  # grown by the allowance exactly: kept
    freed.processed(10)
    assert calls == []
    resident[0] = 1501
    freed.processed(9)  # past the allowance, but not due yet
    assert calls == []
    freed.processed(1)
    freed.processed(10)
    assert calls == [0, 0]  # each count due past the allowance trims
    resident[0] = 1200  # (back under it after a trim: kept again)
    freed.processed(10)
    assert calls == [0, 0]
    resident[0] = None  # unreadable: as without an allowance
    freed.processed(10)
    assert calls == [0, 0, 0]
    resident[0] = None
    memory.ReleaseFreed(every=10, allowance=500).processed(10)  # (made while unreadable)
    assert calls == [0, 0, 0, 0]


def test_resident_bytes_reads_the_process_resident_set() -> None:
    import platform

    from hf_dynaquant.core import memory

    if platform.system() != "Linux":
        assert memory.resident_bytes() is None or memory.resident_bytes() > 0
        return
    before = memory.resident_bytes()
    touched = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page written
    after = memory.resident_bytes()
    assert before is not None and after is not None and before > 0
    assert after - before >= 48 << 20
    del touched
