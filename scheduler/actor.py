"""The scheduler Ray actor: one per cluster, drives one step loop per worker.

The actor is async (asyncio). A frontend opens one output stream, over its output channel
(:meth:`SchedulerActor.attach_output_channel`: one TCP connection the frontend listens on,
:mod:`pagedserve.scheduler.output_channel`) or as a Ray streaming generator
(:meth:`SchedulerActor.subscribe`), and adds requests with ``add_request`` (an
:class:`~pagedserve.scheduler.engine_messages.EngineRequest` naming that stream): every
step's outputs for all of that frontend's requests travel as one frame or item of that
stream, tagged, so the cost per step does not grow with the number of requests (vLLM v1's
engine core likewise sends one message of outputs per step). That stream is the only
output path. ``abort`` and ``get_stats`` are plain calls. A step loop per worker,
:class:`~pagedserve.scheduler.engine_loop.EngineLoop`'s, plans each step with the
:class:`Scheduler`, awaits the worker's ``execute_model`` and feeds the answer back; new
requests join the running batch between steps (continuous batching). The actor adds the
Ray plumbing only: the worker handles (:class:`RayWorker`), resetting the workers before
the first step, the liveness probe and revival. The steps themselves go over each worker's
step channel (:mod:`pagedserve.scheduler.step_channel`, opened after the reset and again
after a revival), or as Ray calls with ``step_channel=False`` or where a channel cannot be
opened.

This module imports Ray but never torch: the scheduler process holds metadata only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import ray

from pagedserve.scheduler import gc_tuning
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.disagg import DisaggConfig
from pagedserve.scheduler.engine_loop import EngineLoop, WorkerDied
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.errors import NoOutputStream
from pagedserve.scheduler.metrics import MetricsSnapshot
from pagedserve.scheduler.output_channel import OutputChannelSender
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.scheduler import Scheduler, SchedulerStats, WorkerSpec
from pagedserve.scheduler.step_channel import StepChannelAddress, StepChannelClient
from pagedserve.scheduler.swap import SwapSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestRoute:
    """Where one request's outputs go (the actor's per-request record).

    Attributes:
        subscriber: the output stream (:meth:`SchedulerActor.subscribe`'s name).
        tag: the number its outputs carry on that stream (:attr:`EngineRequest.tag`).
        choices_left: choices not finished yet; the record is dropped at 0.
    """

    subscriber: str
    tag: int
    choices_left: int


class RayWorker:
    """A worker actor as the engine loop's :class:`~pagedserve.scheduler.engine_loop.
    WorkerHandle`: the step goes at once on the worker's open step channel, else as
    ``execute_model.remote`` to the actor's current handle (the owner's, which a revival
    may look up again); a dead or missing actor (``RayActorError``, or the channel's
    connection lost) surfaces as :class:`WorkerDied`."""

    def __init__(self, owner: SchedulerActor, worker_id: int) -> None:
        self._owner = owner
        self._worker_id = worker_id

    def execute(self, sched_out: SchedulerOutput) -> Awaitable[RunnerOutput]:
        channel = self._owner._channels.get(self._worker_id)
        if channel is not None:
            if not channel.closed:
                return channel.execute(sched_out)
            # Lost: this step goes through Ray (which tells a dead actor from a live one).
            del self._owner._channels[self._worker_id]
        actor = self._owner._workers[self._worker_id]
        if actor is None:
            return self._gone()
        return self._answer(actor.execute_model.remote(sched_out))

    @staticmethod
    async def _gone() -> RunnerOutput:
        raise WorkerDied("no actor of that name")

    @staticmethod
    async def _answer(ref: Any) -> RunnerOutput:
        try:
            out: RunnerOutput = await ref
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(str(exc)) from exc
        return out


class SchedulerActor:
    """Ray actor wrapping :class:`Scheduler` (create with ``ray.remote(num_cpus=0)``).

    Args:
        config: scheduler policy, with ``max_model_len`` set.
        workers: the workers, index = worker id: Ray actor handles, or the names of
            named actors in this job's namespace (looked up with ``ray.get_actor``). The
            launcher passes names: Ray warns on every start of a restartable actor whose
            constructor arguments hold actor handles (ray-project/ray#53727), and a
            restarted scheduler then looks its workers up again.
        specs: the KV pool of each worker (from the workers' ``get_info``).
        probe_interval_s: how often idle workers are pinged (seconds).
        swap: the host block stores for swap preemption: one spec for every worker, or
            one per worker that may swap (see :class:`Scheduler`); None: recompute only.
        tune_gc: apply :func:`pagedserve.scheduler.gc_tuning.tune_gc` to this process
            (the launcher does: the actor has its process to itself; in-process tests
            leave the test process's collector alone).
        reset_timeout_s: how long the start (first or after a restart) waits for each
            worker's ``reset`` (seconds). A worker that is not found by name, or does not
            answer in time, is taken out of service as after a death and the actor serves
            with the others; the probe brings it back if it answers later.
        namespace: the Ray namespace of the named workers (None: this job's).
        frontend_info: what an attached frontend needs to serve this cluster (the
            launcher's model description and tokenizer files), returned as given by
            :meth:`get_frontend_info`; opaque to the scheduler.
        disagg: prefill/decode disaggregation (see :class:`Scheduler`); None: off.
        step_channel: send the steps over each worker's step channel (the default);
            False: as Ray calls.
        channel_timeout_s: how long opening a step channel may take (seconds); a worker
            whose channel does not open takes its steps as Ray calls.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        workers: list[Any],
        specs: list[WorkerSpec],
        probe_interval_s: float = 2.0,
        swap: SwapSpec | Mapping[int, SwapSpec] | None = None,
        tune_gc: bool = False,
        reset_timeout_s: float = 10.0,
        namespace: str | None = None,
        frontend_info: dict[str, Any] | None = None,
        disagg: DisaggConfig | None = None,
        step_channel: bool = True,
        channel_timeout_s: float = 10.0,
    ) -> None:
        if tune_gc:
            log.info("gc thresholds %s", gc_tuning.tune_gc(config.max_num_seqs, len(specs)))
        self._probe_interval_s = probe_interval_s
        self._frontend_info = frontend_info
        self._scheduler = Scheduler(config, specs, swap, disagg)
        self._reset_timeout_s = reset_timeout_s
        self._names = [w if isinstance(w, str) else None for w in workers]
        self._namespace = namespace
        # None: a named worker not found (gone for good): taken out of service at start.
        self._workers: list[Any] = [w if not isinstance(w, str) else None for w in workers]
        for wid in range(len(workers)):
            if self._workers[wid] is None:
                self._workers[wid] = self._lookup(wid)
        # subscriber -> its stream's queue of (tag, output); request id -> its route
        self._subscribers: dict[str, asyncio.Queue[tuple[int, SequenceOutput]]] = {}
        self._output_channels: dict[str, asyncio.Task[None]] = {}  # subscriber -> pump
        self._routes: dict[str, RequestRoute] = {}
        self._step_channel = step_channel
        self._channel_timeout_s = channel_timeout_s
        self._channels: dict[int, StepChannelClient] = {}
        self._engine = EngineLoop(
            self._scheduler,
            {wid: RayWorker(self, wid) for wid in range(len(self._workers))},
            self._dispatch,
            step_deadlines=True,
        )
        self._loops: dict[int, asyncio.Task[None]] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._stopped: asyncio.Event | None = None
        self._workers_reset: asyncio.Task[None] | None = None

    async def ready(self) -> bool:
        """Start the step loops and the liveness probe (idempotent); returns True.

        The first call also clears every worker's per-sequence state (``Worker.reset``):
        a scheduler restarted by Ray starts empty, and the workers must not keep the
        sequences of its previous life. Each worker's loop starts once its reset is
        answered; a worker missing (killed for good) or silent for ``reset_timeout_s``
        is taken out of service instead, so a restart serves with the workers left.
        """
        loop = asyncio.get_running_loop()
        if self._workers_reset is None:
            self._workers_reset = loop.create_task(self._start_workers())
        if self._monitor is None:
            self._monitor = loop.create_task(self._probe_idle_workers(self._probe_interval_s))
        await self._workers_reset  # no request is added before the workers are clean
        return True

    async def wait_stopped(self) -> bool:
        """Return only once :meth:`shutdown` ran (True). The frontend keeps one such call
        pending: Ray fails it as soon as this actor dies, which is how a dead scheduler
        is noticed at once."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()
        return True

    async def process_id(self) -> tuple[str, int]:
        """(Ray node id, process id) of this actor, so the frontend can watch it."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    async def _start_workers(self) -> None:
        """Reset every worker (bounded by ``reset_timeout_s``), take out of service the
        ones missing or not answering, and start the step loops of the others."""

        async def one(wid: int, worker: Any) -> bool:
            if worker is None:
                return False
            try:
                await asyncio.wait_for(worker.reset.remote(), self._reset_timeout_s)
            except Exception:
                log.warning("worker %d did not answer its reset", wid, exc_info=True)
                return False
            await self._open_channel(wid, worker)
            return True

        answered = await asyncio.gather(*(one(w, h) for w, h in enumerate(self._workers)))
        for wid, ok in enumerate(answered):
            if not ok:
                log.error("worker %d is out of service until it answers the probe", wid)
                self._dispatch(self._scheduler.mark_worker_dead(wid))
        for wid, ws in self._scheduler.workers.items():
            if ws.alive and wid not in self._loops:
                self._loops[wid] = self._engine.start(wid)

    async def _open_channel(self, worker_id: int, worker: Any) -> None:
        """Open ``worker``'s step channel (closing the one it had); where it cannot be
        opened its steps go as Ray calls."""
        old = self._channels.pop(worker_id, None)
        if old is not None:
            await old.close()
        if not self._step_channel:
            return
        timeout_s = self._channel_timeout_s
        try:
            here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
            address = await asyncio.wait_for(
                worker.open_step_channel.remote(peer_node_id=here), timeout_s
            )
            self._channels[worker_id] = await StepChannelClient.connect(
                address, timeout_s, name=f"worker {worker_id}"
            )
            log.info(
                "worker %d: steps on the channel to %s:%d", worker_id, address.host, address.port
            )
        except Exception:
            log.warning(
                "worker %d: no step channel; its steps go as Ray calls", worker_id, exc_info=True
            )

    def _lookup(self, worker_id: int) -> Any:
        """The handle of a named worker, or None when no actor has that name (anymore)."""
        name = self._names[worker_id]
        if name is None:
            return None
        try:
            handle = ray.get_actor(name, namespace=self._namespace)
        except ValueError:
            return None
        self._workers[worker_id] = handle
        return handle

    async def get_frontend_info(self) -> dict[str, Any] | None:
        """What an attached frontend needs (the ``frontend_info`` given at creation)."""
        return self._frontend_info

    async def subscribe(self, subscriber: str) -> AsyncIterator[list[tuple[int, SequenceOutput]]]:
        """The output stream of every request ``subscriber`` adds with :meth:`add_request`,
        as a Ray streaming generator (:meth:`attach_output_channel` is the TCP one).

        The first item is an empty list (the subscription exists from then on); every later
        one is a non-empty list of ``(tag, output)``, all outputs queued since the last
        item (one step's worth, or more when the consumer is slower). A new subscription
        under the same name replaces the old one. When the consumer goes away, every
        request it added that has not finished is aborted (its blocks are freed).
        """
        await self.ready()
        queue: asyncio.Queue[tuple[int, SequenceOutput]] = asyncio.Queue()
        self._replace_subscription(subscriber, queue)
        try:
            yield []
            while True:
                yield await _next_batch(queue)
        finally:
            self._unsubscribe(subscriber, queue)

    async def attach_output_channel(self, subscriber: str, address: StepChannelAddress) -> bool:
        """Send the outputs of every request ``subscriber`` adds with :meth:`add_request`
        over the frontend's output channel at ``address``
        (:mod:`pagedserve.scheduler.output_channel`); returns True once connected (the
        subscription exists from then on).

        Each frame is a non-empty list of ``(tag, output)``, as :meth:`subscribe`'s items.
        A new subscription under the same name replaces the old one (a frontend subscribes
        again only once it lost the old stream: the old one's unfinished requests are
        aborted). When the connection ends, every request the subscriber added that has
        not finished is aborted. The connection has TCP keepalive and a 30 s limit on
        unacknowledged data, so a frontend whose node vanished is noticed within about 30 s.

        Raises:
            ConnectionError / TimeoutError / OSError: the channel did not open within the
                channel timeout (nothing is subscribed).
        """
        await self.ready()
        queue: asyncio.Queue[tuple[int, SequenceOutput]] = asyncio.Queue()
        pump: list[asyncio.Task[None]] = []

        def on_close() -> None:
            if pump:
                pump[0].cancel()

        sender = await OutputChannelSender.connect(address, self._channel_timeout_s, on_close)
        self._replace_subscription(subscriber, queue)

        async def run() -> None:
            try:
                while True:
                    await sender.send(await _next_batch(queue))
            except asyncio.CancelledError:
                pass
            except OSError as exc:  # ConnectionError, TimeoutError: the frontend is gone
                log.warning(
                    "output channel of %s ended: %s: %s", subscriber, type(exc).__name__, exc
                )
            except Exception:
                log.exception("output channel of %s failed", subscriber)
            finally:
                await sender.close()
                self._unsubscribe(subscriber, queue)

        def forget(task: asyncio.Task[None]) -> None:
            if self._output_channels.get(subscriber) is task:
                del self._output_channels[subscriber]

        pump.append(asyncio.get_running_loop().create_task(run()))
        self._output_channels[subscriber] = pump[0]
        pump[0].add_done_callback(forget)
        if sender.closed:  # ended during the handshake's last step
            pump[0].cancel()
        return True

    def _replace_subscription(self, subscriber: str, queue: asyncio.Queue[Any]) -> None:
        """Make ``queue`` ``subscriber``'s stream. An older subscription of the same name
        is ended first (its channel closed, its unfinished requests aborted): the frontend
        subscribes again only after it lost that stream and failed those requests."""
        old = self._subscribers.get(subscriber)
        if old is not None:
            self._unsubscribe(subscriber, old)
        old_pump = self._output_channels.pop(subscriber, None)
        if old_pump is not None:
            old_pump.cancel()
        self._subscribers[subscriber] = queue

    def _unsubscribe(self, subscriber: str, queue: asyncio.Queue[Any]) -> None:
        """End ``subscriber``'s subscription (unless a newer one replaced it) and abort
        the requests it added that have not finished."""
        if self._subscribers.get(subscriber) is not queue:
            return
        del self._subscribers[subscriber]
        orphans = [r for r, e in self._routes.items() if e.subscriber == subscriber]
        for request_id in orphans:
            self._dispatch(self._scheduler.abort_request(request_id))
            self._routes.pop(request_id, None)
        if orphans:
            self._wake_all()

    async def add_request(self, request: EngineRequest) -> None:
        """Add a request whose outputs go to ``request.subscriber``'s stream, tagged
        ``request.tag``.

        Returns once the request is queued (from then on an abort reaches it).

        Raises:
            NoOutputStream: the subscriber has no open stream (e.g. this actor was
                restarted since it subscribed).
            ServingError: from :meth:`Scheduler.add_request` (InvalidRequest,
                RequestRejected, DuplicateRequest, ClusterUnavailable).
        """
        await self.ready()
        if request.subscriber not in self._subscribers:
            raise NoOutputStream(
                f"no output stream is open for {request.subscriber!r} (the scheduler restarted?)"
            )
        self._scheduler.add_request(request)
        self._routes[request.request_id] = RequestRoute(
            request.subscriber, request.tag, request.sampling.n
        )
        self._wake_all()

    async def abort(
        self, request_id: str, choice_index: int | None = None, stop: bool = False
    ) -> bool:
        """Abort a request (or one choice); True when something was in flight.

        Its stream gets final deltas with reason ABORT, or STOP when ``stop`` (the
        frontend matched a stop string).
        """
        reason = FinishReason.STOP if stop else FinishReason.ABORT
        outputs = self._scheduler.abort_request(request_id, choice_index, reason)
        self._dispatch(outputs)
        self._wake_all()
        return bool(outputs)

    async def num_live_workers(self) -> int:
        """Workers still serving (a worker whose step failed is taken out)."""
        return self._scheduler.num_live_workers

    async def get_stats(self) -> SchedulerStats:
        """A snapshot of queue lengths and per-worker block pools."""
        return self._scheduler.stats()

    async def reset_prefix_cache(self) -> bool:
        """:meth:`Scheduler.reset_prefix_cache`: False while any block is in use."""
        return self._scheduler.reset_prefix_cache()

    async def get_metrics(self) -> MetricsSnapshot:
        """Gauges, counters and histograms for the metrics exporter (one pull per scrape)."""
        return self._scheduler.metrics_snapshot()

    async def check_integrity(self) -> bool:
        """Run every pool's integrity check; raises on a violation, else True."""
        self._scheduler.check_integrity()
        return True

    async def shutdown(self) -> None:
        """Abort everything and stop the step loops."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        self._stopped.set()
        for request_id in list(self._scheduler.requests):
            self._dispatch(self._scheduler.abort_request(request_id))
        tasks = list(self._loops.values())
        if self._monitor is not None:
            tasks.append(self._monitor)
        # NOTE: asyncio.wait_for (Python 3.11) can swallow a cancel that arrives as its
        # inner call completes (the probe's ping): cancel until the task is really done.
        while pending := [t for t in tasks if not t.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.1)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._loops.clear()
        self._monitor = None
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # ------------------------------------------------------------------ internals
    def _wake_all(self) -> None:
        self._engine.wake_all()

    def _dispatch(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            stream = self._subscribers.get(route.subscriber)
            if stream is not None:
                stream.put_nowait((route.tag, out))
            if out.finish_reason is not None:
                route.choices_left -= 1
                if route.choices_left <= 0:
                    del self._routes[out.request_id]

    async def _probe_idle_workers(self, interval_s: float = 2.0, timeout_s: float = 30.0) -> None:
        """Ping idle live workers so a worker that dies between steps is noticed, and
        dead ones so a worker Ray restarted rejoins (:meth:`_try_revive`).

        A busy worker is checked by its own step instead (over Ray calls, a ping would
        queue behind the step on the single-threaded worker actor).
        """
        while True:
            await asyncio.sleep(interval_s)
            for wid, ws in self._scheduler.workers.items():
                if not ws.alive and wid not in self._engine.in_step:
                    await self._try_revive(wid, max(1.0, interval_s))
                    continue
                if wid in self._engine.in_step:
                    continue
                try:
                    await asyncio.wait_for(self._workers[wid].ping.remote(), timeout_s)
                except (TimeoutError, ray.exceptions.RayActorError):
                    if wid in self._engine.in_step or not ws.alive:
                        continue  # a step started meanwhile: it will see the failure
                    log.error("worker %d does not answer; taking it out of service", wid)
                    self._dispatch(self._scheduler.mark_worker_dead(wid))
                    self._wake_all()

    async def _try_revive(self, worker_id: int, timeout_s: float) -> None:
        """Bring a worker taken out of service back when it answers again (Ray restarted
        its actor, ``max_restarts``): its state is cleared, its pool starts empty, and it
        rejoins routing with a new step loop."""
        worker = self._workers[worker_id] or self._lookup(worker_id)
        if worker is None:
            return  # gone for good (or not restarted yet)
        try:
            await asyncio.wait_for(worker.ping.remote(), timeout_s)
            await asyncio.wait_for(worker.reset.remote(), timeout_s)
            swap = self._scheduler.swap_spec(worker_id)
            if swap is not None and swap.host_store_address is not None:
                # A restarted actor is a new process: connect it to its host store again.
                await asyncio.wait_for(
                    worker.connect_host_store.remote(swap.host_store_address), timeout_s
                )
        except (TimeoutError, ray.exceptions.RayActorError):
            return  # still dead (or restarting)
        if self._scheduler.workers[worker_id].alive:
            return  # revived meanwhile
        await self._open_channel(worker_id, worker)
        if self._scheduler.workers[worker_id].alive:
            return
        task = self._engine.rejoin(worker_id)  # its loop ended at the death (a probe's: idles)
        if task is not None:
            self._loops[worker_id] = task
        log.warning("worker %d is back in service (empty pool)", worker_id)
        self._wake_all()


async def _next_batch(queue: asyncio.Queue[Any]) -> list[Any]:
    """Wait for one item of ``queue``, then take every item queued behind it."""
    batch = [await queue.get()]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch


__all__ = ["RequestRoute", "SchedulerActor"]
