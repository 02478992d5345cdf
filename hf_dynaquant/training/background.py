"""One background worker for checkpoint encoding: at most one job in flight, errors surfaced.

Training hands a snapshot to :meth:`BackgroundWorker.submit` and goes on; the worker encodes and
writes it. A second submit first waits for the job before it (so at most one checkpoint is ever
in flight and memory stays bounded), :meth:`check` re-raises a failed job's exception in the
training thread (named after the job, as a :class:`BackgroundCompressionError`), and
:meth:`wait` blocks until the worker is idle (end of training). Nothing is swallowed: a failure
is raised exactly once, at the first ``check``/``submit``/``wait`` after it happened.

The worker survives ``fork`` (:mod:`hf_dynaquant.core.pool`): a forked child starts with an
idle worker of its own; a job the parent had in flight stays the parent's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..core.pool import ForkSafePool, reset_after_fork
from ..errors import BackgroundCompressionError

__all__ = ["BackgroundWorker"]


class BackgroundWorker:
    """A single daemon thread running one job at a time (see the module docstring)."""

    def __init__(self, name: str = "hf-dynaquant") -> None:
        self._pool = ForkSafePool(name, max_workers=1)
        self._future: Future | None = None
        self._label = ""
        self._lock = threading.Lock()
        self.waited_seconds = 0.0  # time the caller spent blocked on an unfinished job
        reset_after_fork(self)

    def after_fork(self) -> None:
        # in a forked child the parent's job never finishes here (its thread is not copied)
        self._future, self._label, self._lock = None, "", threading.Lock()

    def submit(self, label: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the worker once the previous job is done (raising its error first)."""
        self.wait()
        with self._lock:
            self._label, self._future = label, self._pool.submit(fn)

    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def check(self) -> Any:
        """If the last job has finished: re-raise its error, or return its result once (else ``None``)."""
        with self._lock:
            future, label = self._future, self._label
            if future is None or not future.done():
                return None
            self._future = None
        error = future.exception()
        if error is not None:
            raise BackgroundCompressionError(f"background compression of {label} failed: {error}") from error
        return future.result()

    def wait(self) -> Any:
        """Block until the worker is idle; re-raise a failed job's error, else return its result."""
        future = self._future
        if future is not None and not future.done():
            started = time.perf_counter()
            try:
                future.exception()  # waits without raising
            finally:
                self.waited_seconds += time.perf_counter() - started
        return self.check()

    def close(self) -> None:
        """Wait for the job in flight (raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
