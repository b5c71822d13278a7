"""The frontend's end of the scheduler's output stream: one Ray stream per frontend,
demultiplexed into one local queue per request.

A Ray streaming-generator item costs a few hundred microseconds of CPU across the
scheduler, the frontend and Ray's own threads; with one stream per request a step of 64
sequences cost 64 of them, taken from the cores the worker's matmuls run on. Here the
scheduler actor (:meth:`SchedulerActor.subscribe`) sends each step's outputs for all of
this frontend's requests as one item, and :class:`OutputRouter` puts each output into its
request's queue by tag (a number per :meth:`register` call, so late outputs of a finished
request never reach a newer request that reuses its id).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import ray

from pagedserve.scheduler.engine_messages import SequenceOutput
from pagedserve.scheduler.errors import ClusterUnavailable, ServingError

log = logging.getLogger(__name__)


class OutputRouter:
    """Subscribes to the scheduler actor and routes its outputs to per-request queues.

    Args:
        scheduler: the SchedulerActor handle.
        max_buffered: most outputs held for one request whose consumer has not taken
            them; past it :meth:`register`'s ``on_overflow`` is called and the request's
            queue gets ``too_slow()`` instead of outputs.
    """

    def __init__(self, scheduler: Any, max_buffered: int) -> None:
        self.scheduler = scheduler
        self.subscriber = f"frontend-{uuid.uuid4().hex[:12]}"
        self._max_buffered = max_buffered
        self._tags = itertools.count(1)
        # tag -> (queue, on_overflow)
        self._routes: dict[int, tuple[asyncio.Queue[Any], Callable[[], BaseException]]] = {}
        self._ready: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def register(self, queue: asyncio.Queue[Any], on_overflow: Callable[[], BaseException]) -> int:
        """Route outputs tagged with the returned tag into ``queue``.

        ``on_overflow`` is called once when the queue would hold more than
        ``max_buffered`` outputs; the queue is then emptied and gets its return value
        (an exception for the consumer), and nothing more is routed to it.
        """
        tag = next(self._tags)
        self._routes[tag] = (queue, on_overflow)
        return tag

    def unregister(self, tag: int) -> None:
        """Stop routing to ``tag`` (idempotent)."""
        self._routes.pop(tag, None)

    async def ensure(self) -> None:
        """Open the subscription when none is open (first use, or after the scheduler
        restarted); returns once the scheduler has it.

        Raises:
            ClusterUnavailable: the scheduler actor is gone or refused.
        """
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            self._task = loop.create_task(self._run(self._ready))
        assert self._ready is not None
        await asyncio.shield(self._ready)

    async def close(self) -> None:
        """Close the subscription (the scheduler aborts what is left of its requests)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):  # cancelled, or already failed
                await self._task

    async def _run(self, ready: asyncio.Future[None]) -> None:
        try:
            stream = self.scheduler.subscribe.remote(self.subscriber)
            await (await stream.__anext__())  # the empty first item: subscribed
            ready.set_result(None)
            async for ref in stream:
                batch: list[tuple[int, SequenceOutput]] = await ref
                for tag, out in batch:
                    self._route(tag, out)
            raise ClusterUnavailable("the scheduler closed its output stream")
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(ClusterUnavailable("the frontend is shutting down"))
            raise
        except Exception as exc:  # every waiting request learns of it: none hangs
            err = _as_serving_error(exc)
            log.warning("output stream from the scheduler failed: %s", err)
            if not ready.done():
                ready.set_exception(err)
                ready.exception()  # retrieved: no "never retrieved" warning
            for queue, _ in list(self._routes.values()):
                queue.put_nowait(err)
            self._routes.clear()

    def _route(self, tag: int, out: SequenceOutput) -> None:
        route = self._routes.get(tag)
        if route is None:
            return  # its request ended here already (finished, aborted, cancelled)
        queue, on_overflow = route
        if queue.qsize() >= self._max_buffered:
            del self._routes[tag]
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(on_overflow())
            return
        queue.put_nowait(out)


def _as_serving_error(exc: BaseException) -> ServingError:
    """The client-facing error of a failed output stream."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, ray.exceptions.RayActorError):
        return ClusterUnavailable(
            f"scheduler unavailable: the scheduler actor died ({type(exc).__name__})"
        )
    cause = getattr(exc, "cause", exc)
    if isinstance(cause, ServingError):
        return cause
    return ClusterUnavailable(f"scheduler unavailable: {cause!r}")


__all__ = ["OutputRouter"]
