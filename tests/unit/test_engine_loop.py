"""The step loop (scheduler/engine_loop.py) over fake workers: serial and overlapped give
the same tokens, a worker that dies mid-step has its sequences requeued on the other, a
failed step aborts only its requests, a step past its deadline requeues the
worker's sequences (the late answer discarded) until the worker rejoins, no step is planned past one ``can_plan_past``
refuses, wake-ups reach a sleeping worker, a thread worker really overlaps, and a run
with work nobody can do ends instead of hanging. Every test is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest
from helpers import InProcessWorker, ScriptedWorker, drive

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, ThreadWorker, WorkerDied
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, StepPlan, StepUpdate, WorkerSpec

pytestmark = pytest.mark.timeout(60)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [30] * 9, [40, 41]]


def make(
    workers: int = 1, overlap: bool = True, num_blocks: int = 64, **config: float
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=8,
            max_model_len=64,
            max_num_seqs=4,
            async_scheduling=overlap,
            routing="round-robin",
            **config,  # type: ignore[arg-type]
        ),
        [WorkerSpec(i, num_blocks, 4) for i in range(workers)],
    )


def add_all(sched: Scheduler, prompts: list[list[int]] = PROMPTS) -> None:
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))


def reference() -> dict[tuple[str, int], list[int]]:
    sched = make(overlap=False)
    add_all(sched)
    return drive(sched, [ScriptedWorker().execute]).tokens


def run(engine: EngineLoop) -> None:
    asyncio.run(asyncio.wait_for(engine.run_until_idle(), 30))


@pytest.mark.parametrize("overlap", [False, True])
def test_serial_and_overlapped_give_the_reference_tokens(overlap: bool) -> None:
    ref = reference()
    assert len(ref) == len(PROMPTS) and all(len(t) == 6 for t in ref.values())
    sched = make(overlap=overlap)
    add_all(sched)
    seen = drive(sched, [ScriptedWorker().execute])
    assert seen.tokens == ref
    assert (seen.ahead > 0) == overlap  # overlapped: steps planned with one in flight
    assert sched.workers[0].kv.num_free_blocks == 64


@pytest.mark.parametrize("overlap", [False, True])
def test_death_mid_step_requeues_on_the_other_worker(overlap: bool) -> None:
    ref = reference()
    sched = make(workers=2, overlap=overlap)
    add_all(sched)  # round-robin: r0, r2 on worker 0; r1, r3 on worker 1
    fakes = [ScriptedWorker(), ScriptedWorker()]
    dying = InProcessWorker(fakes[0].execute, die_when=lambda so: so.step_id == 2)
    seen = drive(sched, [dying, InProcessWorker(fakes[1].execute)])
    assert not sched.workers[0].alive and sched.workers[1].alive
    assert seen.tokens == ref  # recomputed on worker 1: the same tokens
    assert all(f == FinishReason.LENGTH for f in seen.finish.values())
    assert [so.step_id for so in dying.sent] == [0, 1, 2]  # nothing sent after the death
    assert sched.workers[1].kv.num_free_blocks == 64


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_step_aborts_its_requests_and_the_loop_goes_on(overlap: bool) -> None:
    ref = reference()
    sched = make(overlap=overlap)
    add_all(sched)
    fake = ScriptedWorker()

    def execute(so: SchedulerOutput) -> RunnerOutput:
        out = fake.execute(so)  # the worker took the step's deltas, then failed
        if so.step_id == 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return out

    failed: list[set[str]] = []
    worker = InProcessWorker(execute)
    seen = drive(
        sched, [worker], on_plan=lambda s, w, so, cur: failed.append(set(so.num_scheduled_tokens))
    )
    in_failed = {sid.split("/")[0] for sid in failed[1]}
    assert in_failed
    for rid, reason in seen.finish.items():
        assert reason == (FinishReason.ABORT if rid in in_failed else FinishReason.LENGTH), rid
    for (rid, c), toks in seen.tokens.items():
        if rid not in in_failed:
            assert toks == ref[(rid, c)]
    assert len(seen.finish) == len(PROMPTS)
    assert sched.workers[0].alive and sched.workers[0].kv.num_free_blocks == 64


def test_no_step_is_planned_past_one_can_plan_past_refuses() -> None:
    ref = reference()
    sched = make(overlap=True)
    add_all(sched)
    refused = {1, 4}
    sched.can_plan_past = lambda so: so.step_id not in refused  # type: ignore[method-assign]
    plans: list[tuple[int, int | None]] = []
    seen = drive(
        sched,
        [ScriptedWorker().execute],
        on_plan=lambda s, w, so, cur: plans.append((so.step_id, cur and cur.step_id)),
    )
    assert seen.tokens == ref
    assert all(cur not in refused for _, cur in plans)
    assert (2, None) in plans and (5, None) in plans  # planned once 1 and 4 were answered
    assert any(cur is not None for _, cur in plans)


class _Live:
    alive = True


@dataclass
class StubScheduler:
    """The scheduler surface the loop uses, scripted: worker 0 has ``steps`` steps; worker
    1 gets one step of work only when worker 0's second update says ``wake_others``."""

    steps: int = 3
    config: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_model_len=8))
    work: dict[int, int] = field(default_factory=dict)
    ran: list[tuple[int, int]] = field(default_factory=list)
    workers: dict[int, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work = {0: self.steps, 1: 0}
        self.workers = {0: _Live(), 1: _Live()}
        self._next = {0: 0, 1: 0}

    def has_work(self, wid: int) -> bool:
        return self.work[wid] > 0

    def schedule(self, wid: int) -> StepPlan:
        self._next[wid] += 1
        self.work[wid] -= 1
        return StepPlan(SchedulerOutput(self._next[wid], num_scheduled_tokens={"s": 1}), False)

    def can_plan_past(self, so: SchedulerOutput) -> bool:
        return True

    def update(self, wid: int, so: SchedulerOutput, ro: RunnerOutput) -> StepUpdate:
        self.ran.append((wid, so.step_id))
        wake = wid == 0 and so.step_id == 2
        if wake:
            self.work[1] += 1
        return StepUpdate([], wake)


class Ok:
    """Answers every step after 5 ms (the other loops run meanwhile)."""

    def execute(self, so: SchedulerOutput) -> asyncio.Task[RunnerOutput]:
        return asyncio.ensure_future(self._answer(so))

    @staticmethod
    async def _answer(so: SchedulerOutput) -> RunnerOutput:
        await asyncio.sleep(0.005)
        return RunnerOutput(so.step_id)


@pytest.mark.parametrize("overlap", [False, True])
def test_wake_others_from_an_update_wakes_a_sleeping_worker(overlap: bool) -> None:
    stub = StubScheduler(config=SchedulerConfig(max_model_len=8, async_scheduling=overlap))
    engine = EngineLoop(stub, {0: Ok(), 1: Ok()}, lambda outs: None)  # type: ignore[arg-type]
    run(engine)
    assert (1, 1) in stub.ran  # worker 1 slept until worker 0's step 2 woke it
    assert [s for w, s in stub.ran if w == 0] == [1, 2, 3]
    assert not engine.in_step


def test_wake_all_from_outside_reaches_sleeping_loops() -> None:
    stub = StubScheduler(steps=0)

    async def scenario() -> None:
        engine = EngineLoop(stub, {0: Ok(), 1: Ok()}, lambda outs: None)  # type: ignore[arg-type]
        tasks = [engine.start(0), engine.start(1)]
        await asyncio.sleep(0.01)
        assert engine.idle
        stub.work[1] = 2  # as add_request would
        engine.wake_all()
        assert not engine.idle
        await asyncio.sleep(0.05)
        assert engine.idle and [w for w, _ in stub.ran] == [1, 1]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_thread_worker_overlaps_planning_with_the_running_step() -> None:
    """Step 1's execution waits, on the worker thread, until step 2 was planned: only an
    overlapped loop with a worker that runs concurrently gets past it (else the wait
    times out and the step fails)."""
    ref = reference()
    sched = make(overlap=True)
    add_all(sched)
    fake = ScriptedWorker()
    planned = threading.Event()
    waited: list[bool] = []

    def execute(so: SchedulerOutput) -> RunnerOutput:
        if so.step_id == 1:
            waited.append(planned.wait(5))
        return fake.execute(so)

    def on_plan(s, w, so, cur):
        if so.step_id == 2:
            planned.set()

    worker = ThreadWorker(execute)
    try:
        seen = drive(sched, [worker], on_plan=on_plan)
    finally:
        worker.close()
    assert waited == [True]
    assert seen.tokens == ref


def test_every_worker_dead_ends_the_run_with_its_requests_finished() -> None:
    sched = make(workers=2)
    add_all(sched)
    finished: dict[str, FinishReason | None] = {}

    def sink(outs: list) -> None:
        finished.update((o.request_id, o.finish_reason) for o in outs)

    dead = {w: InProcessWorker(None, lambda so: True) for w in (0, 1)}
    run(EngineLoop(sched, dead, sink))  # both die at their first step
    assert sched.num_live_workers == 0 and not sched.requests
    assert set(finished) == {f"r{i}" for i in range(len(PROMPTS))}
    assert all(r is not None for r in finished.values())


def test_work_nobody_can_do_ends_the_run() -> None:
    """A worker that has work but plans empty steps (nothing fits) sleeps: with nobody
    left to wake it, the run ends (its caller sees ``has_work``) instead of hanging."""
    sched = make()
    sched.has_work = lambda w: True  # type: ignore[method-assign]
    worker = InProcessWorker(ScriptedWorker().execute)
    run(EngineLoop(sched, {0: worker}, lambda o: None))
    assert worker.sent == []


def test_a_loop_error_ends_the_run_with_it() -> None:
    sched = make()
    add_all(sched)

    def boom(wid: int, so: SchedulerOutput, ro: RunnerOutput) -> None:
        raise KeyError("hook")

    engine = EngineLoop(
        sched, {0: InProcessWorker(ScriptedWorker().execute)}, lambda o: None, on_step=boom
    )
    with pytest.raises(KeyError, match="hook"):
        run(engine)


def test_handles_for_every_worker_and_one_loop_each() -> None:
    sched = make(workers=2)
    with pytest.raises(ValueError, match=r"no handle for workers \[1\]"):
        EngineLoop(sched, {0: Ok()}, lambda o: None)

    async def twice() -> None:
        engine = EngineLoop(sched, {0: Ok(), 1: Ok()}, lambda o: None)
        task = engine.start(0)
        with pytest.raises(RuntimeError, match="already running"):
            engine.start(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(twice(), 10))


def test_worker_died_is_what_a_dead_handle_raises() -> None:
    assert issubclass(WorkerDied, Exception)


class SlowWorker:
    """A fake worker whose answer to step ``slow_step`` comes ``delay_s`` late (the step
    itself ran when sent, as on a worker whose link stalls); records the late answer."""

    def __init__(self, fake: ScriptedWorker, slow_step: int, delay_s: float) -> None:
        self.fake = fake
        self.slow_step = slow_step
        self.delay_s = delay_s
        self.late_answered = asyncio.Event()
        self.sent: list[int] = []

    def execute(self, so: SchedulerOutput) -> asyncio.Task[RunnerOutput]:
        self.sent.append(so.step_id)
        out = self.fake.execute(so)
        return asyncio.ensure_future(self._answer(so.step_id, out))

    async def _answer(self, step_id: int, out: RunnerOutput) -> RunnerOutput:
        if step_id == self.slow_step:
            await asyncio.sleep(self.delay_s)
            self.late_answered.set()
        else:
            await asyncio.sleep(0)
        return out


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_past_its_deadline_requeues_and_the_worker_rejoins(overlap: bool) -> None:
    ref = reference()
    sched = make(workers=2, overlap=overlap, step_deadline_floor_s=0.3, step_deadline_factor=20)
    add_all(sched)  # round-robin: r0, r2 on worker 0; r1, r3 on worker 1
    slow = SlowWorker(ScriptedWorker(), slow_step=2, delay_s=1.0)
    other = InProcessWorker(ScriptedWorker().execute)
    tokens: dict[tuple[str, int], list[int]] = {}
    finished: dict[str, FinishReason] = {}
    applied: list[tuple[int, int]] = []

    def sink(outputs: list) -> None:
        for o in outputs:
            tokens.setdefault((o.request_id, o.choice_index), []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason

    engine = EngineLoop(
        sched,
        {0: slow, 1: other},
        sink,
        on_step=lambda w, so, ro: applied.append((w, so.step_id)),
        step_deadlines=True,
    )

    async def scenario() -> None:
        t0 = time.monotonic()
        await engine.run_until_idle()
        # The requeued sequences finished on worker 1 before the late answer came.
        assert time.monotonic() - t0 < slow.delay_s
        assert not slow.late_answered.is_set()
        assert not sched.workers[0].alive and engine.deadline_misses == {0: 1}
        assert len(finished) == len(PROMPTS)
        await asyncio.wait_for(slow.late_answered.wait(), 5)
        await asyncio.sleep(0.05)  # the late answer's callbacks ran
        assert (0, slow.slow_step) not in applied  # discarded
        # The worker answers again (the probe's ping): state cleared, it rejoins.
        slow.fake = ScriptedWorker()
        task = engine.rejoin(0)
        assert task is not None and sched.workers[0].alive
        done_before = len(applied)
        for i, p in enumerate(PROMPTS):
            sched.add_request(EngineRequest(f"s{i}", p, GREEDY))
        other_task = engine.start(1)
        engine.wake_all()
        deadline = time.monotonic() + 10
        while len(finished) < 2 * len(PROMPTS) or not engine.idle:
            assert time.monotonic() < deadline, finished
            await asyncio.sleep(0.01)
        task.cancel()
        other_task.cancel()
        await asyncio.gather(task, other_task, return_exceptions=True)
        assert any(w == 0 for w, _ in applied[done_before:])  # worker 0 served again

    asyncio.run(asyncio.wait_for(scenario(), 30))
    for i in range(len(PROMPTS)):
        assert tokens[(f"r{i}", 0)] == ref[(f"r{i}", 0)]  # requeued: the same tokens
        assert tokens[(f"s{i}", 0)] == ref[(f"r{i}", 0)]
    assert all(f == FinishReason.LENGTH for f in finished.values())
    assert sched.workers[0].kv.num_free_blocks == 64
    assert sched.workers[1].kv.num_free_blocks == 64
    assert 0 < engine.step_time_s[1] < 0.3


def test_no_deadline_when_the_floor_is_zero_or_the_loop_is_local() -> None:
    handles = {0: InProcessWorker(ScriptedWorker().execute)}
    sched = make(step_deadline_floor_s=0)
    assert EngineLoop(sched, handles, lambda o: None, step_deadlines=True).deadline_s(0) is None
    sched = make(step_deadline_floor_s=2.0, step_deadline_factor=10)
    assert EngineLoop(sched, handles, lambda o: None).deadline_s(0) is None  # in-process
    engine = EngineLoop(sched, handles, lambda o: None, step_deadlines=True)
    assert engine.deadline_s(0) == 2.0  # no step timed yet: the floor
    engine.step_time_s[0] = 0.5
    assert engine.deadline_s(0) == 5.0


@pytest.mark.parametrize("field", [{"step_deadline_floor_s": -1.0}, {"step_deadline_factor": -0.5}])
def test_step_deadline_config_is_validated(field: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(field))):
        SchedulerConfig(**field)  # type: ignore[arg-type]
