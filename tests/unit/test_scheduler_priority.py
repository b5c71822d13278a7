"""Priorities and fair preemption: admission order, victim choice, no mutual preemption.

One fake worker; step counts are bounded (no timers).
"""

from __future__ import annotations

import dataclasses

from helpers import ScriptedWorker, drive

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec


def make(num_blocks=16, block_size=4, budget=64, max_seqs=8, policy="fcfs", admission="projected"):
    cfg = SchedulerConfig(
        admission=admission,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=256,
        scheduling_policy=policy,
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])


def greedy(max_tokens, priority=0):
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority
    )


def run(s, w, max_steps=500):
    """The serial engine loop to completion within ``max_steps`` (``helpers.drive``);
    returns the deltas and the seq ids each step sent as new, in order."""
    admitted = []
    s.config = dataclasses.replace(s.config, async_scheduling=False)
    driven = drive(
        s,
        [w.execute],
        on_plan=lambda _s, _wid, so, _cur: admitted.extend(n.seq_id for n in so.new_seqs),
        max_steps=max_steps,
    )
    return driven.outputs, admitted


def test_priority_policy_admits_most_urgent_first_then_arrival():
    s, w = make(max_seqs=1, policy="priority"), ScriptedWorker()
    s.add_request(EngineRequest("low", [1, 2], greedy(2, priority=5), arrival_s=1.0))
    s.add_request(EngineRequest("high", [3, 4], greedy(2, priority=-1), arrival_s=2.0))
    s.add_request(EngineRequest("mid_a", [5, 6], greedy(2), arrival_s=3.0))
    s.add_request(EngineRequest("mid_b", [7, 8], greedy(2), arrival_s=4.0))
    _, admitted = run(s, w)
    assert admitted == ["high/0", "mid_a/0", "mid_b/0", "low/0"]


def test_fcfs_policy_ignores_priority():
    s, w = make(max_seqs=1), ScriptedWorker()
    s.add_request(EngineRequest("low", [1, 2], greedy(2, priority=5), arrival_s=1.0))
    s.add_request(EngineRequest("high", [3, 4], greedy(2, priority=-1), arrival_s=2.0))
    _, admitted = run(s, w)
    assert admitted == ["low/0", "high/0"]


def test_victim_is_least_urgent_even_when_admitted_first():
    # 4 blocks of 4 slots: "low" (admitted first) and "high" each hold 2 blocks; when
    # "high" grows into a third block, "low" is the one preempted.
    s, w = make(num_blocks=4, policy="priority", admission="fits-now"), ScriptedWorker()
    s.add_request(EngineRequest("low", [1, 2, 3, 4, 5, 6, 7], greedy(6, priority=1), arrival_s=1.0))
    so = s.schedule(0).output
    s.update(0, so, w.execute(so))
    s.add_request(
        EngineRequest("high", [9, 8, 7, 6, 5, 4, 3], greedy(6, priority=0), arrival_s=2.0)
    )
    outs, _ = run(s, w)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert final["high"].num_preemptions == 0
    assert final["low"].num_preemptions >= 1
    assert {o.finish_reason for o in final.values()} == {FinishReason.LENGTH}
    assert s.stats().num_preemptions == final["low"].num_preemptions


def test_two_long_prompts_in_a_pool_holding_one_both_finish():
    # 10 blocks of 4 = 40 slots; each request needs 30 + 8 = 38: only one fits at a time.
    # Chunked prefill (budget 8) admits both; the younger is preempted, never the older.
    s, w = make(num_blocks=10, budget=8), ScriptedWorker()
    s.add_request(EngineRequest("old", list(range(1, 31)), greedy(8), arrival_s=1.0))
    s.add_request(EngineRequest("young", list(range(31, 61)), greedy(8), arrival_s=2.0))
    outs, _ = run(s, w, max_steps=200)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert set(final) == {"old", "young"}
    assert final["old"].num_preemptions == 0
    assert final["old"].num_output_tokens == final["young"].num_output_tokens == 8
    order = [o.request_id for o in outs if o.finish_reason is not None]
    assert order == ["old", "young"]
    assert s.workers[0].kv.num_free_blocks == 10


def test_preempted_older_sequence_is_not_preempted_again_by_younger():
    # "old" is preempted once by a more urgent request; re-admitted after "young" (so it
    # sits behind it in the batch), it must still win the pool against "young".
    s, w = make(num_blocks=10, budget=8, policy="priority"), ScriptedWorker()
    s.add_request(EngineRequest("old", list(range(1, 31)), greedy(8), arrival_s=1.0))
    so = s.schedule(0).output
    s.update(0, so, w.execute(so))
    s.add_request(EngineRequest("young", list(range(31, 61)), greedy(8), arrival_s=2.0))
    outs, _ = run(s, w, max_steps=200)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert final["old"].num_preemptions == 0
    assert [o.request_id for o in outs if o.finish_reason is not None] == ["old", "young"]
