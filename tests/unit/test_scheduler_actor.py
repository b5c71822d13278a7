"""SchedulerActor logic without a Ray cluster: fake worker handles, real asyncio loops.

Requests go in as the frontend sends them (``subscribe`` + ``add_request``, through
:class:`helpers.ActorStreams`). Covers request-id reuse after a cancel (a stale stream
must not get the new request's outputs), a worker that dies (its sequences are recomputed
elsewhere; with none left, every request is aborted and new ones are refused), a worker
that raises on a step, a worker past its step deadline (requeued, back after the probe), a
start with workers dead or silent (served by the others), and routing across two workers
(cached prefixes, an even burst, no idle worker while work waits).
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from helpers import ActorStreams, ScriptedWorker

from pagedserve.scheduler.actor import SchedulerActor
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import ClusterUnavailable, DuplicateRequest
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import WorkerSpec


class Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class FakeHandle:
    """Looks like a Ray actor handle of a Worker: ``execute_model.remote(so)`` is awaitable."""

    def __init__(self, fail: Exception | None = None, fail_after: int = 0) -> None:
        self.inner = ScriptedWorker()
        self.fail = fail
        self.fail_after = fail_after
        self.steps = 0
        self.dead = False
        self.admitted: list[str] = []  # seq ids sent to this worker as new
        self.resets = 0
        self.execute_model = Remote(self._execute)
        self.ping = Remote(self._ping)
        self.reset = Remote(self._reset)

    async def _reset(self):
        if self.dead:
            raise ray.exceptions.RayActorError()
        self.resets += 1
        self.inner = ScriptedWorker()

    async def _ping(self):
        if self.dead:
            raise ray.exceptions.RayActorError()
        return "pong"

    async def _execute(self, so):
        await asyncio.sleep(0.001)
        self.steps += 1
        self.admitted.extend(n.seq_id for n in so.new_seqs)
        if self.fail is not None and self.steps > self.fail_after:
            if isinstance(self.fail, ray.exceptions.RayActorError):
                self.dead = True  # its pings fail too, until "Ray restarts" it
            raise self.fail
        return self.inner.execute(so)


def make_actor(handles, num_blocks=32, block_size=4, budget=64, max_len=256, **kw):
    specs = [WorkerSpec(i, num_blocks, block_size) for i in range(len(handles))]
    return SchedulerActor(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_len, **kw),
        handles,
        specs,
        probe_interval_s=0.05,
        step_channel=False,  # the fakes take steps as Ray calls (test_step_channel.py)
    )


def greedy(n_tokens, **kw):
    return SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(gen):
    out = []
    async for batch in gen:
        out.extend(batch)
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_reused_request_id_after_cancel_gets_its_own_stream():
    async def scenario():
        actor = make_actor([FakeHandle()])
        gen = ActorStreams(actor).generate
        old = gen("same", [1, 2, 3], greedy(50))
        first = await old.__anext__()
        assert first[0].new_token_ids == (103,)
        assert await actor.abort("same") is True  # the client cancelled
        new = gen("same", [1, 2, 3], greedy(3))
        pending = asyncio.ensure_future(new.__anext__())  # adds the request again
        await asyncio.sleep(0)
        rest = await collect(old)  # the stale stream finishes after the new one started
        assert rest[-1].finish_reason is FinishReason.ABORT
        items = [*(await pending), *(await collect(new))]
        toks = [t for o in items for t in o.new_token_ids]
        assert toks == [103, 104, 105]
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_duplicate_in_flight_id_is_refused():
    async def scenario():
        actor = make_actor([FakeHandle()])
        gen = ActorStreams(actor).generate
        a = gen("dup", [1, 2], greedy(20))
        assert (await a.__anext__())[0].new_token_ids == (102,)  # added and running
        with pytest.raises(DuplicateRequest):
            await gen("dup", [1, 2], greedy(2)).__anext__()
        await actor.abort("dup")
        await collect(a)
        await actor.shutdown()

    run(scenario())


def test_dead_worker_sequences_are_recomputed_on_a_live_one():
    async def scenario():
        dead = FakeHandle(fail=ray.exceptions.RayActorError(), fail_after=2)
        live = FakeHandle()
        actor = make_actor([dead, live])
        gen = ActorStreams(actor).generate
        streams = [gen(f"r{i}", [1, 2, 3, i + 5], greedy(6)) for i in range(4)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for res in results:
            assert res[-1].finish_reason is FinishReason.LENGTH
            toks = [t for o in res for t in o.new_token_ids]
            assert toks == [104, 105, 106, 107, 108, 109]
        stats = await actor.get_stats()
        assert [w.alive for w in stats.workers] == [False, True]
        assert await actor.num_live_workers() == 1
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_last_worker_dying_aborts_everything_and_refuses_new_requests():
    async def scenario():
        actor = make_actor([FakeHandle(fail=ray.exceptions.RayActorError(), fail_after=1)])
        gen = ActorStreams(actor).generate
        config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)
        actor._scheduler.config = config  # one running, the rest waiting
        streams = [gen(f"r{i}", [1, 2, 3], greedy(10)) for i in range(3)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert all(r[-1].finish_reason is FinishReason.ABORT for r in results)
        with pytest.raises(ClusterUnavailable):
            await gen("late", [1], greedy(1)).__anext__()
        assert await actor.num_live_workers() == 0
        await actor.shutdown()

    run(scenario())


def test_step_error_aborts_that_batch_and_worker_keeps_serving():
    async def scenario():
        handle = FakeHandle(fail=ValueError("bad step"), fail_after=1)
        actor = make_actor([handle])
        gen = ActorStreams(actor).generate
        res = await collect(gen("a", [1, 2, 3], greedy(5)))
        assert res[-1].finish_reason is FinishReason.ABORT
        handle.fail = None
        res = await collect(gen("b", [1, 2, 3], greedy(2)))
        assert [t for o in res for t in o.new_token_ids] == [103, 104]
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_idle_worker_death_is_noticed_by_the_probe():
    async def scenario():
        handles = [FakeHandle(), FakeHandle()]
        actor = make_actor(handles)
        gen = ActorStreams(actor).generate
        await actor.ready()
        handles[0].dead = True
        for _ in range(100):
            if await actor.num_live_workers() == 1:
                break
            await asyncio.sleep(0.02)
        assert [w.alive for w in (await actor.get_stats()).workers] == [False, True]
        res = await collect(gen("a", [1, 2, 3], greedy(2)))
        assert [t for o in res for t in o.new_token_ids] == [103, 104]
        assert handles[0].steps == 0
        handles[1].dead = True
        for _ in range(100):
            if await actor.num_live_workers() == 0:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ClusterUnavailable):
            await gen("b", [1], greedy(1)).__anext__()
        await actor.shutdown()

    run(scenario())


def test_concurrent_requests_sharing_a_cached_system_prompt_hit_it():
    async def scenario():
        handles = [FakeHandle(), FakeHandle()]
        actor = make_actor(handles, num_blocks=64, block_size=16, budget=1024, max_len=1024)
        gen = ActorStreams(actor).generate
        system = list(range(1000, 1000 + 20 * 16))  # 20 full blocks
        await collect(gen("first", [*system, 1, 2, 3], greedy(2)))
        streams = [gen(f"r{i}", [*system, 7, i, 9], greedy(4)) for i in range(6)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert [r[-1].num_cached_tokens for r in results] == [320] * 6
        assert sorted(handles[0].admitted) == sorted(["first/0"] + [f"r{i}/0" for i in range(6)])
        assert handles[1].admitted == []
        stats = await actor.get_stats()
        assert [w.prefix_cache_hit_rate for w in stats.workers] == [6 * 320 / (7 * 323), 0.0]
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_burst_of_unrelated_requests_is_split_between_workers():
    async def scenario():
        handles = [FakeHandle(), FakeHandle()]
        actor = make_actor(handles)
        gen = ActorStreams(actor).generate
        streams = [gen(f"u{i}", [9 * i + 1, 2, 3, 4], greedy(5)) for i in range(8)]
        await asyncio.gather(*(collect(s) for s in streams))
        assert sorted(len(h.admitted) for h in handles) == [4, 4]
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


@pytest.mark.parametrize("admission", ["fits-now", "projected"])
def test_polled_stats_show_no_worker_idle_while_work_waits(admission):
    """2 workers of 12 blocks, 8 concurrent long/short requests (pools under pressure):
    admitted by current need they preempt; by projected growth they wait, and an idle
    worker steals what the busy one's projection refuses."""

    async def scenario():
        handles = [FakeHandle(), FakeHandle()]
        actor = make_actor(handles, num_blocks=12, block_size=16, budget=2048, admission=admission)
        gen = ActorStreams(actor).generate
        prefix = list(range(500, 516))
        lens = [170, 8, 170, 8, 170, 8, 150, 8]
        streams = [gen(f"p{i}", [*prefix, i, 1, 2, 3], greedy(n)) for i, n in enumerate(lens)]
        gathered = asyncio.gather(*(collect(s) for s in streams))
        polls = idle = 0
        while not gathered.done():
            st = await actor.get_stats()
            polls += 1
            if st.num_waiting and any(w.num_running == 0 for w in st.workers):
                idle += 1
            await asyncio.sleep(0.0005)
        results = await gathered
        assert [r[-1].num_output_tokens for r in results] == lens
        assert polls > 50
        # NOTE: the wake-up of an idle worker is queued before the poller's timer fires,
        # so a poll never sees the turn between a step that freed blocks and that wake-up.
        assert idle == 0
        preemptions = (await actor.get_stats()).num_preemptions
        assert (preemptions > 0) is (admission == "fits-now")
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_restarted_worker_rejoins_with_an_empty_pool():
    """A worker that died mid-generation (its sequences recomputed on the other one)
    answers again once Ray restarted it: it is reset, gets a fresh pool and new work."""

    async def scenario():
        handles = [FakeHandle(fail=ray.exceptions.RayActorError(), fail_after=2), FakeHandle()]
        actor = make_actor(handles)
        gen = ActorStreams(actor).generate
        streams = [gen(f"r{i}", [1, 2, 3, i + 5], greedy(6)) for i in range(4)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for res in results:
            assert [t for o in res for t in o.new_token_ids] == [104, 105, 106, 107, 108, 109]
        assert [w.alive for w in (await actor.get_stats()).workers] == [False, True]
        assert handles[0].resets == 1  # at start, by ready()
        handles[0].fail = None  # Ray restarted the actor
        handles[0].dead = False
        for _ in range(200):
            if await actor.num_live_workers() == 2:
                break
            await asyncio.sleep(0.01)
        stats = await actor.get_stats()
        assert [w.alive for w in stats.workers] == [True, True]
        assert stats.workers[0].num_free_blocks == stats.workers[0].num_blocks == 32
        assert handles[0].resets == 2  # once more before it rejoined
        handles[0].admitted.clear()
        streams = [gen(f"u{i}", [9 * i + 1, 2, 3, 4], greedy(3)) for i in range(8)]
        await asyncio.gather(*(collect(s) for s in streams))
        assert len(handles[0].admitted) == 4  # it is routed to again
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_wait_stopped_returns_at_shutdown():
    async def scenario():
        actor = make_actor([FakeHandle()])
        await actor.ready()
        waiter = asyncio.ensure_future(actor.wait_stopped())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await actor.shutdown()
        assert await asyncio.wait_for(waiter, 1) is True

    run(scenario())


class SerialHandle(FakeHandle):
    """A FakeHandle that runs its calls one at a time, as a Ray actor with
    ``max_concurrency=1`` does (a ping queues behind a step), and whose step ``slow_step``
    answers ``delay_s`` late."""

    def __init__(self, slow_step: int, delay_s: float) -> None:
        super().__init__()
        self.lock = asyncio.Lock()
        self.slow_step = slow_step
        self.delay_s = delay_s
        inner_execute, inner_ping, inner_reset = self._execute, self._ping, self._reset

        async def execute(so):
            async with self.lock:
                out = await inner_execute(so)
                if self.steps == self.slow_step:
                    await asyncio.sleep(self.delay_s)
                return out

        async def serial(fn):
            async with self.lock:
                return await fn()

        self.execute_model = Remote(execute)
        self.ping = Remote(lambda: serial(inner_ping))
        self.reset = Remote(lambda: serial(inner_reset))


def test_a_worker_past_its_step_deadline_is_requeued_and_rejoins_after_the_probe():
    async def scenario():
        handles = [SerialHandle(slow_step=3, delay_s=0.6), FakeHandle()]
        specs = [WorkerSpec(i, 32, 4) for i in range(2)]
        cfg = SchedulerConfig(
            max_num_batched_tokens=64,
            max_model_len=256,
            routing="round-robin",
            step_deadline_floor_s=0.15,
        )
        actor = SchedulerActor(cfg, handles, specs, probe_interval_s=0.05, step_channel=False)
        gen = ActorStreams(actor).generate
        streams = [gen(f"r{i}", [1, 2, 3, i + 5], greedy(6)) for i in range(4)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for res in results:  # requeued on worker 1: the same greedy tokens
            assert [t for o in res for t in o.new_token_ids] == [104, 105, 106, 107, 108, 109]
            assert res[-1].finish_reason is FinishReason.LENGTH
        assert actor._engine.deadline_misses == {0: 1}
        for _ in range(300):  # the late step ends, the probe's ping is answered
            if await actor.num_live_workers() == 2:
                break
            await asyncio.sleep(0.01)
        assert await actor.num_live_workers() == 2
        assert handles[0].resets == 2  # at start, and before it rejoined
        handles[0].admitted.clear()
        streams = [gen(f"u{i}", [9 * i + 1, 2, 3, 4], greedy(3)) for i in range(4)]
        await asyncio.gather(*(collect(s) for s in streams))
        assert len(handles[0].admitted) == 2  # routed to again
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


class HungHandle(FakeHandle):
    """A worker whose reset never answers (a node that is partitioned)."""

    def __init__(self) -> None:
        super().__init__()

        async def never():
            await asyncio.sleep(3600)

        self.reset = Remote(never)


def test_start_serves_with_the_workers_that_answer_their_reset():
    """A (re)started scheduler whose worker 0 is dead for good and worker 1 silent takes
    both out of service within ``reset_timeout_s`` and serves on worker 2."""

    async def scenario():
        dead = FakeHandle()
        dead.dead = True
        handles = [dead, HungHandle(), FakeHandle()]
        specs = [WorkerSpec(i, 32, 4) for i in range(3)]
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256)
        actor = SchedulerActor(
            cfg, handles, specs, probe_interval_s=0.05, reset_timeout_s=0.2, step_channel=False
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await actor.ready()
        assert loop.time() - t0 < 2.0
        assert [w.alive for w in (await actor.get_stats()).workers] == [False, False, True]
        gen = ActorStreams(actor).generate
        res = await collect(gen("r", [1, 2, 3, 4], greedy(3)))
        assert [t for o in res for t in o.new_token_ids] == [104, 105, 106]
        assert len(handles[2].admitted) == 1
        await actor.shutdown()

    run(scenario())
