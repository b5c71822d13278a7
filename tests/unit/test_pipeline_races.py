"""The request path (:meth:`RequestPipeline.run`) against a real SchedulerActor (fake
workers, no Ray): an abort or a client cancel at every stage of a request (not arrived yet,
tokenizing, in transit to the scheduler, queued, running) ends it, through the gRPC server
too; an id is free again as soon as its cancel is processed; a consumer that
stops reading cannot make the server buffer without bound; a scheduler that is down or
does not answer gives UNAVAILABLE at once."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import ray
from helpers import ScriptedWorker, build_char_tokenizer

from pagedserve.cluster.client import AsyncClient
from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.flights import FlightConfig
from pagedserve.cluster.frontend import GenerationServicer, start_server
from pagedserve.cluster.pipeline import ClientTooSlow, RequestPipeline
from pagedserve.cluster.request_prep import GenerateInput, ModelInfo, SamplingRequest
from pagedserve.scheduler.actor import SchedulerActor
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import ClusterUnavailable, DuplicateRequest
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.scheduler import WorkerSpec

TOKEN = 40  # what the fake worker samples: "E" in the char tokenizer


class Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class Worker:
    """A worker handle whose steps take ``step_s`` and always sample TOKEN."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.inner = ScriptedWorker()
        self.step_s = step_s
        self.admitted: list[str] = []
        self.execute_model = Remote(self._execute)
        self.ping = Remote(self._ok)
        self.reset = Remote(self._ok)

    async def _ok(self):
        return None

    async def _execute(self, so):
        await asyncio.sleep(self.step_s)
        self.admitted.extend(n.seq_id for n in so.new_seqs)
        out = self.inner.execute(so)
        for seq_id in out.sampled_token_ids:
            out.sampled_token_ids[seq_id] = TOKEN
            self.inner.tokens[seq_id][-1] = TOKEN
        return out


class RefStream:
    """Looks like Ray's ObjectRefGenerator over the actor's ``subscribe``: items are
    awaitables; the call reaches the actor only after ``transit_s`` (in flight)."""

    def __init__(self, agen: Any, transit_s: float) -> None:
        self._agen = agen
        self._transit_s = transit_s
        self._started = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._started:
            self._started = True
            await asyncio.sleep(self._transit_s)
        batch = await self._agen.__anext__()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(batch)
        return fut


class SchedulerHandle:
    """Looks like the SchedulerActor's Ray handle; ``add_request`` calls spend
    ``transit_s`` in transit, so an abort sent meanwhile reaches the actor first."""

    def __init__(self, actor: SchedulerActor, transit_s: float = 0.0) -> None:
        self.actor = actor
        self.transit_s = transit_s
        self.subscribe = Remote(lambda *a: RefStream(actor.subscribe(*a), 0.0))
        self.add_request = Remote(lambda *a: asyncio.ensure_future(self._in_transit(a)))
        self.abort = Remote(lambda *a: asyncio.ensure_future(actor.abort(*a)))

    async def _in_transit(self, args: tuple[Any, ...]) -> None:
        await asyncio.sleep(self.transit_s)
        await self.actor.add_request(*args)


def make(max_num_seqs: int = 64, transit_s: float = 0.0, **kw: Any):
    worker = Worker()
    actor = SchedulerActor(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=512),
        [worker],
        [WorkerSpec(0, 64, 8)],
        probe_interval_s=0.05,
        step_channel=False,  # a fake Ray handle
    )
    info = ModelInfo("tiny", 512, 105, (2,), 512, 8)
    pipe = RequestPipeline(SchedulerHandle(actor, transit_s), build_char_tokenizer(), info, **kw)
    return pipe, actor, worker


PROMPT = GenerateInput(text="Tell me a joke.")


async def stream(pipe: RequestPipeline, request_id: str, max_tokens: int, n: int = 1):
    """A transport's use of the pipeline: its deltas; closing this ends the run."""
    sampling = SamplingRequest(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
    async with pipe.run(PROMPT, sampling, request_id) as s:
        async for delta in s:
            yield delta


async def drain(gen) -> list:
    return [d async for d in gen]


async def idle(actor: SchedulerActor) -> None:
    """Nothing left in the scheduler, every block free (bounded wait)."""
    for _ in range(500):
        st = await actor.get_stats()
        if not actor._scheduler.requests and st.workers[0].num_free_blocks == 64:
            await actor.check_integrity()
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"scheduler not idle: {list(actor._scheduler.requests)}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_abort_while_tokenizing_ends_the_request_before_the_scheduler_sees_it():
    async def scenario():
        pipe, actor, worker = make()
        tokenizer, gate = pipe.preparer.tokenizer, threading.Event()

        class Slow:
            def __call__(self, *args, **kwargs):
                assert gate.wait(10)
                return tokenizer(*args, **kwargs)

        pipe.preparer.tokenizer = Slow()
        task = asyncio.ensure_future(drain(stream(pipe, "race-1", 8, n=2)))
        for _ in range(1000):
            if "race-1" in pipe.flights:  # Generate arrived, prompt not tokenized yet
                break
            await asyncio.sleep(0.001)
        assert await pipe.abort("race-1") is True
        assert await pipe.abort("race-1") is False  # once
        gate.set()
        out = await task
        assert [(d.index, d.finish_reason, d.token_ids) for d in out] == [
            (0, FinishReason.ABORT, ()),
            (1, FinishReason.ABORT, ()),
        ]
        prompt_len = len(tokenizer(PROMPT.text)["input_ids"])
        assert out[0].usage.prompt_tokens == prompt_len >= len("Tell me a joke.")
        assert worker.admitted == [] and "race-1" not in pipe.flights
        await actor.shutdown()

    run(scenario())


def test_abort_while_the_request_is_in_transit_to_the_scheduler():
    async def scenario():
        pipe, actor, _ = make(transit_s=0.05)
        gen = stream(pipe, "race-1", 200)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)  # add_request was sent, has not run yet
        assert not actor._scheduler.requests
        assert await pipe.abort("race-1") is True
        out = [await first, *(await drain(gen))]
        assert out[-1].finish_reason is FinishReason.ABORT
        assert sum(len(d.token_ids) for d in out) < 200
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_abort_of_a_queued_and_of_a_running_request():
    async def scenario():
        pipe, actor, worker = make(max_num_seqs=1)
        long = stream(pipe, "long", 400)
        assert (await long.__anext__()).token_ids == (TOKEN,)  # running
        queued = asyncio.ensure_future(drain(stream(pipe, "race-1", 8)))
        while "race-1" not in actor._scheduler.requests:
            await asyncio.sleep(0.001)
        assert await pipe.abort("race-1") is True  # queued behind "long"
        out = await queued
        assert [(d.finish_reason, d.token_ids) for d in out] == [(FinishReason.ABORT, ())]
        assert await pipe.abort("long") is True  # running
        rest = await drain(long)
        assert rest[-1].finish_reason is FinishReason.ABORT
        assert "race-1/0" not in worker.admitted
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_client_cancel_in_transit_aborts_and_frees_the_id_at_once():
    async def scenario():
        pipe, actor, _ = make(transit_s=0.05)
        task = asyncio.ensure_future(drain(stream(pipe, "c", 300)))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away before the scheduler had the request
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "c" not in pipe.flights
        assert not actor._scheduler.requests  # added after the cancel, then aborted
        out = await drain(stream(pipe, "c", 3))  # the id is free
        assert [d.finish_reason for d in out] == [None, None, FinishReason.LENGTH]
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_request_id_reused_right_after_each_cancel_in_a_tight_loop():
    async def scenario():
        pipe, actor, _ = make()
        for _ in range(50):
            gen = stream(pipe, "reuse", 300)
            assert (await gen.__anext__()).token_ids == (TOKEN,)
            await gen.aclose()  # cancel; the next request reuses the id at once
        out = await drain(stream(pipe, "reuse", 2))
        assert out[-1].finish_reason is FinishReason.LENGTH
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_an_id_in_flight_is_refused_after_the_reuse_wait():
    async def scenario():
        pipe, actor, _ = make(flight_config=FlightConfig(id_reuse_wait_s=0.1))
        gen = stream(pipe, "dup", 400)
        await gen.__anext__()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(DuplicateRequest):
            await pipe.flights.admit("dup")
        assert asyncio.get_running_loop().time() - t0 >= 0.1
        await gen.aclose()
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_a_consumer_that_stops_reading_is_aborted_past_the_bound():
    async def scenario():
        pipe, actor, worker = make(max_buffered_outputs=8)
        gen = stream(pipe, "slow", 300)
        assert (await gen.__anext__()).token_ids == (TOKEN,)
        await idle(actor)  # the consumer stalls; the request is aborted meanwhile
        assert len(worker.admitted) == 1
        with pytest.raises(ClientTooSlow, match="not reading"):
            await gen.__anext__()
        assert "slow" not in pipe.flights
        assert ClientTooSlow.status == "RESOURCE_EXHAUSTED"
        # A consumer that keeps up is never cut off.
        out = await drain(stream(pipe, "fast", 100))
        assert len(out) == 100 and out[-1].finish_reason is FinishReason.LENGTH
        await actor.shutdown()

    run(scenario())


def test_scheduler_down_or_silent_is_unavailable_at_once():
    async def scenario():
        pipe, actor, _ = make(scheduler_timeout_s=0.2)
        pipe.flights.scheduler_up = False
        with pytest.raises(ClusterUnavailable, match="scheduler"):
            await pipe.flights.admit("x")
        pipe.flights.scheduler_up = True
        pipe.scheduler.transit_s = 60  # the call never arrives
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ClusterUnavailable, match="did not accept"):
            await drain(stream(pipe, "x", 4))
        assert asyncio.get_running_loop().time() - t0 < 1.0
        assert "x" not in pipe.flights
        await actor.shutdown()

    run(scenario())


def test_actor_death_mid_stream_is_unavailable():
    async def scenario():
        pipe, actor, _ = make()

        class Dying(RefStream):
            count = 0

            async def __anext__(self):
                Dying.count += 1
                if Dying.count > 3:
                    raise ray.exceptions.RayActorError()
                return await super().__anext__()

        # The output stream (one per frontend) fails after its acknowledgement and two batches.
        pipe.scheduler.subscribe = Remote(lambda *a: Dying(actor.subscribe(*a), 0.0))
        got = []
        with pytest.raises(ClusterUnavailable, match="scheduler unavailable"):
            async for d in stream(pipe, "d", 50):
                got.append(d)
        assert len(got) == 2
        await idle(actor)  # its request ran out (the fake stream died, not the actor)
        # A restarted scheduler: the next request subscribes again and is served.
        pipe.scheduler.subscribe = Remote(lambda *a: RefStream(actor.subscribe(*a), 0.0))
        out = await drain(stream(pipe, "e", 5))
        assert [d.token_ids for d in out] == [(TOKEN,)] * 5
        assert out[-1].finish_reason is FinishReason.LENGTH
        await actor.shutdown()

    run(scenario())


def test_drain_refuses_new_requests_and_waits_for_those_in_flight():
    async def scenario():
        pipe, actor, _ = make()
        short = asyncio.ensure_future(drain(stream(pipe, "a", 20)))
        long = asyncio.ensure_future(drain(stream(pipe, "c", 450)))
        await asyncio.sleep(0.01)
        pipe.flights.begin_drain()
        assert not pipe.flights.serving
        with pytest.raises(ClusterUnavailable, match="shutting down"):
            await pipe.flights.admit("b")
        assert await pipe.flights.wait_idle(0.05) is False
        out = await short  # in flight when the drain began: runs to the end
        assert len(out) == 20 and out[-1].finish_reason is FinishReason.LENGTH
        assert await pipe.abort_all() == 1  # past the drain timeout
        assert (await long)[-1].finish_reason is FinishReason.ABORT
        assert await pipe.flights.wait_idle(1) is True
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_scheduler_death_fails_every_request_in_flight_at_once():
    """What the frontend's scheduler watch does when the actor's process exits."""

    async def scenario():
        pipe, actor, _ = make(transit_s=0.5)
        running = stream(pipe, "r", 400)
        pipe.scheduler.transit_s = 0.0
        in_transit = asyncio.ensure_future(drain(stream(pipe, "t", 400)))
        assert (await running.__anext__()).token_ids == (TOKEN,)
        pipe.scheduler.transit_s = 60.0
        late = asyncio.ensure_future(drain(stream(pipe, "l", 4)))
        await asyncio.sleep(0.05)
        t0 = asyncio.get_running_loop().time()
        pipe.flights.scheduler_up = False
        pipe.flights.fail_all(ClusterUnavailable("scheduler unavailable: the scheduler actor died"))
        with pytest.raises(ClusterUnavailable, match="died"):
            await drain(running)
        with pytest.raises(ClusterUnavailable, match="died"):
            await late  # still waiting for the scheduler to accept it
        assert asyncio.get_running_loop().time() - t0 < 0.5
        with pytest.raises(ClusterUnavailable, match="died"):
            await in_transit
        with pytest.raises(ClusterUnavailable, match="restarting"):
            await pipe.flights.admit("new")
        assert len(pipe.flights) == 0
        await actor.shutdown()

    run(scenario())


def test_one_output_stream_per_frontend_tags_and_orphans():
    """The actor side of the shared output stream: add_request needs an open
    subscription; outputs carry the tag given at add time; closing the subscription
    aborts what its requests had left and frees their blocks."""

    async def scenario():
        _, actor, _ = make()
        from pagedserve.scheduler.sampling_params import SamplingParams

        sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

        def request(request_id: str, prompt: list[int], tag: int) -> EngineRequest:
            return EngineRequest(request_id, prompt, sp, (2,), subscriber="fe-1", tag=tag)

        with pytest.raises(ClusterUnavailable, match="no output stream"):
            await actor.add_request(request("a", [5, 6, 7], 1))
        stream = actor.subscribe("fe-1")
        assert await stream.__anext__() == []
        await actor.add_request(request("a", [5, 6, 7], 7))
        await actor.add_request(request("b", [5, 6], 8))
        seen: dict[int, int] = {}
        while len(seen) < 2 or min(seen.values()) < 3:
            for tag, out in await stream.__anext__():
                assert (tag, out.request_id) in ((7, "a"), (8, "b"))
                seen[tag] = seen.get(tag, 0) + len(out.new_token_ids)
        assert len(actor._scheduler.requests) == 2
        await stream.aclose()  # the frontend went away mid-generation
        await idle(actor)
        assert actor._routes == {} and "fe-1" not in actor._subscribers
        await actor.shutdown()

    run(scenario())


def test_an_abort_that_overtakes_its_generate_ends_it_on_arrival():
    async def scenario():
        pipe, actor, worker = make()
        assert await pipe.abort("early") is True  # not seen yet: its Generate may be on the way
        out = await drain(stream(pipe, "early", 8, n=2))
        assert [(d.index, d.finish_reason, d.token_ids) for d in out] == [
            (0, FinishReason.ABORT, ()),
            (1, FinishReason.ABORT, ()),
        ]
        assert worker.admitted == [] and not actor._scheduler.requests
        # The memory is spent by that request: the id serves the next one in full.
        out = await drain(stream(pipe, "early", 3))
        assert [d.token_ids for d in out] == [(TOKEN,)] * 3
        assert await pipe.abort("early") is False  # it had finished
        await idle(actor)
        await actor.shutdown()

    run(scenario())


def test_an_early_abort_is_forgotten_after_its_memory_time():
    async def scenario():
        pipe, actor, _ = make(flight_config=FlightConfig(abort_memory_s=0.1))
        assert await pipe.abort("late") is True
        await asyncio.sleep(0.15)
        out = await drain(stream(pipe, "late", 3))
        assert [d.token_ids for d in out] == [(TOKEN,)] * 3
        assert out[-1].finish_reason is FinishReason.LENGTH
        await idle(actor)
        await actor.shutdown()

    run(scenario())


async def _grpc(pipe: RequestPipeline) -> tuple[Any, AsyncClient]:
    server, port = await start_server(ServerConfig(port=0), GenerationServicer(pipe))
    return server, AsyncClient(f"127.0.0.1:{port}", timeout_s=20)


def test_grpc_abort_then_generate_of_one_id_ends_with_abort_and_no_blocks():
    """Through the gRPC server on 127.0.0.1: an Abort that reached it before its Generate
    (two RPCs are not ordered) ends that Generate at once; the pool never held it."""

    async def scenario():
        pipe, actor, worker = make()
        server, client = await _grpc(pipe)
        try:
            assert await client.abort("rpc-1") is True
            result = await client.generate("Tell me a joke.", request_id="rpc-1", max_tokens=50)
            assert [(c.finish_reason, c.token_ids) for c in result.choices] == [("abort", [])]
            assert worker.admitted == []
            st = await actor.get_stats()
            assert st.workers[0].num_free_blocks == 64 and not actor._scheduler.requests
        finally:
            await client.close()
            await server.stop(0)
            await actor.shutdown()

    run(scenario())


def test_grpc_id_aborted_early_is_usable_again_after_the_memory_time():
    async def scenario():
        pipe, actor, _ = make(flight_config=FlightConfig(abort_memory_s=0.2))
        server, client = await _grpc(pipe)
        try:
            assert await client.abort("rpc-2") is True
            await asyncio.sleep(0.3)
            result = await client.generate(
                "Tell me a joke.", request_id="rpc-2", max_tokens=4, temperature=0, ignore_eos=True
            )
            assert result.choices[0].finish_reason == "length"
            assert result.choices[0].token_ids == [TOKEN] * 4
            assert await client.abort("rpc-2") is False  # finished
            await idle(actor)
        finally:
            await client.close()
            await server.stop(0)
            await actor.shutdown()

    run(scenario())
