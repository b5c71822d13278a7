"""Requests in flight in the frontend: from the moment one arrives until the scheduler let go.

A request passes through stages the scheduler does not see (validation and tokenization on a
thread, the call to the scheduler actor in transit) before ``Scheduler.add_request`` runs.
An ``Abort`` or a client cancel in that window used to find nothing to abort and the
request ran later. So the frontend registers every request id here first (a
:class:`Flight`), before tokenizing: an abort at any stage marks the flight, and the
request path (:mod:`pagedserve.cluster.pipeline`) checks the mark before it calls the
scheduler and again once the scheduler has acknowledged the request (aborting it there).
A flight is released only after the scheduler has let go of the id, so a client that
cancels and reuses the id at once is not refused; a new request whose id is still in
flight waits up to ``id_reuse_wait_s`` for it to end (its cancel may still be on the way)
before it is refused with ALREADY_EXISTS.

Two RPCs are not ordered, even on one channel: an ``Abort`` sent right after its
``Generate`` can reach the server first and find nothing in flight. So an id aborted while
not in flight is remembered for a bounded time (:attr:`FlightConfig.abort_memory_s`, at
most :attr:`FlightConfig.max_remembered_ids` ids, the oldest forgotten first): a request
with that id admitted within that time starts aborted, and ends at once with ABORT
without reaching the scheduler. Released ids are remembered the same way, so an Abort
can tell "finished already" (answered False) from "not seen yet" (answered True).

The table also says whether new requests are admitted at all: not while draining (a
graceful shutdown, :meth:`FlightTable.begin_drain`) and not while the scheduler actor is
down (:func:`watch_scheduler`); both are refused at once with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    InvalidRequest,
    ServingError,
)

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class FlightConfig:
    """How the frontend tracks request ids.

    Attributes:
        id_reuse_wait_s: how long a request whose id is in flight waits for it to end
            before it is refused with ALREADY_EXISTS (seconds).
        abort_memory_s: how long an id aborted while not in flight (its Generate still on
            the way) is remembered, and how long a released id is (seconds); > 0.
        max_remembered_ids: most ids remembered of each kind (the oldest are forgotten
            first); >= 1.

    Raises:
        ValueError: a value out of range, naming the field.
    """

    id_reuse_wait_s: float = 1.0
    abort_memory_s: float = 5.0
    max_remembered_ids: int = 4096

    def __post_init__(self) -> None:
        if not self.id_reuse_wait_s >= 0:
            raise ValueError(f"id_reuse_wait_s must be >= 0, got {self.id_reuse_wait_s!r}")
        if not self.abort_memory_s > 0:
            raise ValueError(f"abort_memory_s must be > 0, got {self.abort_memory_s!r}")
        if self.max_remembered_ids < 1:
            raise ValueError(f"max_remembered_ids must be >= 1, got {self.max_remembered_ids!r}")


class RecentIds:
    """Ids remembered for ``ttl_s`` seconds, at most ``max_ids`` of them (FIFO eviction).

    Args:
        ttl_s: how long an id is remembered after :meth:`add` (seconds).
        max_ids: most ids held; adding one more forgets the oldest.
        clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(
        self, ttl_s: float, max_ids: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._clock = clock
        self._expiry: OrderedDict[str, float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._expiry)

    def __contains__(self, request_id: object) -> bool:
        self._expire()
        return request_id in self._expiry

    def add(self, request_id: str) -> None:
        """Remember ``request_id`` for ``ttl_s`` from now (again, if it was already)."""
        self._expiry.pop(request_id, None)
        self._expiry[request_id] = self._clock() + self.ttl_s
        while len(self._expiry) > self.max_ids:
            self._expiry.popitem(last=False)
        self._expire()

    def pop(self, request_id: str) -> bool:
        """Forget ``request_id``; True when it was remembered (and not expired)."""
        self._expire()
        return self._expiry.pop(request_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry:
            oldest, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[oldest]


@dataclass(eq=False)
class Flight:
    """One request id in flight in the frontend.

    Attributes:
        request_id: the id (the client's, or one the server made up).
        aborted: an Abort (or a shutdown) asked for it to end; checked at every stage.
        submitted: the request was sent to the scheduler (``add_request``).
        error: set when the request must end with this error (the scheduler died).
        outputs: the queue its consumer reads (the error is put there too).
        added: the scheduler acknowledged ``add_request`` (from then on its own abort
            reaches the request).
        released: set once the id is free again (the scheduler let go of it).
    """

    request_id: str
    aborted: bool = False
    submitted: bool = False
    added: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)
    error: ServingError | None = None
    outputs: asyncio.Queue[Any] | None = None


class FlightTable:
    """The request ids in flight, the ids aborted before they arrived, the drain switch
    and the scheduler's liveness.

    Args:
        config: id reuse wait and the memory of aborted and released ids (None: the
            defaults).
        clock: seconds, monotonic (the memory's clock).
    """

    def __init__(
        self, config: FlightConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config = config or FlightConfig()
        self._flights: dict[str, Flight] = {}
        self._aborted_early = RecentIds(config.abort_memory_s, config.max_remembered_ids, clock)
        self._released = RecentIds(config.abort_memory_s, config.max_remembered_ids, clock)
        self.draining = False
        self.scheduler_up = True

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._flights

    @property
    def serving(self) -> bool:
        """True while new requests are admitted (not draining, scheduler up)."""
        return not self.draining and self.scheduler_up

    def _check_admitting(self) -> None:
        if self.draining:
            raise ClusterUnavailable("the server is shutting down; no new requests are accepted")
        if not self.scheduler_up:
            raise ClusterUnavailable("the scheduler is unavailable (restarting or gone)")

    async def admit(self, request_id: str) -> Flight:
        """Register ``request_id`` as in flight. The flight starts aborted when an Abort of
        the id came first (within ``abort_memory_s``).

        Raises:
            ClusterUnavailable: draining, or the scheduler actor is down.
            InvalidRequest: the id is empty or too long.
            DuplicateRequest: the id is still in flight after ``id_reuse_wait_s`` seconds.
        """
        self._check_admitting()
        if not request_id:
            raise InvalidRequest("request_id must not be empty")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        while (old := self._flights.get(request_id)) is not None:
            # NOTE: a client that cancels a stream and reuses its id at once can get here
            # before its cancel reached the old stream: give the old one a moment to end.
            try:
                await asyncio.wait_for(old.released.wait(), self.config.id_reuse_wait_s)
            except TimeoutError:
                raise DuplicateRequest(f"request_id {request_id!r} is in flight") from None
            self._check_admitting()
        flight = Flight(request_id, aborted=self._aborted_early.pop(request_id))
        self._flights[request_id] = flight
        return flight

    def release(self, flight: Flight) -> None:
        """Free the flight's id (idempotent; a newer flight with the same id is kept)."""
        if self._flights.get(flight.request_id) is flight:
            del self._flights[flight.request_id]
            self._released.add(flight.request_id)
        flight.released.set()

    def mark_aborted(self, request_id: str) -> Flight | None:
        """Mark the flight aborted; returns it, or None when the id was aborted already
        or is not in flight. An id neither in flight nor released within
        ``abort_memory_s`` is remembered for that long: a request admitted with it in that
        time starts aborted. (An Abort for a request that just finished is a late one:
        remembering it would abort the next request to reuse the id.)"""
        flight = self._flights.get(request_id)
        if flight is None:
            if request_id not in self._released:
                self._aborted_early.add(request_id)
            return None
        if flight.aborted:
            return None
        flight.aborted = True
        return flight

    def recently_released(self, request_id: str) -> bool:
        """True when a flight with this id ended within ``abort_memory_s``."""
        return request_id in self._released

    def fail_all(self, error: ServingError) -> None:
        """End every request in flight with ``error`` (their consumers get it next)."""
        for flight in self._flights.values():
            flight.error = error
            if flight.outputs is not None:
                flight.outputs.put_nowait(error)

    def flights(self) -> list[Flight]:
        """The flights now in flight (a copy)."""
        return list(self._flights.values())

    def begin_drain(self) -> None:
        """Stop admitting: new requests get UNAVAILABLE from now on."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False when ``timeout_s`` seconds pass first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._flights:
            left = deadline - loop.time()
            if left <= 0:
                return False
            pending = [f.released.wait() for f in self._flights.values()]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), left)
        return True


def _process_alive(pid: int) -> bool:
    """False once process ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


async def _local_process_exit(scheduler: Any, poll_s: float) -> None:
    """Return when the scheduler actor's process exits, if it runs on this node (else
    never): Ray reports the death of an actor it restarts only once the restart is done."""
    node_id, pid = await scheduler.process_id.remote()
    if node_id != ray.get_runtime_context().get_node_id():
        await asyncio.Event().wait()
    while _process_alive(pid):
        await asyncio.sleep(poll_s)


async def watch_scheduler(
    scheduler: Any, table: FlightTable, retry_s: float = 0.1, gone_after_s: float = 10.0
) -> str:
    """Keep ``table.scheduler_up`` in line with the scheduler actor; return why the
    cluster is gone for good, or run until cancelled.

    Holds one call on the actor that ends only at its shutdown (``wait_stopped``), which
    Ray fails when the actor dies, and (when the actor runs on this node) watches its
    process, which notices the death at once (Ray fails calls to an actor it restarts only
    after the restart). On a death, every request in flight ends with UNAVAILABLE, new
    requests are refused (UNAVAILABLE) instead of queueing for a restart, and the watcher
    calls ``ready`` until a restarted actor answers (it starts empty and resets the
    workers), then admits again.

    Returns (with requests refused from then on):
        ``"the cluster stopped"`` when the actor shut down (its cluster stopped: what an
        attached frontend sees when the owning one stops), or ``"the scheduler actor
        died for good (...)"`` when Ray reports it dead with no restart left
        (``ActorDiedError`` on every call for ``gone_after_s`` seconds).
    """
    while True:
        stopped = asyncio.ensure_future(_await(scheduler.wait_stopped.remote()))
        exited = asyncio.ensure_future(_local_process_exit(scheduler, retry_s))
        try:
            await asyncio.wait({stopped, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            stopped.cancel()
        if stopped.done() and not stopped.cancelled() and stopped.exception() is None:
            table.scheduler_up = False
            table.fail_all(ClusterUnavailable("scheduler unavailable: the cluster stopped"))
            return "the cluster stopped"
        if stopped.done() and not stopped.cancelled():
            reason = repr(stopped.exception())
        elif exited.done() and not exited.cancelled() and exited.exception() is not None:
            reason = repr(exited.exception())
        else:
            reason = "its process exited"
        table.scheduler_up = False
        table.fail_all(ClusterUnavailable("scheduler unavailable: the scheduler actor died"))
        log.error("the scheduler actor died (%s); refusing requests until it is back", reason)
        gone = await _await_restart(scheduler, retry_s, gone_after_s)
        if gone is not None:
            return f"the scheduler actor died for good ({gone})"
        table.scheduler_up = True
        log.warning("the scheduler actor is back (empty); admitting requests again")


async def _await_restart(scheduler: Any, retry_s: float, gone_after_s: float) -> str | None:
    """Call ``ready`` until a restarted scheduler answers (None), or return the error when
    Ray has said the actor is dead (``ActorDiedError``, no restart left) on every call for
    ``gone_after_s`` seconds (a restarting actor queues the call instead, which times out
    and starts the count again)."""
    loop = asyncio.get_running_loop()
    dead_since: float | None = None
    while True:
        try:
            await asyncio.wait_for(scheduler.ready.remote(), timeout=2.0)
            return None
        except asyncio.CancelledError:
            raise
        except ActorDiedError as exc:
            now = loop.time()
            dead_since = now if dead_since is None else dead_since
            if now - dead_since >= gone_after_s:
                return type(exc).__name__
        except Exception:  # still restarting, or not reachable yet
            dead_since = None
        await asyncio.sleep(retry_s)


async def _await(ref: Any) -> Any:
    return await ref
