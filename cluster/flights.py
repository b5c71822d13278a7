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

The table also says whether new requests are admitted at all: not while draining (a
graceful shutdown, :meth:`FlightTable.begin_drain`) and not while the scheduler actor is
down (:func:`watch_scheduler`); both are refused at once with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray

from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    InvalidRequest,
    ServingError,
)

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256


@dataclass(eq=False)
class Flight:
    """One request id in flight in the frontend.

    Attributes:
        request_id: the id (the client's, or one the server made up).
        aborted: an Abort (or a shutdown) asked for it to end; checked at every stage.
        submitted: the scheduler's ``generate`` was called.
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
    """The request ids in flight, the drain switch and the scheduler's liveness.

    Args:
        id_reuse_wait_s: how long a request whose id is in flight waits for it to end
            before it is refused (seconds).
    """

    def __init__(self, id_reuse_wait_s: float = 1.0) -> None:
        self.id_reuse_wait_s = id_reuse_wait_s
        self._flights: dict[str, Flight] = {}
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
        """Register ``request_id`` as in flight.

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
                await asyncio.wait_for(old.released.wait(), self.id_reuse_wait_s)
            except TimeoutError:
                raise DuplicateRequest(f"request_id {request_id!r} is in flight") from None
            self._check_admitting()
        flight = Flight(request_id)
        self._flights[request_id] = flight
        return flight

    def release(self, flight: Flight) -> None:
        """Free the flight's id (idempotent; a newer flight with the same id is kept)."""
        if self._flights.get(flight.request_id) is flight:
            del self._flights[flight.request_id]
        flight.released.set()

    def mark_aborted(self, request_id: str) -> Flight | None:
        """Mark the flight aborted; returns it, or None when the id is not in flight or
        was aborted already."""
        flight = self._flights.get(request_id)
        if flight is None or flight.aborted:
            return None
        flight.aborted = True
        return flight

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


async def watch_scheduler(scheduler: Any, table: FlightTable, retry_s: float = 0.1) -> None:
    """Keep ``table.scheduler_up`` in line with the scheduler actor. Runs until cancelled.

    Holds one call on the actor that ends only at its shutdown (``wait_stopped``), which
    Ray fails when the actor dies, and (when the actor runs on this node) watches its
    process, which notices the death at once (Ray fails calls to an actor it restarts only
    after the restart). On a death, every request in flight ends with UNAVAILABLE, new
    requests are refused (UNAVAILABLE) instead of queueing for a restart, and the watcher
    calls ``ready`` until a restarted actor answers (it starts empty and resets the
    workers), then admits again.
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
            return  # a clean shutdown
        if stopped.done() and not stopped.cancelled():
            reason = repr(stopped.exception())
        elif exited.done() and not exited.cancelled() and exited.exception() is not None:
            reason = repr(exited.exception())
        else:
            reason = "its process exited"
        table.scheduler_up = False
        table.fail_all(ClusterUnavailable("scheduler unavailable: the scheduler actor died"))
        log.error("the scheduler actor died (%s); refusing requests until it is back", reason)
        while True:
            try:
                await asyncio.wait_for(scheduler.ready.remote(), timeout=2.0)
                break
            except asyncio.CancelledError:
                raise
            except Exception:  # dead, or still restarting
                await asyncio.sleep(retry_s)
        table.scheduler_up = True
        log.warning("the scheduler actor is back (empty); admitting requests again")


async def _await(ref: Any) -> Any:
    return await ref
