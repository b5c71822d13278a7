"""The frontend's id memory (:mod:`pagedserve.cluster.flights`): ids aborted before their
request arrived and released ids are kept for a bounded time and count."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.flights import FlightConfig, FlightTable, RecentIds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recent_ids_expire_after_the_ttl_and_evict_the_oldest_past_the_bound():
    clock = Clock()
    ids = RecentIds(ttl_s=5.0, max_ids=2, clock=clock)
    ids.add("a")
    clock.now += 1
    ids.add("b")
    ids.add("c")  # past the bound: "a", the oldest, is forgotten
    assert ("a" in ids, "b" in ids, "c" in ids, len(ids)) == (False, True, True, 2)
    clock.now += 4.5  # "b" was added 4.5 s ago, "c" too
    assert len(ids) == 2
    ids.add("b")  # remembered again from now
    clock.now += 1  # "c" is 5.5 s old, "b" 1 s
    assert ("b" in ids, "c" in ids) == (True, False)
    assert ids.pop("b") is True and ids.pop("b") is False and len(ids) == 0


def test_flight_table_starts_an_early_aborted_id_aborted_once():
    async def scenario():
        clock = Clock()
        table = FlightTable(FlightConfig(abort_memory_s=2.0, max_remembered_ids=8), clock)
        assert table.mark_aborted("x") is None  # not in flight: remembered
        flight = await table.admit("x")
        assert flight.aborted is True
        table.release(flight)
        assert table.recently_released("x")
        again = await table.admit("x")  # the memory was spent by the first
        assert again.aborted is False
        table.release(again)
        assert table.mark_aborted("y") is None
        clock.now += 2.5
        assert (await table.admit("y")).aborted is False  # forgotten after abort_memory_s
        assert not table.recently_released("x")

    asyncio.run(scenario())


def test_a_late_abort_of_a_finished_request_does_not_abort_the_next_use_of_its_id():
    async def scenario():
        table = FlightTable(FlightConfig(abort_memory_s=2.0, max_remembered_ids=8), Clock())
        first = await table.admit("x")
        table.release(first)  # finished
        assert table.mark_aborted("x") is None  # the client's cancel arrives after the end
        again = await table.admit("x")  # the client reuses the id for a new request
        assert again.aborted is False

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"id_reuse_wait_s": -1.0}, "id_reuse_wait_s"),
        ({"abort_memory_s": 0.0}, "abort_memory_s"),
        ({"max_remembered_ids": 0}, "max_remembered_ids"),
    ],
)
def test_flight_config_names_a_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FlightConfig(**kwargs)
