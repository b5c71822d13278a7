"""The frontend's scheduler watcher (:func:`pagedserve.cluster.flights.watch_scheduler`)
against a fake actor handle: a clean shutdown of the cluster and an actor Ray reports dead
for good both end the watch with a reason (so `serve` exits 1 instead of retrying
forever), a restart admits again, and requests in flight end with UNAVAILABLE."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from pagedserve.cluster.flights import FlightTable, watch_scheduler
from pagedserve.cluster.launcher import _until_stop_or_gone
from pagedserve.scheduler.errors import ClusterUnavailable


class Method:
    """``actor.method.remote()`` as a coroutine made by ``fn`` (a fresh one per call)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1
        return self.fn()


async def forever() -> None:
    await asyncio.Event().wait()


class FakeScheduler:
    def __init__(self, stopped: Callable[[], Any], ready: Callable[[], Any]) -> None:
        self.wait_stopped = Method(stopped)
        self.ready = Method(ready)
        self.process_id = Method(forever)  # never on this node's process table


async def returns(value: Any) -> Any:
    return value


async def raises(exc: BaseException) -> None:
    raise exc


def test_a_clean_shutdown_ends_the_watch_and_fails_requests_in_flight() -> None:
    async def scenario() -> tuple[str, bool, Any]:
        table = FlightTable()
        flight = await table.admit("r1")
        flight.outputs = asyncio.Queue()
        sched = FakeScheduler(stopped=lambda: returns(True), ready=lambda: returns(None))
        reason = await asyncio.wait_for(watch_scheduler(sched, table), timeout=5)
        return reason, table.scheduler_up, flight.outputs.get_nowait()

    reason, up, item = asyncio.run(scenario())
    assert reason == "the cluster stopped" and up is False
    assert isinstance(item, ClusterUnavailable) and "the cluster stopped" in str(item)


def test_an_actor_dead_for_good_ends_the_watch_after_the_grace_period() -> None:
    async def scenario() -> tuple[str, bool, int, float]:
        table = FlightTable()
        sched = FakeScheduler(
            stopped=lambda: raises(ActorDiedError()), ready=lambda: raises(ActorDiedError())
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reason = await asyncio.wait_for(
            watch_scheduler(sched, table, retry_s=0.01, gone_after_s=0.3), timeout=5
        )
        return reason, table.scheduler_up, sched.ready.calls, loop.time() - t0

    reason, up, ready_calls, elapsed = asyncio.run(scenario())
    assert reason == "the scheduler actor died for good (ActorDiedError)" and up is False
    assert elapsed >= 0.3 and ready_calls >= 2  # retried through the grace period


def test_a_restart_admits_again_and_the_watch_goes_on() -> None:
    async def scenario() -> tuple[bool, int]:
        table = FlightTable()
        stops = iter([raises(ActorDiedError()), forever()])
        readies = iter([raises(ActorDiedError()), raises(TimeoutError()), returns(None)])
        sched = FakeScheduler(stopped=lambda: next(stops), ready=lambda: next(readies))
        task = asyncio.ensure_future(watch_scheduler(sched, table, retry_s=0.01, gone_after_s=10.0))
        for _ in range(500):
            if sched.wait_stopped.calls == 2:
                break
            await asyncio.sleep(0.01)
        up = table.scheduler_up
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return up, sched.ready.calls

    up, ready_calls = asyncio.run(scenario())
    assert up is True and ready_calls == 3


def test_serve_waits_for_a_signal_or_the_cluster_gone() -> None:
    async def scenario() -> tuple[Any, Any, Any]:
        stop = asyncio.Event()
        gone = asyncio.ensure_future(returns("the cluster stopped"))
        first = await asyncio.wait_for(_until_stop_or_gone(stop, gone), timeout=5)
        stop.set()
        running = asyncio.ensure_future(forever())
        second = await asyncio.wait_for(_until_stop_or_gone(stop, running), timeout=5)
        running.cancel()
        failed = asyncio.ensure_future(raises(RuntimeError("boom")))
        stop.clear()
        third = await asyncio.wait_for(_until_stop_or_gone(stop, failed), timeout=5)
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first == "the cluster stopped" and second is None
    assert third == "the scheduler watcher failed (RuntimeError('boom'))"
