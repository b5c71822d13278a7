"""The output channel (:mod:`pagedserve.scheduler.output_channel`): the handshake, frames
in order, each side learning the other's end, a corrupt stream, and the SchedulerActor's
``attach_output_channel`` behind a frontend's :class:`OutputRouter` (real sockets on
127.0.0.1, fake workers, no Ray)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_pipeline_races import TOKEN, Remote, SchedulerHandle, drain, idle, make, stream

from pagedserve.cluster.output_router import OutputRouter
from pagedserve.scheduler import output_channel
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import ClusterUnavailable
from pagedserve.scheduler.output_channel import (
    ACK,
    OutputChannelListener,
    OutputChannelSender,
)
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.step_channel import HEADER, StepChannelAddress


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def pair(**kw):
    """A listener, its sender connected, and the accepted reader."""
    listener = await OutputChannelListener.open("127.0.0.1")
    accepted = asyncio.ensure_future(listener.accept(5.0))
    sender = await OutputChannelSender.connect(listener.address, 5.0, **kw)
    return listener, sender, await accepted


def test_batches_arrive_in_order_and_whole():
    async def scenario():
        listener, sender, reader = await pair()
        assert listener.address.host == "127.0.0.1" and len(listener.address.secret) == 32
        sent = [[(1, "a")], [(2, "b"), (1, "c")], [(3, list(range(5000)))]]
        for batch in sent:
            await sender.send(batch)
        got = []
        async for batch in reader.batches():
            got.append(batch)
            if len(got) == len(sent):
                break
        assert got == sent
        await sender.close()

    run(scenario())


def test_a_wrong_secret_is_refused_and_the_right_one_still_accepted():
    async def scenario():
        listener = await OutputChannelListener.open("127.0.0.1")
        accepted = asyncio.ensure_future(listener.accept(5.0))
        a = listener.address
        wrong = StepChannelAddress(a.host, a.port, bytes(32))
        with pytest.raises(ConnectionError, match="closed at the handshake"):
            await OutputChannelSender.connect(wrong, 5.0)
        assert not accepted.done()
        sender = await OutputChannelSender.connect(a, 5.0)
        reader = await accepted
        await sender.send([(9, "x")])
        assert await reader.batches().__anext__() == [(9, "x")]
        # one scheduler per channel: the listener stopped at the first good connection
        with pytest.raises(OSError):
            await OutputChannelSender.connect(a, 1.0)
        await sender.close()

    run(scenario())


def test_the_reader_closing_ends_the_sender_and_calls_on_close():
    async def scenario():
        ended = asyncio.Event()
        _, sender, reader = await pair(on_close=ended.set)
        reader.close()
        await asyncio.wait_for(ended.wait(), 5)
        assert sender.closed
        with pytest.raises(ConnectionError):
            await sender.send([(1, "late")])

    run(scenario())


def test_the_sender_closing_ends_the_readers_batches():
    async def scenario():
        ended = []
        _, sender, reader = await pair(on_close=lambda: ended.append(1))
        await sender.send([(1, "a")])
        await sender.close()
        await sender.close()  # idempotent
        assert ended == [1]
        batches = reader.batches()
        assert await batches.__anext__() == [(1, "a")]
        with pytest.raises(ConnectionError, match="connection ended"):
            await batches.__anext__()

    run(scenario())


def test_a_corrupt_length_ends_the_channel_without_unpickling():
    async def scenario():
        listener = await OutputChannelListener.open("127.0.0.1")
        accepted = asyncio.ensure_future(listener.accept(5.0))
        r, w = await asyncio.open_connection("127.0.0.1", listener.address.port)
        w.write(listener.address.secret)
        assert await r.readexactly(len(ACK)) == ACK
        reader = await accepted
        w.write(HEADER.pack(1 << 40))
        with pytest.raises(ConnectionError, match="exceeds"):
            await reader.batches().__anext__()
        assert await r.read(1) == b""  # the frontend closed it
        w.close()

    run(scenario())


def test_no_scheduler_in_time_closes_the_listener(monkeypatch):
    async def scenario():
        listener = await OutputChannelListener.open("127.0.0.1")
        with pytest.raises(TimeoutError):
            await listener.accept(0.1)
        with pytest.raises(OSError):
            await OutputChannelSender.connect(listener.address, 1.0)

    run(scenario())


def test_a_peer_trickling_its_secret_is_refused(monkeypatch):
    monkeypatch.setattr(output_channel, "HANDSHAKE_TIMEOUT_S", 0.2)

    async def scenario():
        listener = await OutputChannelListener.open("127.0.0.1")
        accepted = asyncio.ensure_future(listener.accept(5.0))
        r, w = await asyncio.open_connection("127.0.0.1", listener.address.port)
        w.write(listener.address.secret[:10])
        assert await asyncio.wait_for(r.read(1), 5) == b""  # dropped after 0.2 s
        w.close()
        assert not accepted.done()
        sender = await OutputChannelSender.connect(listener.address, 5.0)
        await accepted
        await sender.close()

    run(scenario())


# ---------------------------------------------------------------- behind the router


class ChannelHandle(SchedulerHandle):
    """The fake Ray handle with the actor's ``attach_output_channel`` and
    ``process_id`` (the same node: the channel listens on 127.0.0.1)."""

    def __init__(self, actor, transit_s: float = 0.0) -> None:
        super().__init__(actor, transit_s)
        self.attach_output_channel = Remote(
            lambda *a: asyncio.ensure_future(actor.attach_output_channel(*a))
        )
        self.process_id = Remote(lambda: asyncio.ensure_future(_same_node()))


async def _same_node():
    return "node-a", 1


def test_requests_stream_over_the_channel_with_the_ray_streams_outputs():
    async def scenario():
        pipe, actor, _ = make()
        pipe.scheduler = pipe.router.scheduler = ChannelHandle(actor)
        outs = await asyncio.gather(*(drain(stream(pipe, f"r{i}", 6 + i, n=2)) for i in range(3)))
        assert pipe.router.subscribed_over == "socket"
        for i, out in enumerate(outs):
            for index in (0, 1):
                mine = [d for d in out if d.index == index]
                assert [t for d in mine for t in d.token_ids] == [TOKEN] * (6 + i)
                assert mine[-1].finish_reason is FinishReason.LENGTH
        await idle(actor)
        await pipe.router.close()
        await actor.shutdown()

    run(scenario())


def test_a_handle_without_the_channel_falls_back_to_the_ray_stream():
    async def scenario():
        pipe, actor, _ = make()  # SchedulerHandle: no attach_output_channel
        out = await drain(stream(pipe, "r", 5))
        assert pipe.router.subscribed_over == "ray"
        assert [t for d in out for t in d.token_ids] == [TOKEN] * 5
        await pipe.router.close()
        await actor.shutdown()

    run(scenario())


def test_ray_transport_never_opens_a_channel():
    async def scenario():
        _, actor, _ = make()
        router = OutputRouter(ChannelHandle(actor), 64, transport="ray")
        await router.ensure()
        assert router.subscribed_over == "ray"
        await router.close()
        await actor.shutdown()

    run(scenario())
    with pytest.raises(ValueError, match="transport"):
        OutputRouter(None, 64, transport="zmq")


def test_the_frontend_going_away_aborts_its_requests_and_frees_their_blocks():
    async def scenario():
        _, actor, _ = make()
        router = OutputRouter(ChannelHandle(actor), 4096)
        await router.ensure()
        assert router.subscribed_over == "socket"
        queue: asyncio.Queue = asyncio.Queue()
        tag = router.register(queue, lambda: RuntimeError("slow"))
        sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        await actor.add_request(
            EngineRequest("a", [5, 6, 7], sp, (2,), subscriber=router.subscriber, tag=tag)
        )
        got = 0
        while got < 3:
            got += len((await queue.get()).new_token_ids)
        assert len(actor._scheduler.requests) == 1
        await router.close()  # the frontend's connection ends mid-generation
        await idle(actor)
        assert actor._routes == {} and router.subscriber not in actor._subscribers
        await actor.shutdown()

    run(scenario())


def test_a_scheduler_gone_fails_every_waiting_request():
    async def scenario():
        pipe, actor, worker = make()
        worker.step_s = 0.02
        pipe.scheduler = pipe.router.scheduler = ChannelHandle(actor)
        task = asyncio.ensure_future(drain(stream(pipe, "r", 400)))
        while not actor._output_channels:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        for pump in list(actor._output_channels.values()):
            pump.cancel()  # the scheduler's end of the channel closes
        with pytest.raises(ClusterUnavailable, match="died or ended the output channel"):
            await task
        await actor.shutdown()

    run(scenario())


def test_a_restarted_scheduler_behind_an_open_connection_is_subscribed_to_again():
    """The scheduler is replaced (Ray restarted it; the old node sent no FIN, so the old
    connection looks open): the first request meets NoOutputStream, the router subscribes
    again and the request is served; so are the ones after it."""

    async def scenario():
        pipe, old, _ = make()
        handle = ChannelHandle(old)
        pipe.scheduler = pipe.router.scheduler = handle
        assert [t for d in await drain(stream(pipe, "a", 3)) for t in d.token_ids] == [TOKEN] * 3
        first = pipe.router.subscription
        _, new, _ = make()
        fresh = ChannelHandle(new)
        for name in ("add_request", "abort", "subscribe", "attach_output_channel", "process_id"):
            setattr(handle, name, getattr(fresh, name))
        for i in range(2):
            out = await drain(stream(pipe, f"b{i}", 3))
            assert [t for d in out for t in d.token_ids] == [TOKEN] * 3
        assert pipe.router.subscription is not first
        assert list(new._subscribers) == [pipe.router.subscriber]
        await idle(new)
        await pipe.router.close()
        await old.shutdown()
        await new.shutdown()

    run(scenario())


def test_a_scheduler_that_cannot_reach_the_listener_falls_back_before_requests_time_out():
    """The scheduler's connect hangs (packets dropped): the router gives the channel
    ``min(3 s, scheduler_timeout_s / 3)`` and takes a Ray stream; no request fails."""

    async def scenario():
        pipe, actor, _ = make(scheduler_timeout_s=1.5)
        handle = ChannelHandle(actor)

        async def blackholed(*args):
            await asyncio.sleep(5)
            raise TimeoutError("connect timed out")

        handle.attach_output_channel = Remote(lambda *a: asyncio.ensure_future(blackholed(*a)))
        pipe.scheduler = pipe.router.scheduler = handle
        outs = await asyncio.gather(*(drain(stream(pipe, f"r{i}", 3)) for i in range(4)))
        assert all([t for d in out for t in d.token_ids] == [TOKEN] * 3 for out in outs)
        assert pipe.router.subscribed_over == "ray"
        await pipe.router.close()
        await actor.shutdown()

    run(scenario())


def test_close_as_the_attach_answer_lands_does_not_hang():
    """``close()`` cancels the subscription in the loop iteration where the scheduler's
    answer to ``attach_output_channel`` arrives: the cancel is not lost, close returns
    and the scheduler drops the subscription."""

    async def scenario():
        _, actor, _ = make()
        handle = ChannelHandle(actor)
        router = OutputRouter(handle, 64)
        closing: list[asyncio.Future] = []

        def attach(*args):
            answer = asyncio.get_running_loop().create_future()

            async def go():
                await actor.attach_output_channel(*args)
                answer.set_result(True)
                closing.append(asyncio.ensure_future(router.close()))

            closing.append(asyncio.ensure_future(go()))
            return answer

        handle.attach_output_channel = Remote(attach)
        with contextlib.suppress(Exception):
            await router.ensure()
        while len(closing) < 2:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(closing[1], 5)
        for _ in range(200):
            if not actor._subscribers:
                break
            await asyncio.sleep(0.01)
        assert actor._subscribers == {}
        await actor.shutdown()

    run(scenario())


def test_a_new_subscription_under_the_same_name_aborts_the_old_ones_requests():
    async def scenario():
        _, actor, _ = make()
        old = OutputRouter(ChannelHandle(actor), 4096)
        await old.ensure()
        queue: asyncio.Queue = asyncio.Queue()
        tag = old.register(queue, lambda: RuntimeError("slow"))
        sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        await actor.add_request(
            EngineRequest("a", [5, 6, 7], sp, (2,), subscriber=old.subscriber, tag=tag)
        )
        while (await queue.get()).new_token_ids == ():
            pass
        new = OutputRouter(ChannelHandle(actor), 4096)
        new.subscriber = old.subscriber  # the same frontend subscribing again
        await new.ensure()
        await idle(actor)  # "a" was aborted and its blocks freed
        assert actor._routes == {} and len(actor._output_channels) == 1
        await new.close()
        await old.close()
        await actor.shutdown()

    run(scenario())
