"""The frontend's end of the scheduler's output stream: one stream per frontend,
demultiplexed into one local queue per request.

Every output costs CPU across the scheduler, the frontend and the transport's threads;
with one stream per request a step of 64 sequences would pay that 64 times, from the
cores the worker's matmuls run on. Here the scheduler actor sends each step's outputs for
all of this frontend's requests as one batch, and :class:`OutputRouter` puts each output
into its request's queue by tag (a number per :meth:`register` call, so late outputs of a
finished request never reach a newer request that reuses its id). The batches come over
the frontend's output channel (``transport="socket"``, the default: one TCP connection
this frontend listens on, :mod:`pagedserve.scheduler.output_channel`) or as items of a Ray
streaming generator (``"ray"``, and where the channel cannot be opened), which costs a
couple of milliseconds more CPU per step across the two processes' Ray threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import ray

from pagedserve.scheduler.engine_messages import SequenceOutput
from pagedserve.scheduler.errors import ClusterUnavailable, ServingError
from pagedserve.scheduler.output_channel import OutputChannelListener, OutputChannelReader

log = logging.getLogger(__name__)


class OutputRouter:
    """Subscribes to the scheduler actor and routes its outputs to per-request queues.

    Args:
        scheduler: the SchedulerActor handle.
        max_buffered: most outputs held for one request whose consumer has not taken
            them; past it :meth:`register`'s ``on_overflow`` is called and the request's
            queue gets ``too_slow()`` instead of outputs.
        transport: ``"socket"`` (the output channel; a Ray stream where it cannot be
            opened) or ``"ray"`` (a Ray streaming generator).
        open_timeout_s: how long opening the output channel may take (seconds), before
            a Ray stream is taken instead; keep it well under the time a request waits for
            the scheduler, which it delays.

    Raises:
        ValueError: an unknown ``transport``.
    """

    def __init__(
        self,
        scheduler: Any,
        max_buffered: int,
        transport: str = "socket",
        open_timeout_s: float = 3.0,
    ) -> None:
        if transport not in ("socket", "ray"):
            raise ValueError(f"transport must be 'socket' or 'ray', got {transport!r}")
        self.scheduler = scheduler
        self.transport = transport
        self._open_timeout_s = open_timeout_s
        # what the open subscription runs on: "socket" or "ray" (None: none open yet)
        self.subscribed_over: str | None = None
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
        task = self._task
        # NOTE: cancel until done: a cancel that lands as an awaited call completes can be
        # lost (asyncio.wait_for on Python 3.11), and the subscription would stay open.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if task is not None:
            with contextlib.suppress(BaseException):  # cancelled, or already failed
                await task

    @property
    def subscription(self) -> object | None:
        """A token of the current subscription, for :meth:`reset`."""
        return self._task

    async def reset(self, subscription: object | None) -> None:
        """End ``subscription`` (a :attr:`subscription` token) if it is still the current
        one, so the next :meth:`ensure` subscribes again: the scheduler no longer has it
        (it was restarted while the old connection looked open). Routes stay registered.
        """
        if subscription is not None and subscription is self._task:
            await self.close()

    async def _subscribe(self) -> AsyncGenerator[list[tuple[int, SequenceOutput]], None]:
        """Subscribe (returns once the scheduler has the subscription); the batches."""
        if self.transport == "socket":
            try:
                reader = await self._open_channel()
            except (ray.exceptions.RayActorError, asyncio.CancelledError):
                raise
            except Exception as exc:
                log.warning(
                    "no output channel to the scheduler (%s: %s); its outputs come as a Ray stream",
                    type(exc).__name__,
                    exc,
                )
            else:
                self.subscribed_over = "socket"
                log.info("outputs of %s on the output channel", self.subscriber)
                return reader.batches()
        stream = self.scheduler.subscribe.remote(self.subscriber)
        await (await stream.__anext__())  # the empty first item: subscribed
        self.subscribed_over = "ray"
        return _resolved(stream)

    async def _open_channel(self) -> OutputChannelReader:
        """Listen, have the scheduler connect, and return the accepted connection, all
        within ``open_timeout_s``.

        Raises:
            TimeoutError: not within ``open_timeout_s`` seconds.
            RayActorError: the scheduler actor is gone.
            Exception: the scheduler could not connect (RayTaskError) or the address
                cannot be bound.
        """
        async with asyncio.timeout(self._open_timeout_s):
            node_id, _ = await self.scheduler.process_id.remote()
            here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else node_id
            host = "127.0.0.1" if node_id == here else ray.util.get_node_ip_address()
            listener = await OutputChannelListener.open(host)
            try:
                accepted = asyncio.ensure_future(listener.accept(self._open_timeout_s))
                try:
                    await self.scheduler.attach_output_channel.remote(
                        self.subscriber, listener.address
                    )
                    return await accepted
                finally:
                    accepted.cancel()  # a no-op once it returned
            finally:
                listener.close()  # a connection accepted but not returned is closed

    async def _run(self, ready: asyncio.Future[None]) -> None:
        try:
            batches = await self._subscribe()
            ready.set_result(None)
            async with contextlib.aclosing(batches):  # a cancel ends the connection now
                async for batch in batches:
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


async def _resolved(stream: Any) -> AsyncGenerator[list[tuple[int, SequenceOutput]], None]:
    """The items of a Ray streaming generator, resolved."""
    async for ref in stream:
        yield await ref


def _as_serving_error(exc: BaseException) -> ServingError:
    """The client-facing error of a failed output stream."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, ray.exceptions.RayActorError):
        return ClusterUnavailable(
            f"scheduler unavailable: the scheduler actor died ({type(exc).__name__})"
        )
    if isinstance(exc, ConnectionError):  # the output channel ended
        return ClusterUnavailable(
            f"scheduler unavailable: the scheduler actor died or ended the output channel ({exc})"
        )
    cause = getattr(exc, "cause", exc)
    if isinstance(cause, ServingError):
        return cause
    return ClusterUnavailable(f"scheduler unavailable: {cause!r}")


__all__ = ["OutputRouter"]
