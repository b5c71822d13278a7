"""One thread for all of a worker's model work, so the CPU kernels keep one OpenMP team.

GNU OpenMP (libgomp, which torch and the C kernels use) keeps a team of threads per thread
that opens a parallel region. When the threads it manages outnumber the CPUs (a second
such thread, with its own team, is enough on 2 cores), every team waits at a barrier by
spinning 100 times and then sleeping in the kernel instead of spinning ~300,000 times
(libgomp's ``GOMP_SPINCOUNT`` rule), and a CPU step is hundreds of short parallel regions:
each barrier then pays a futex wake-up. Measured on the EPYC VM (2 cores, SmolLM2 bf16,
32 x 128 -> 129 greedy tokens, offline, overlapped; benchmarks/engine/model_thread.py):
stepped on another thread than the one that built the model, 110,000-118,000 context
switches per run and 40-48 ms decode steps; built and stepped on one thread, 1,100-1,700
and 32-40 ms.

:class:`ModelThread` is that one thread: the worker builds its model on it and runs every
call that touches the model there (reset, the swap probes, steps from Ray or from the
offline API), one at a time in the order they come. It also reads the step channel
(:mod:`pagedserve.worker.step_channel`) itself: between two calls it waits in ``select``
on the channel's socket and a wake-up socket, so a step is read, run and answered on this
thread with no hand-off, and a step sent while the previous one runs waits in the kernel's
buffer instead of waking a thread in the middle of it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class ModelThread:
    """A single thread that runs the calls given to it, in order, and serves one watched
    socket between them.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "pagedserve-model") -> None:
        self._lock = threading.Lock()
        self._calls: collections.deque[tuple[Future[Any], Callable[..., Any], tuple, dict]] = (
            collections.deque()
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._watched: tuple[socket.socket, Callable[[], bool]] | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` on the model thread (directly when called from it);
        blocks until it returns and raises what it raised.

        Raises:
            RuntimeError: the thread was closed.
        """
        if threading.get_ident() == self.ident:
            return fn(*args, **kwargs)
        return self.future(fn, *args, **kwargs).result()

    def future(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Queue ``fn(*args, **kwargs)`` on the model thread; its future.

        Raises:
            RuntimeError: the thread was closed.
        """
        done: Future[R] = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("the model thread is closed")
            self._calls.append((done, fn, args, kwargs))
        self._wake()
        return done

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue ``fn()`` on the model thread without waiting; an exception it raises is
        logged.

        Raises:
            RuntimeError: the thread was closed.
        """
        self.future(fn).add_done_callback(_log_failure)

    def watch(self, sock: socket.socket, on_readable: Callable[[], bool]) -> None:
        """From the model thread: call ``on_readable()`` there whenever ``sock`` is
        readable, between the queued calls, until it returns False (one socket at a time:
        a new one replaces the old).

        Raises:
            RuntimeError: called from another thread.
        """
        if threading.get_ident() != self.ident:
            raise RuntimeError("ModelThread.watch runs on the model thread")
        self._watched = (sock, on_readable)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread once the calls queued have run (idempotent); later calls from
        other threads raise RuntimeError."""
        with self._lock:
            self._closing = True
        self._wake()
        if threading.get_ident() != self.ident:
            self._thread.join(timeout_s)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        selector = selectors.DefaultSelector()  # epoll: no FD_SETSIZE limit
        try:
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                self._run_calls()
                with self._lock:
                    if self._closing and not self._calls:
                        return
                self._wait_and_serve(selector)
        except BaseException:
            log.exception("the model thread failed; its calls are refused from now on")
            raise
        finally:
            with self._lock:
                self._closing = True
                left = list(self._calls)
                self._calls.clear()
            for done, *_ in left:
                if done.set_running_or_notify_cancel():
                    done.set_exception(RuntimeError("the model thread stopped"))
            selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                done, fn, args, kwargs = self._calls.popleft()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, as a pool would
                done.set_exception(exc)

    def _wait_and_serve(self, selector: selectors.BaseSelector) -> None:
        watched = self._watched
        registered = [key.fileobj for key in selector.get_map().values()]
        for sock in registered:
            if sock is not self._wake_r and (watched is None or sock is not watched[0]):
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(sock)
        if watched is not None:
            if watched[0].fileno() < 0:  # closed elsewhere
                self._watched = watched = None
            elif watched[0] not in registered:
                selector.register(watched[0], selectors.EVENT_READ)
        ready = {key.fileobj for key, _ in selector.select()}
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while self._wake_r.recv(4096):
                    pass
        if watched is not None and watched[0] in ready and self._watched is watched:
            keep = False
            try:
                keep = watched[1]()
            except Exception:
                log.exception("the watched socket's handler failed; no longer watched")
            if not keep and self._watched is watched:
                self._watched = None
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(watched[0])


def _log_failure(done: Future[object]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("model thread call failed", exc_info=done.exception())


__all__ = ["ModelThread"]
