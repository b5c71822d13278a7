"""The step loop: one per worker, schedule -> execute -> update, serial or overlapped.

Every driver of the engine runs this loop: the scheduler Ray actor
(:class:`~pagedserve.scheduler.actor.SchedulerActor` adds only the Ray plumbing), the
offline :class:`pagedserve.LLM`, the tests and the benchmarks. As vLLM v1's
``EngineCore`` (``step_fn = step if batch_queue is None else step_with_batch_queue``) the
loop kind is chosen once, from ``SchedulerConfig.async_scheduling``:

- serial: plan a step, await its answer, apply it, plan the next;
- overlapped: step t+1 is planned and sent while step t runs (the scheduler assumes each
  decode of t yields one token and reconciles when t's answer arrives), so the worker,
  which runs its steps one at a time in order, starts t+1 as soon as t ends. A stop found
  in t's answer drops that sequence's t+1 result (one wasted slot, never streamed). No
  step is planned past one that swaps a group in (:meth:`Scheduler.can_plan_past`): its
  answer is awaited first.

A worker is anything with ``execute(sched_out) -> Awaitable[RunnerOutput]``
(:class:`WorkerHandle`). The call must send the step at once (overlap relies on it); the
awaitable raises :class:`WorkerDied` when the worker is gone (its sequences are requeued
on the live workers and the loop ends) and anything else for a failed step (its requests
are aborted and the loop goes on). A step unanswered past its deadline,
``max(step_deadline_floor_s, step_deadline_factor x the worker's moving-average step
time)`` (``SchedulerConfig``; the clock starts when the worker can start the step: when
it is sent or when the previous step is answered, whichever is later), marks the worker
suspect (when the loop enforces deadlines, ``step_deadlines``: the scheduler actor's
does): handled as a death (sequences requeued, the loop ends), the late answer is
discarded when it comes, and :meth:`EngineLoop.rejoin` puts the worker back once it
answers again (the scheduler actor's liveness probe calls it). Idle loops sleep until
:meth:`EngineLoop.wake_all`;
the loop itself wakes the others when a plan or an update says so (``wake_others``), and
after a death or a failed step.

This module imports neither Ray nor torch (an import-linter contract checks it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.scheduler.engine_messages import SequenceOutput
    from pagedserve.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

Sink = Callable[[list["SequenceOutput"]], None]
PlanHook = Callable[[int, SchedulerOutput, "SchedulerOutput | None"], None]
StepHook = Callable[[int, SchedulerOutput, RunnerOutput], None]


class WorkerDied(Exception):
    """Raised by a :class:`WorkerHandle`'s awaitable when the worker process is gone
    (a Ray actor's ``RayActorError``); any other exception is a failed step."""


class StepDeadlineExceeded(Exception):
    """A step went unanswered past its deadline (raised inside the loop only)."""


# Weight of the newest step in a worker's moving-average step time.
STEP_TIME_EMA_ALPHA = 0.2


class WorkerHandle(Protocol):
    """One worker as the step loop sees it."""

    def execute(self, sched_out: SchedulerOutput) -> Awaitable[RunnerOutput]:
        """Send one step now; the awaitable gives its answer.

        Raises (from the awaitable):
            WorkerDied: the worker is gone.
            Exception: any other: the step failed.
        """
        ...


class ThreadWorker:
    """An in-process worker as a :class:`WorkerHandle`: ``execute_model`` runs on one
    thread of its own, so steps run in order and an overlapped loop plans step t+1 while
    t runs (torch releases the GIL inside its kernels).

    Args:
        execute_model: ``Worker.execute_model`` or a fake with the same signature.
        submit: queues ``execute_model(sched_out)`` on the thread that runs the steps and
            returns its ``concurrent.futures.Future`` (``Worker.model_thread.future``: the
            step t+1 sent while t runs is then queued there and starts without a thread
            switch); None: a thread of this handle's own.
    """

    def __init__(
        self,
        execute_model: Callable[[SchedulerOutput], RunnerOutput],
        submit: Callable[..., Future[RunnerOutput]] | None = None,
    ) -> None:
        self._execute_model = execute_model
        self._pool: ThreadPoolExecutor | None = None
        if submit is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-worker")
            submit = self._pool.submit
        self._submit = submit

    def execute(self, sched_out: SchedulerOutput) -> Awaitable[RunnerOutput]:
        return asyncio.wrap_future(self._submit(self._execute_model, sched_out))

    def close(self) -> None:
        """Stop this handle's thread, if it has one (after the step it runs, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class InlineWorker:
    """An in-process worker as a :class:`WorkerHandle` that runs each step on the event
    loop's thread when it is sent (an answered future comes back): for one serial worker
    whose steps must run on the caller's thread (a profiler's), and deterministic runs.

    Args:
        execute_model: ``Worker.execute_model`` or a fake with the same signature.
    """

    def __init__(self, execute_model: Callable[[SchedulerOutput], RunnerOutput]) -> None:
        self._execute_model = execute_model

    def close(self) -> None:
        """Nothing to stop (the steps ran on the caller's thread)."""

    def execute(self, sched_out: SchedulerOutput) -> Awaitable[RunnerOutput]:
        answer: asyncio.Future[RunnerOutput] = asyncio.get_running_loop().create_future()
        try:
            answer.set_result(self._execute_model(sched_out))
        except Exception as exc:  # a failed step, raised where the answer is awaited
            answer.set_exception(exc)
        return answer


class EngineLoop:
    """The step loops of a :class:`Scheduler`'s workers.

    Args:
        scheduler: the scheduler; ``scheduler.config.async_scheduling`` picks the loop.
        workers: worker id -> handle, for every worker of ``scheduler``.
        sink: receives every list of deltas the scheduler returns (update, a death, a
            failed step), in order; called on the loop's thread, never concurrently.
        on_plan: ``(worker_id, planned, in_flight)`` after a step is sent (``in_flight``:
            the step still running, overlapped loop only) — for tests.
        on_step: ``(worker_id, sched_out, runner_out)`` after an answer is applied and
            its deltas sunk — for tests (integrity checks) and benchmarks (timings).
        step_deadlines: enforce the step deadline of ``scheduler.config``
            (``step_deadline_floor_s``, ``step_deadline_factor``): for remote workers (the
            scheduler actor's), whose link can stall; in-process drivers (the offline
            ``LLM``, benchmarks) leave it off, as a slow local step is no lost worker.

    Attributes:
        overlapped: the loop kind (``scheduler.config.async_scheduling``).
        in_step: ids of the workers with a step in flight (a liveness probe skips them:
            a ping would queue behind the step).
        step_time_s: worker id -> moving average of its step time, seconds (from the
            moment the worker could start a step to its answer; absent before the first).
        deadline_misses: worker id -> how many steps missed their deadline.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        workers: Mapping[int, WorkerHandle],
        sink: Sink,
        on_plan: PlanHook | None = None,
        on_step: StepHook | None = None,
        step_deadlines: bool = False,
    ) -> None:
        missing = set(scheduler.workers) - set(workers)
        if missing:
            raise ValueError(f"no handle for workers {sorted(missing)}")
        self._scheduler = scheduler
        self._workers = workers
        self._sink = sink
        self._on_plan = on_plan
        self._on_step = on_step
        self._step_deadlines = step_deadlines
        self._wakeups = {wid: asyncio.Event() for wid in scheduler.workers}
        self._running: set[int] = set()  # workers whose loop has not ended
        self._waiting: set[int] = set()  # ... of those, the ones asleep
        self._idle = asyncio.Event()
        self._until: Callable[[], bool] | None = None
        self.in_step: set[int] = set()
        self.step_time_s: dict[int, float] = {}
        self.deadline_misses: dict[int, int] = {}
        self._last_answer: dict[int, float] = {}
        self.overlapped = scheduler.config.async_scheduling
        self._step_loop = self._overlapped if self.overlapped else self._serial

    # ------------------------------------------------------------------ driving
    def start(self, worker_id: int, after: Awaitable[Any] | None = None) -> asyncio.Task[None]:
        """Start ``worker_id``'s loop as a task of the running event loop (once ``after``
        is done, when given). The task ends when the worker dies, or when cancelled.

        Raises:
            RuntimeError: that worker's loop is running already.
        """
        if worker_id in self._running:
            raise RuntimeError(f"worker {worker_id}'s loop is already running")
        self._running.add(worker_id)
        return asyncio.get_running_loop().create_task(self._run(worker_id, after))

    async def _run(self, worker_id: int, after: Awaitable[Any] | None) -> None:
        try:
            if after is not None:
                await after
            await self._step_loop(worker_id)
        finally:
            self._running.discard(worker_id)
            self.in_step.discard(worker_id)
            self._note_idle()

    async def run_until_idle(self, until: Callable[[], bool] | None = None) -> None:
        """Run every live worker's loop until all of them sleep with nothing in flight
        (no worker can make progress), then stop them.

        Work may be left when no live worker can take it (every worker died, or a
        request waits for blocks nothing will free): callers check ``has_work``.

        Args:
            until: checked before each step is planned; once True no step is planned and
                the run ends when the steps in flight are applied (benchmarks run a
                fixed number of steps with it).

        Raises:
            Exception: whatever a loop raised (a hook's assertion, a scheduler bug).
        """
        tasks = [self.start(w) for w, ws in self._scheduler.workers.items() if ws.alive]
        idle: asyncio.Future[Any] | None = None
        self._until = until
        try:
            while tasks and not self.idle:
                self._idle.clear()
                idle = asyncio.ensure_future(self._idle.wait())
                done, _ = await asyncio.wait([idle, *tasks], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not idle:
                        tasks.remove(task)  # type: ignore[arg-type]
                        task.result()  # a loop's error ends the run
        finally:
            self._until = None
            if idle is not None:
                idle.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def idle(self) -> bool:
        """True when every running loop sleeps and none was woken since."""
        return all(w in self._waiting and not self._wakeups[w].is_set() for w in self._running)

    def wake_all(self) -> None:
        """Wake every sleeping loop (work was added, aborted, freed or moved)."""
        for ev in self._wakeups.values():
            ev.set()

    def rejoin(self, worker_id: int) -> asyncio.Task[None] | None:
        """Put a worker taken out of service (dead, or suspect after a missed deadline)
        back once it answers again and its state is cleared: a fresh pool
        (:meth:`Scheduler.revive_worker`), its moving-average step time forgotten, and
        its loop started unless it still runs. Returns the new loop's task, or None.

        Raises:
            IntegrityError: the worker is alive or still holds sequences.
        """
        self._scheduler.revive_worker(worker_id)
        self.step_time_s.pop(worker_id, None)
        self._last_answer.pop(worker_id, None)
        self.wake_all()
        if worker_id in self._running:
            return None
        return self.start(worker_id)

    # ------------------------------------------------------------------ the loops
    def _has_work(self, worker_id: int) -> bool:
        if self._until is not None and self._until():
            return False
        return self._scheduler.has_work(worker_id)

    async def _serial(self, worker_id: int) -> None:
        worker = self._workers[worker_id]
        sched = self._scheduler
        while True:
            if not self._has_work(worker_id):
                await self._sleep(worker_id)
                continue
            plan = sched.schedule(worker_id)
            if plan.wake_others:
                self.wake_all()  # preempted or unadmittable work: idle workers may take it
            sched_out = plan.output
            if sched_out.is_empty:
                # Nothing fits on this worker right now (e.g. waiting requests need
                # blocks another worker's step will free): wait for a change.
                await self._sleep(worker_id)
                continue
            self.in_step.add(worker_id)
            sent_at = time.monotonic()
            pending = worker.execute(sched_out)
            if self._on_plan is not None:
                self._on_plan(worker_id, sched_out, None)
            try:
                runner_out = await self._answer(worker_id, pending, sent_at)
            except WorkerDied:
                self._died(worker_id)
                return
            except StepDeadlineExceeded:
                self._suspect(worker_id)
                return
            except Exception:
                self._failed(worker_id, sched_out)
                continue
            finally:
                self.in_step.discard(worker_id)
            self._apply(worker_id, sched_out, runner_out)

    async def _overlapped(self, worker_id: int) -> None:
        worker = self._workers[worker_id]
        sched = self._scheduler
        inflight: tuple[SchedulerOutput, Awaitable[RunnerOutput], float] | None = None
        while True:
            nxt: tuple[SchedulerOutput, Awaitable[RunnerOutput], float] | None = None
            ahead = inflight is None or sched.can_plan_past(inflight[0])
            if ahead and self._has_work(worker_id):
                plan = sched.schedule(worker_id)
                if plan.wake_others:
                    self.wake_all()
                if not plan.output.is_empty:
                    self.in_step.add(worker_id)
                    sent_at = time.monotonic()
                    nxt = (plan.output, worker.execute(plan.output), sent_at)
                    if self._on_plan is not None:
                        self._on_plan(worker_id, plan.output, inflight[0] if inflight else None)
            if inflight is None:
                if nxt is None:
                    await self._sleep(worker_id)
                else:
                    inflight = nxt  # plan the next step while this one runs
                continue
            sched_out, pending, sent_at = inflight
            try:
                runner_out = await self._answer(worker_id, pending, sent_at)
            except (WorkerDied, StepDeadlineExceeded) as exc:
                if nxt is not None:
                    _discard(nxt[1])
                if isinstance(exc, WorkerDied):
                    self._died(worker_id)
                else:
                    self._suspect(worker_id)
                return
            except Exception:
                self._failed(worker_id, sched_out)
                inflight = nxt
                continue
            finally:
                if nxt is None:
                    self.in_step.discard(worker_id)
            inflight = nxt
            self._apply(worker_id, sched_out, runner_out)

    # ------------------------------------------------------------------ one place each
    def deadline_s(self, worker_id: int) -> float | None:
        """The current step deadline of ``worker_id``, seconds (None: no deadline)."""
        cfg = self._scheduler.config
        floor = cfg.step_deadline_floor_s
        if not self._step_deadlines or floor <= 0:
            return None
        avg = self.step_time_s.get(worker_id)
        return floor if avg is None else max(floor, cfg.step_deadline_factor * avg)

    async def _answer(
        self, worker_id: int, pending: Awaitable[RunnerOutput], sent_at: float
    ) -> RunnerOutput:
        """Await a step's answer within its deadline and fold its time into the worker's
        moving average. The clock starts when the worker can start the step: at
        ``sent_at`` or at the previous step's answer, whichever is later.

        Raises:
            StepDeadlineExceeded: no answer in time (the answer is discarded).
            WorkerDied / Exception: from ``pending``.
        """
        start = max(sent_at, self._last_answer.get(worker_id, sent_at))
        deadline = self.deadline_s(worker_id)
        if deadline is None:
            out = await pending
        else:
            answer = asyncio.ensure_future(pending)
            try:
                await asyncio.wait({answer}, timeout=max(0.0, start + deadline - time.monotonic()))
            finally:
                if not answer.done():
                    _discard(answer)
            if not answer.done():
                raise StepDeadlineExceeded(f"worker {worker_id}: no answer in {deadline:.3g} s")
            out = answer.result()
        now = time.monotonic()
        self._last_answer[worker_id] = now
        took = now - start
        avg = self.step_time_s.get(worker_id)
        self.step_time_s[worker_id] = (
            took if avg is None else avg + STEP_TIME_EMA_ALPHA * (took - avg)
        )
        return out

    def _apply(self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> None:
        upd = self._scheduler.update(worker_id, sched_out, runner_out)
        self._sink(upd.outputs)
        if upd.wake_others:
            self.wake_all()  # freed blocks may let another worker admit
        if self._on_step is not None:
            self._on_step(worker_id, sched_out, runner_out)

    def _died(self, worker_id: int) -> None:
        log.exception("worker %d died; requeueing its sequences", worker_id)
        self.in_step.discard(worker_id)
        self._sink(self._scheduler.mark_worker_dead(worker_id))
        self.wake_all()  # live workers pick up what was requeued

    def _suspect(self, worker_id: int) -> None:
        log.warning(
            "worker %d missed its step deadline (%.3g s); requeueing its sequences until "
            "it answers again",
            worker_id,
            self.deadline_s(worker_id) or 0.0,
        )
        self.deadline_misses[worker_id] = self.deadline_misses.get(worker_id, 0) + 1
        self.in_step.discard(worker_id)
        self._sink(self._scheduler.mark_worker_dead(worker_id))
        self.wake_all()

    def _failed(self, worker_id: int, sched_out: SchedulerOutput) -> None:
        log.exception("worker %d failed a step; aborting its requests", worker_id)
        self._sink(self._scheduler.fail_step(worker_id, sched_out))
        self.wake_all()

    async def _sleep(self, worker_id: int) -> None:
        wake = self._wakeups[worker_id]
        wake.clear()
        self._waiting.add(worker_id)
        self._note_idle()
        try:
            await wake.wait()
        finally:
            self._waiting.discard(worker_id)

    def _note_idle(self) -> None:
        if self.idle:
            self._idle.set()


def _discard(pending: Awaitable[Any]) -> None:
    """Drop a step's answer nobody will read (its worker died) without a warning."""
    if inspect.iscoroutine(pending):
        pending.close()
    elif isinstance(pending, asyncio.Future):
        pending.add_done_callback(lambda f: f.cancelled() or f.exception())


__all__ = [
    "EngineLoop",
    "InlineWorker",
    "StepDeadlineExceeded",
    "ThreadWorker",
    "WorkerDied",
    "WorkerHandle",
]
