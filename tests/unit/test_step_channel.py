"""The step channel (scheduler/step_channel.py, worker/step_channel.py) on 127.0.0.1.

The client and the server alone: answers in order with two steps in flight, a step that
raises fails alone, a wrong secret is refused without ending the channel, a closed or
re-opened channel fails the steps in flight with WorkerDied, a corrupt length ends it;
with the worker's model thread (worker/model_thread.py): every step runs there, and a
reset drops the steps read before it, unrun.
Then the SchedulerActor over real channels with fake workers: every step goes on the
channel (no Ray call), and a channel lost mid-run (the worker's end closed) requeues the
sequences on the other worker; the probe resets the worker, opens a new channel and the
worker serves again. The real cluster runs the same path in tests/cluster/test_faults.py
(a worker actor killed mid-generation).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from helpers import ActorStreams, ScriptedWorker
from test_scheduler_actor import FakeHandle, Remote, collect, greedy, run

from pagedserve.scheduler.actor import SchedulerActor
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import WorkerDied
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.scheduler import WorkerSpec
from pagedserve.scheduler.step_channel import (
    HEADER,
    MAX_FRAME_BYTES,
    SECRET_BYTES,
    StepChannelAddress,
    StepChannelClient,
    StepFailed,
)
from pagedserve.worker.model_thread import ModelThread
from pagedserve.worker.step_channel import StepChannelServer


@pytest.fixture
def mt():
    thread = ModelThread()
    yield thread
    thread.close()


def step(i: int) -> SchedulerOutput:
    return SchedulerOutput(step_id=i, num_scheduled_tokens={f"s{i}": 1})


class Echo:
    """A worker's execute: answers step i with token i * 10 (after ``delay`` seconds),
    raises on the steps in ``fail``; ``gate`` holds step ``hold`` until set."""

    def __init__(self, fail: tuple[int, ...] = (), hold: int | None = None) -> None:
        self.fail = fail
        self.hold = hold
        self.gate = threading.Event()
        self.started = threading.Event()
        self.seen: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, so: SchedulerOutput) -> RunnerOutput:
        self.threads.add(threading.current_thread().name)
        self.seen.append(so.step_id)
        if so.step_id == self.hold:
            self.started.set()
            self.gate.wait(10)
        if so.step_id in self.fail:
            raise ValueError(f"step {so.step_id} refused")
        return RunnerOutput(so.step_id, sampled_token_ids={f"s{so.step_id}": so.step_id * 10})


def answer_of(out: RunnerOutput, i: int) -> list[int]:
    assert out.step_id == i
    return [out.sampled_token_ids[f"s{i}"]]


def test_answers_come_in_order_with_two_steps_in_flight_on_the_model_thread(mt):
    echo = Echo()
    server = StepChannelServer(echo, "127.0.0.1", mt)

    async def scenario():
        client = await StepChannelClient.connect(server.open())
        futs = [client.execute(step(i)) for i in range(6)]  # all sent before any answer
        outs = await asyncio.gather(*futs)
        assert [answer_of(o, i) for i, o in enumerate(outs)] == [[i * 10] for i in range(6)]
        assert echo.seen == list(range(6))
        assert echo.threads == {"pagedserve-model"}
        assert server.steps_run == 6 and server.connected
        await client.close()

    run(scenario())
    server.close()


def test_a_step_that_raises_fails_alone_and_the_channel_goes_on(mt):
    server = StepChannelServer(Echo(fail=(1,)), "127.0.0.1", mt)

    async def scenario():
        client = await StepChannelClient.connect(server.open())
        a, b, c = (client.execute(step(i)) for i in range(3))
        assert answer_of(await a, 0) == [0]
        with pytest.raises(StepFailed, match="ValueError: step 1 refused"):
            await b
        assert answer_of(await c, 2) == [20]
        assert not client.closed
        await client.close()

    run(scenario())
    server.close()


def test_a_wrong_secret_is_refused_and_the_right_one_still_connects(mt):
    server = StepChannelServer(Echo(), "127.0.0.1", mt)
    address = server.open()

    async def scenario():
        bad = StepChannelAddress(address.host, address.port, bytes(SECRET_BYTES))
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await StepChannelClient.connect(bad, timeout_s=5)
        client = await StepChannelClient.connect(address)
        assert answer_of(await client.execute(step(3)), 3) == [30]
        await client.close()

    run(scenario())
    server.close()


def test_closing_the_worker_end_fails_the_steps_in_flight_and_later_ones_with_worker_died(mt):
    echo = Echo(hold=1)
    server = StepChannelServer(echo, "127.0.0.1", mt)

    async def scenario():
        client = await StepChannelClient.connect(server.open())
        first = client.execute(step(0))
        held = client.execute(step(1))
        queued = client.execute(step(2))
        assert answer_of(await first, 0) == [0]
        assert await asyncio.to_thread(echo.started.wait, 5)
        server.close()  # step 1 runs on; its answer has nowhere to go
        echo.gate.set()
        for fut in (held, queued):
            with pytest.raises(WorkerDied, match="step channel lost"):
                await fut
        assert client.closed
        with pytest.raises(WorkerDied):
            await client.execute(step(3))
        assert echo.seen == [0, 1]  # step 2 was never run

    run(scenario())


def test_reopening_ends_the_old_channel_and_serves_the_new_one(mt):
    server = StepChannelServer(Echo(), "127.0.0.1", mt)

    async def scenario():
        old = await StepChannelClient.connect(server.open())
        assert answer_of(await old.execute(step(1)), 1) == [10]
        new_address = server.open()  # a restarted scheduler's
        new = await StepChannelClient.connect(new_address)
        with pytest.raises(WorkerDied):
            await old.execute(step(2))
        assert answer_of(await new.execute(step(4)), 4) == [40]
        await new.close()

    run(scenario())
    server.close()


def test_a_length_past_the_limit_ends_the_channel_on_the_worker(mt):
    server = StepChannelServer(Echo(), "127.0.0.1", mt)
    address = server.open()
    with socket.create_connection((address.host, address.port), timeout=5) as sock:
        sock.sendall(address.secret)
        assert sock.recv(64)  # the acknowledgement
        sock.sendall(HEADER.pack(MAX_FRAME_BYTES + 1))
        assert sock.recv(64) == b""  # closed, nothing allocated or run
    server.close()


def test_an_unopened_channel_times_out_and_closes(mt):
    server = StepChannelServer(Echo(), "127.0.0.1", mt, accept_timeout_s=0.2)
    address = server.open()

    async def scenario():
        await asyncio.sleep(0.5)
        with pytest.raises(OSError):
            await StepChannelClient.connect(address, timeout_s=2)

    run(scenario())


class ChannelHandle(FakeHandle):
    """A fake worker actor whose steps come over a real step channel on 127.0.0.1 (its
    ``execute_model.remote`` counts the steps that would go as Ray calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.model_thread = ModelThread()
        self.server = StepChannelServer(self._run, "127.0.0.1", self.model_thread)
        self.opened = 0
        self.ray_steps = 0
        self.channel_steps = 0
        self.lose_after: int | None = None
        self.open_step_channel = Remote(self._open)
        ray_execute = self._execute

        async def counted(so):
            self.ray_steps += 1
            return await ray_execute(so)

        self.execute_model = Remote(counted)

    async def _open(self, peer_node_id=None):
        self.opened += 1
        return self.server.open()

    def _run(self, so):
        self.channel_steps += 1
        if self.lose_after is not None and self.channel_steps > self.lose_after:
            self.lose_after = None
            self.server.close()  # the connection drops while this step runs
        self.admitted.extend(n.seq_id for n in so.new_seqs)
        return self.inner.execute(so)

    async def _reset(self):
        await super()._reset()
        self.inner = ScriptedWorker()


def test_the_scheduler_actor_sends_every_step_on_the_channel():
    async def scenario():
        handle = ChannelHandle()
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256)
        actor = SchedulerActor(cfg, [handle], [WorkerSpec(0, 32, 4)], probe_interval_s=0.05)
        gen = ActorStreams(actor).generate
        streams = [gen(f"r{i}", [1, 2, 3, i + 5], greedy(6)) for i in range(3)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for res in results:
            assert [t for o in res for t in o.new_token_ids] == [104, 105, 106, 107, 108, 109]
            assert res[-1].finish_reason is FinishReason.LENGTH
        assert handle.opened == 1 and handle.ray_steps == 0
        assert handle.channel_steps >= 6
        await actor.check_integrity()
        await actor.shutdown()
        for _ in range(500):  # the worker's end sees the connection close
            if not handle.server.connected:
                break
            await asyncio.sleep(0.01)
        assert not handle.server.connected

    run(scenario())


def test_a_channel_lost_mid_run_requeues_and_the_probe_opens_a_new_one():
    async def scenario():
        handles = [ChannelHandle(), ChannelHandle()]
        handles[0].lose_after = 2
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, routing="round-robin")
        specs = [WorkerSpec(i, 32, 4) for i in range(2)]
        actor = SchedulerActor(cfg, handles, specs, probe_interval_s=0.05)
        gen = ActorStreams(actor).generate
        streams = [gen(f"r{i}", [1, 2, 3, i + 5], greedy(6)) for i in range(4)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for res in results:  # recomputed on worker 1 where worker 0 lost its channel
            assert [t for o in res for t in o.new_token_ids] == [104, 105, 106, 107, 108, 109]
        for _ in range(300):  # the probe: ping, reset, a new channel, back in service
            if await actor.num_live_workers() == 2:
                break
            await asyncio.sleep(0.01)
        assert await actor.num_live_workers() == 2
        assert handles[0].opened == 2 and handles[0].resets == 2
        assert handles[0].ray_steps == 0
        handles[0].admitted.clear()
        streams = [gen(f"u{i}", [9 * i + 1, 2, 3, 4], greedy(3)) for i in range(4)]
        await asyncio.gather(*(collect(s) for s in streams))
        assert len(handles[0].admitted) == 2  # served again, on the new channel
        assert handles[0].ray_steps == 0
        await actor.check_integrity()
        await actor.shutdown()

    run(scenario())


def test_without_the_channel_steps_go_as_ray_calls():
    async def scenario():
        handle = ChannelHandle()
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256)
        actor = SchedulerActor(
            cfg, [handle], [WorkerSpec(0, 32, 4)], probe_interval_s=0.05, step_channel=False
        )
        res = await collect(ActorStreams(actor).generate("r", [1, 2, 3], greedy(4)))
        assert [t for o in res for t in o.new_token_ids] == [103, 104, 105, 106]
        assert handle.opened == 0 and handle.channel_steps == 0 and handle.ray_steps >= 4
        await actor.shutdown()

    run(scenario())


def test_the_model_thread_runs_calls_in_order_on_one_thread():
    from pagedserve.worker.model_thread import ModelThread

    mt = ModelThread()
    seen: list[tuple[str, int]] = []

    def note(tag: str) -> int:
        seen.append((tag, threading.get_ident()))
        return len(seen)

    assert mt.call(note, "a") == 1
    assert mt.call(lambda: mt.call(note, "nested")) == 2  # from its own thread: inline
    mt.submit(lambda: note("queued"))
    assert mt.future(note, "b").result(5) == 4
    assert [t for t, _ in seen] == ["a", "nested", "queued", "b"]
    assert {ident for _, ident in seen} == {mt.ident} != {threading.get_ident()}
    with pytest.raises(ZeroDivisionError):
        mt.call(lambda: 1 // 0)
    with socket.socket() as sock, pytest.raises(RuntimeError, match="model thread"):
        mt.watch(sock, lambda: True)  # only from the model thread
    mt.close()
    with pytest.raises(RuntimeError):
        mt.call(note, "after close")


def test_a_reset_queued_during_a_step_runs_before_the_steps_sent_after_and_drops_them():
    from pagedserve.worker.model_thread import ModelThread

    mt = ModelThread()
    echo = Echo(hold=0)
    server = StepChannelServer(echo, "127.0.0.1", mt)

    async def scenario():
        client = await StepChannelClient.connect(server.open())
        running = client.execute(step(0))  # held on the model thread
        assert await asyncio.to_thread(echo.started.wait, 5)
        queued = [client.execute(step(i)) for i in (1, 2)]
        await asyncio.sleep(0.2)  # in the socket's buffer, behind step 0
        mt.submit(server.invalidate)  # Worker.reset's place: a call queued meanwhile
        echo.gate.set()
        assert answer_of(await running, 0) == [0]
        await asyncio.sleep(0.3)
        await client.close()
        for fut in queued:  # never answered
            with pytest.raises(WorkerDied):
                await fut

    run(scenario())
    assert echo.seen == [0]  # steps 1 and 2 never ran
    assert echo.threads == {mt.call(lambda: threading.current_thread().name)}
    server.close()
    mt.close()


def test_each_open_binds_the_host_it_is_given(mt):
    server = StepChannelServer(Echo(), "127.0.0.1", mt)
    assert server.open().host == "127.0.0.1"
    assert server.open("0.0.0.0").host == "0.0.0.0"  # a scheduler on another node
    assert server.open("127.0.0.1").host == "127.0.0.1"
    server.close()


def test_a_peer_trickling_bytes_holds_the_accept_no_longer_than_the_handshake_deadline(mt):
    server = StepChannelServer(Echo(), "127.0.0.1", mt)
    address = server.open()
    with socket.create_connection((address.host, address.port), timeout=5) as slow:
        slow.sendall(b"x")  # then nothing: refused after 2 s, not held

        async def scenario():
            client = await StepChannelClient.connect(address, timeout_s=8)
            assert answer_of(await client.execute(step(5)), 5) == [50]
            await client.close()

        run(scenario())
    server.close()


def test_a_scheduler_cut_off_mid_frame_frees_the_model_thread_after_the_frame_timeout(
    mt, monkeypatch
):
    """Half a frame, then nothing: the model thread gives the channel up after
    FRAME_TIMEOUT_S (kept under the reset timeout) and runs the call queued behind it."""
    from pagedserve.worker import step_channel as worker_channel

    assert worker_channel.FRAME_TIMEOUT_S < 10.0  # SchedulerActor's default reset timeout
    monkeypatch.setattr(worker_channel, "FRAME_TIMEOUT_S", 0.3)
    server = StepChannelServer(Echo(), "127.0.0.1", mt)
    address = server.open()
    with socket.create_connection((address.host, address.port), timeout=5) as sock:
        sock.sendall(address.secret)
        assert sock.recv(64)  # the acknowledgement
        sock.sendall(HEADER.pack(400) + b"\x80")  # a frame that never completes
        for _ in range(200):
            if server.connected:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.05)  # the model thread is in the frame's read
        t0 = time.monotonic()
        assert mt.call(lambda: 7) == 7
        assert time.monotonic() - t0 < 3.0
        assert sock.recv(64) == b""  # the worker ended the channel
    assert not server.connected
    server.close()
