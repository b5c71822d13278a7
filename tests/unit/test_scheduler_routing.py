"""Routing across workers: prefix-aware assignment, load balance, policies, work stealing.

Two fake workers, run to completion by their serial engine loops (``helpers.drive``) or
stepped by hand in lockstep (``step_round``) where one decision is checked; every assertion
is on exact worker ids, queue positions and cached token counts.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import ScriptedWorker, drive

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

BS = 16
SYSTEM = list(range(1000, 1000 + 20 * BS))  # a 20-block system prompt


def make(
    num_blocks=64, routing="prefix", threshold=8, budget=512, max_seqs=16, max_len=1024,
    admission="projected",
):  # fmt: skip
    cfg = SchedulerConfig(
        admission=admission,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        routing=routing,
        routing_load_threshold=threshold,
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, BS), WorkerSpec(1, num_blocks, BS)])


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def step_round(s, fakes, order=(0, 1), on_schedule=None):
    """One step on every worker (scheduled in ``order``, then updated); returns the
    deltas and, per worker, the seq ids its step admitted as new."""
    outs, admitted = [], {}
    planned = []
    for wid in order:
        if s.has_work(wid):
            so = s.schedule(wid).output
            s.check_integrity()
            if on_schedule is not None:
                on_schedule(s, wid)
            admitted[wid] = [n.seq_id for n in so.new_seqs]
            planned.append((wid, so))
    for wid, so in planned:
        outs.extend(s.update(wid, so, fakes[wid].execute(so)).outputs)
        s.check_integrity()
    return outs, admitted


def run_all(s, fakes, max_rounds=2000, on_schedule=None):
    """Both workers' serial engine loops to completion (``helpers.drive``); returns the
    deltas and the worker each seq id was first sent to as new. ``on_schedule(s, wid)``
    runs right after every ``schedule`` call, empty steps included."""
    where = {}
    s.config = dataclasses.replace(s.config, async_scheduling=False)
    if on_schedule is not None:
        schedule = s.schedule

        def polled(wid):
            plan = schedule(wid)
            on_schedule(s, wid)
            return plan

        s.schedule = polled

    def planned(_s, wid, so, _cur):
        for n in so.new_seqs:
            where.setdefault(n.seq_id, wid)

    driven = drive(s, [f.execute for f in fakes], on_plan=planned, max_steps=2 * max_rounds)
    if on_schedule is not None:
        del s.schedule
    return driven.outputs, where


def queued_on(s):
    return {seq.request_id: seq.queued_on for seq in s.sequences.values()}


def test_shared_system_prompt_requests_go_where_it_is_cached():
    s, fakes = make(), [ScriptedWorker(), ScriptedWorker()]
    s.add_request(EngineRequest("first", SYSTEM + [1, 2, 3, 4, 5], greedy(2)))
    outs, where = run_all(s, fakes)
    assert where == {"first/0": 0}
    for i in range(6):
        s.add_request(EngineRequest(f"r{i}", SYSTEM + [7, i, 8, i, 9], greedy(3)))
    assert queued_on(s) == {f"r{i}": 0 for i in range(6)}
    outs, where = run_all(s, fakes)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert {r: o.num_cached_tokens for r, o in final.items()} == {f"r{i}": 320 for i in range(6)}
    assert set(where.values()) == {0}
    st = s.stats().workers
    assert st[0].prefix_cache_hit_rate == pytest.approx(6 * 320 / (7 * 325))
    assert st[1].prefix_cache_hit_rate == 0.0


def test_burst_of_unrelated_requests_splits_evenly():
    s, fakes = make(), [ScriptedWorker(), ScriptedWorker()]
    for i in range(8):
        s.add_request(EngineRequest(f"u{i}", [10 * i + k for k in range(1, 9)], greedy(4)))
    assert queued_on(s) == {f"u{i}": i % 2 for i in range(8)}
    _, where = run_all(s, fakes)
    assert where == {f"u{i}/0": i % 2 for i in range(8)}


def test_overloaded_prefix_worker_sends_to_least_loaded():
    s, fakes = make(threshold=2), [ScriptedWorker(), ScriptedWorker()]
    s.add_request(EngineRequest("first", SYSTEM + [1], greedy(1)))
    run_all(s, fakes)
    for i in range(6):
        s.add_request(EngineRequest(f"r{i}", SYSTEM + [2, i], greedy(1)))
    # loads (w0, w1) before each: (0,0) (1,0) (2,0) (3,0): 3 > 2 -> w1; (3,1); (4,1) -> w1
    assert queued_on(s) == {"r0": 0, "r1": 0, "r2": 0, "r3": 1, "r4": 0, "r5": 1}


@pytest.mark.parametrize(
    ("routing", "expected"),
    [("least-loaded", {"a": 0, "b": 1, "c": 0}), ("round-robin", {"a": 1, "b": 0, "c": 1})],
)
def test_other_policies_ignore_the_cache(routing, expected):
    s, fakes = make(routing=routing), [ScriptedWorker(), ScriptedWorker()]
    s.add_request(EngineRequest("first", SYSTEM + [1], greedy(1)))
    run_all(s, fakes)  # cached on worker 0
    for rid in "abc":
        s.add_request(EngineRequest(rid, SYSTEM + [ord(rid)], greedy(1)))
    assert queued_on(s) == expected


def test_round_robin_cycles_regardless_of_load():
    s = make(routing="round-robin")
    for i in range(5):
        s.add_request(EngineRequest(f"q{i}", [i + 1, 2, 3], greedy(50)))
    assert queued_on(s) == {"q0": 0, "q1": 1, "q2": 0, "q3": 1, "q4": 0}


def test_idle_worker_steals_uncached_work():
    s, fakes = make(routing="round-robin"), [ScriptedWorker(), ScriptedWorker()]
    s.add_request(EngineRequest("a", [1, 2, 3], greedy(50)))  # worker 0
    s.add_request(EngineRequest("b", [4, 5, 6], greedy(1)))  # worker 1: done after one step
    step_round(s, fakes)
    for rid in "cdefg":  # round-robin: c, e, g on worker 0; d, f on worker 1
        s.add_request(EngineRequest(rid, [ord(rid), 2, 3], greedy(3)))
    assert [q.request_id for q in s.workers[0].waiting] == ["c", "e", "g"]
    so1 = s.schedule(1).output  # admits d, f (load 2), then steals c from worker 0 (load 4:
    # running a, queued c, e, g; no prefix of c there; 2 + 1 <= 4 - 1); then 3 + 1 > 3 - 1
    assert so1.num_scheduled_tokens == {"d/0": 3, "f/0": 3, "c/0": 3}
    assert s.sequences["c/0"].worker_id == 1
    assert [q.request_id for q in s.workers[0].waiting] == ["e", "g"]
    s.check_integrity()


def test_stealing_keeps_a_split_burst_split():
    """Requests queued on a busy worker while another one steps are not all taken by
    the one that steps first (a burst of 8 went 8 / 1 on two real workers)."""
    s = make(routing="round-robin")
    s.add_request(EngineRequest("w", [99, 98, 97], greedy(50)))
    s.add_request(EngineRequest("x", [96, 95, 94], greedy(50)))  # round-robin: one on each worker
    s.schedule(0)
    s.schedule(1)
    for i in range(8):  # the burst arrives while both step: 4 queued on each
        s.add_request(EngineRequest(f"u{i}", [10 * i + 1, 2, 3], greedy(50)))
    so0 = s.schedule(0).output  # before its update: its batch is still {w}
    admitted = sorted(n.seq_id for n in so0.new_seqs)
    assert len(admitted) == 4  # its own 4, nothing stolen: loads stay 5 / 5
    assert all(s.sequences[sid].worker_id == 0 for sid in admitted)
    assert [q.request_id for q in s.workers[1].waiting] == ["u1", "u3", "u5", "u7"]
    s.check_integrity()


def test_idle_worker_leaves_cached_work_that_fits():
    s, fakes = make(), [ScriptedWorker(), ScriptedWorker()]
    s.add_request(EngineRequest("first", SYSTEM + [1], greedy(1)))
    run_all(s, fakes)
    s.add_request(EngineRequest("r", SYSTEM + [2], greedy(1)))
    assert s.schedule(1).output.is_empty  # r's 20 blocks are cached on worker 0, which has room
    assert s.schedule(0).output.num_scheduled_tokens == {"r/0": 1}


def test_no_worker_idles_while_work_waits():
    """The reproduced case: 2 workers of 12 blocks, 8 requests sharing a 1-block prefix."""
    s = make(num_blocks=12, budget=2048, max_len=256, admission="fits-now")
    fakes = [ScriptedWorker(), ScriptedWorker()]
    lens = [170, 8, 170, 8, 170, 8, 150, 8]
    for i, n in enumerate(lens):
        s.add_request(EngineRequest(f"p{i}", list(range(500, 516)) + [i, 1, 2, 3], greedy(n)))
    idle, preempted_seen = [], []

    def check(sched, wid):  # polled right after each worker decided its step
        st = sched.stats()
        preempted_seen.append(st.num_preemptions)
        if st.workers[wid].num_running == 0 and st.num_waiting > 0:
            idle.append((wid, st.num_waiting, st.workers[wid].num_free_blocks))

    outs, where = run_all(s, fakes, on_schedule=check)
    final = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.request_id for o in final) == [f"p{i}" for i in range(8)]
    assert all(o.finish_reason is FinishReason.LENGTH for o in final)
    assert idle == []
    assert preempted_seen[-1] > 0  # the pools were under pressure: work was requeued
    assert set(where.values()) == {0, 1}
    assert {w.num_free_blocks for w in s.stats().workers} == {12}


def test_dead_worker_queue_is_rerouted():
    s = make(routing="round-robin")
    for i in range(4):
        s.add_request(EngineRequest(f"d{i}", [i + 1, 2, 3], greedy(2)))
    s.schedule(1)
    assert s.mark_worker_dead(1) == []
    assert queued_on(s) == {"d0": 0, "d1": 0, "d2": 0, "d3": 0}
    assert [q.request_id for q in s.workers[0].waiting] == ["d1", "d3", "d0", "d2"]
    s.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"routing": "random"}, "routing"),
        ({"routing_load_threshold": -1}, "routing_load_threshold"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_config_rejects_bad_routing_knobs(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_priority_must_be_int32():
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=2**31)
    assert SamplingParams(priority=-(2**31)).priority == -(2**31)
