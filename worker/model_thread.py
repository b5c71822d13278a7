"""One thread for all of a worker's model work, so the CPU kernels keep one OpenMP team.

GNU OpenMP (libgomp, which torch and the C kernels use) keeps a team of threads per thread
that opens a parallel region. When the threads it manages outnumber the CPUs (a second
such thread, with its own team, is enough on 2 cores), every team waits at a barrier by
spinning 100 times and then sleeping in the kernel instead of spinning ~300,000 times
(libgomp's ``GOMP_SPINCOUNT`` rule), and a CPU step is hundreds of short parallel regions:
each barrier then pays a futex wake-up. Measured on the EPYC VM (2 cores, SmolLM2 bf16,
32 x 128 -> 129 greedy tokens, offline): decode steps of 34.1 ms when the model was built
and run on one thread, 39.0 ms when built on one thread and stepped on another, 34.5 ms
with both on the stepping thread.

:class:`ModelThread` is that one thread: the worker builds its model on it and runs every
call that touches the model there (steps from the step channel or from Ray, reset, the
swap probes), one at a time in the order they come.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class ModelThread:
    """A single thread that runs the calls given to :meth:`call`, one at a time.

    Args:
        name: the thread's name (``<name>_0``).
    """

    def __init__(self, name: str = "pagedserve-model") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ident = self._pool.submit(threading.get_ident).result()

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` on the model thread (directly when called from it);
        blocks until it returns and raises what it raised.

        Raises:
            RuntimeError: the thread was closed.
        """
        if threading.get_ident() == self.ident:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()

    def future(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Queue ``fn(*args, **kwargs)`` on the model thread; its future.

        Raises:
            RuntimeError: the thread was closed.
        """
        return self._pool.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue ``fn()`` to run on the model thread after the calls queued before it,
        without waiting; an exception it raises is logged.

        Raises:
            RuntimeError: the thread was closed.
        """
        self._pool.submit(fn).add_done_callback(_log_failure)

    def close(self) -> None:
        """Stop the thread once the calls queued have run (idempotent)."""
        self._pool.shutdown(wait=True)


def _log_failure(done: Future[object]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("model thread call failed", exc_info=done.exception())


__all__ = ["ModelThread"]
