"""The scheduler Ray actor: one per cluster, drives one step loop per worker.

The actor is async (asyncio): ``generate`` is a streaming generator method the frontend
iterates over (Ray streaming generators), ``abort`` and ``get_stats`` are plain calls. A
loop task per worker repeatedly asks the :class:`Scheduler` for that worker's next
:class:`SchedulerOutput`, awaits the worker's ``execute_model`` and feeds the answer back;
new requests join the running batch between steps (continuous batching).

This module imports Ray but never torch: the scheduler process holds metadata only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.metrics import MetricsSnapshot
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.request import FinishReason, SequenceOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, SchedulerStats, WorkerSpec

log = logging.getLogger(__name__)


class SchedulerActor:
    """Ray actor wrapping :class:`Scheduler` (create with ``ray.remote(num_cpus=0)``).

    Args:
        config: scheduler policy, with ``max_model_len`` set.
        workers: Ray actor handles of the workers, index = worker id.
        specs: the KV pool of each worker (from the workers' ``get_info``).
        probe_interval_s: how often idle workers are pinged (seconds).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        workers: list[Any],
        specs: list[WorkerSpec],
        probe_interval_s: float = 2.0,
    ) -> None:
        self._probe_interval_s = probe_interval_s
        self._scheduler = Scheduler(config, specs)
        self._workers = workers
        self._queues: dict[str, asyncio.Queue[SequenceOutput]] = {}
        self._wakeups: dict[int, asyncio.Event] = {}
        self._loops: dict[int, asyncio.Task[None]] = {}
        self._in_step: set[int] = set()
        self._monitor: asyncio.Task[None] | None = None

    async def ready(self) -> bool:
        """Start the step loops and the liveness probe (idempotent); returns True."""
        loop = asyncio.get_running_loop()
        for wid in self._scheduler.workers:
            if wid not in self._loops:
                self._wakeups[wid] = asyncio.Event()
                step_loop = (
                    self._overlapped_step_loop
                    if self._scheduler.config.async_scheduling
                    else self._step_loop
                )
                self._loops[wid] = loop.create_task(step_loop(wid))
        if self._monitor is None:
            self._monitor = loop.create_task(self._probe_idle_workers(self._probe_interval_s))
        return True

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: list[int],
    ) -> AsyncIterator[list[SequenceOutput]]:
        """Add a request and stream its deltas, batched: each item is a non-empty list.

        The stream ends once every choice has finished. If the consumer goes away, the
        request is aborted (its blocks are freed).

        Raises:
            ServingError: from :meth:`Scheduler.add_request` (InvalidRequest,
                RequestRejected, DuplicateRequest, ClusterUnavailable), before any item.
        """
        await self.ready()
        queue: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self._scheduler.add_request(request_id, prompt_token_ids, sampling, eos_token_ids)
        self._queues[request_id] = queue
        self._wake_all()
        remaining = sampling.n
        try:
            while remaining > 0:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                remaining -= sum(1 for o in batch if o.finish_reason is not None)
                yield batch
        finally:
            # The id may already belong to a newer request (this one finished, the
            # client reused the id): only clean up what is still this stream's.
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
                if remaining > 0:
                    self._scheduler.abort_request(request_id)
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

    async def get_metrics(self) -> MetricsSnapshot:
        """Gauges, counters and histograms for the metrics exporter (one pull per scrape)."""
        return self._scheduler.metrics_snapshot()

    async def check_integrity(self) -> bool:
        """Run every pool's integrity check; raises on a violation, else True."""
        self._scheduler.check_integrity()
        return True

    async def shutdown(self) -> None:
        """Abort everything and stop the step loops."""
        for request_id in list(self._scheduler.requests):
            self._dispatch(self._scheduler.abort_request(request_id))
        tasks = list(self._loops.values())
        if self._monitor is not None:
            tasks.append(self._monitor)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._loops.clear()
        self._monitor = None

    # ------------------------------------------------------------------ internals
    def _wake_all(self) -> None:
        for ev in self._wakeups.values():
            ev.set()

    def _dispatch(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    async def _step_loop(self, worker_id: int) -> None:
        worker = self._workers[worker_id]
        wake = self._wakeups[worker_id]
        sched = self._scheduler
        while True:
            if not sched.has_work(worker_id):
                wake.clear()
                await wake.wait()
                continue
            sched_out = sched.schedule(worker_id)
            if sched.drain_wakeups():
                self._wake_all()  # preempted or unadmittable work: idle workers may take it
            if sched_out.is_empty:
                # Nothing fits on this worker right now (e.g. waiting requests need
                # blocks another worker's step will free): wait for a change.
                wake.clear()
                await wake.wait()
                continue
            self._in_step.add(worker_id)
            try:
                runner_out = await worker.execute_model.remote(sched_out)
            except ray.exceptions.RayActorError:
                log.exception("worker %d died; requeueing its sequences", worker_id)
                self._dispatch(sched.mark_worker_dead(worker_id))
                self._wake_all()  # live workers pick up what was requeued
                return
            except Exception:
                log.exception("worker %d failed a step; aborting its requests", worker_id)
                self._dispatch(sched.fail_step(worker_id, sched_out))
                self._wake_all()
                continue
            finally:
                self._in_step.discard(worker_id)
            outputs = sched.update(worker_id, sched_out, runner_out)
            self._dispatch(outputs)
            if any(o.finish_reason is not None for o in outputs) or sched.drain_wakeups():
                self._wake_all()  # freed blocks may let another worker admit

    async def _overlapped_step_loop(self, worker_id: int) -> None:
        """:meth:`_step_loop` with step t+1 planned and sent while step t runs.

        The scheduler plans t+1 as if t's decodes each yield one token (``Sequence.
        num_pending_tokens``) and reconciles when t's answer arrives; the worker actor runs
        one call at a time, in order, so t+1 starts as soon as t ends, without waiting
        for the scheduler's update and the next schedule. A stop found in t's answer
        drops that sequence's t+1 result (one wasted slot, never streamed).
        """
        worker = self._workers[worker_id]
        wake = self._wakeups[worker_id]
        sched = self._scheduler
        inflight: tuple[SchedulerOutput, Any] | None = None
        while True:
            nxt: tuple[SchedulerOutput, Any] | None = None
            if sched.has_work(worker_id):
                sched_out = sched.schedule(worker_id)
                if sched.drain_wakeups():
                    self._wake_all()
                if not sched_out.is_empty:
                    self._in_step.add(worker_id)
                    nxt = (sched_out, worker.execute_model.remote(sched_out))
            if inflight is None:
                if nxt is None:
                    wake.clear()
                    await wake.wait()
                else:
                    inflight = nxt  # plan the next step while this one runs
                continue
            sched_out, ref = inflight
            try:
                runner_out = await ref
            except ray.exceptions.RayActorError:
                log.exception("worker %d died; requeueing its sequences", worker_id)
                self._in_step.discard(worker_id)
                self._dispatch(sched.mark_worker_dead(worker_id))
                self._wake_all()
                return
            except Exception:
                log.exception("worker %d failed a step; aborting its requests", worker_id)
                self._dispatch(sched.fail_step(worker_id, sched_out))
                self._wake_all()
                inflight = nxt
                continue
            finally:
                if nxt is None:
                    self._in_step.discard(worker_id)
            inflight = nxt
            outputs = sched.update(worker_id, sched_out, runner_out)
            self._dispatch(outputs)
            if any(o.finish_reason is not None for o in outputs) or sched.drain_wakeups():
                self._wake_all()

    async def _probe_idle_workers(self, interval_s: float = 2.0, timeout_s: float = 30.0) -> None:
        """Ping idle live workers so a worker that dies between steps is noticed.

        A busy worker is checked by its own step call instead (a ping would queue behind
        the step on the single-threaded worker actor).
        """
        while True:
            await asyncio.sleep(interval_s)
            for wid, ws in self._scheduler.workers.items():
                if not ws.alive or wid in self._in_step:
                    continue
                try:
                    await asyncio.wait_for(self._workers[wid].ping.remote(), timeout_s)
                except (TimeoutError, ray.exceptions.RayActorError):
                    if wid in self._in_step or not ws.alive:
                        continue  # a step started meanwhile: it will see the failure
                    log.error("worker %d does not answer; taking it out of service", wid)
                    self._dispatch(self._scheduler.mark_worker_dead(wid))
                    self._wake_all()


__all__ = ["FinishReason", "SchedulerActor"]
