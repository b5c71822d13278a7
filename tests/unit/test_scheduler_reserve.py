"""Reserve-at-admission (``SchedulerConfig.admission_reserve``): exact admissions and blocks.

The pre-paging baseline of ``benchmarks/memory/capacity.py``: a sequence is admitted only when the
free pool covers its whole reservation (prompt + max_tokens, or max_model_len) on top of
what the running sequences reserved and have not grown into yet.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import ScriptedWorker, drive

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

EOS = 2


def make(reserve: str, num_blocks: int = 16, block_size: int = 4, max_model_len: int = 256):
    cfg = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=256,
        max_model_len=max_model_len,
        admission_reserve=reserve,
        admission="fits-now",  # "none" is the paged baseline: admit by current need
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(s: Scheduler, w: ScriptedWorker, max_steps: int = 500) -> list[int]:
    """The serial engine loop to completion within ``max_steps`` (``helpers.drive``);
    returns the number of running sequences after each step."""
    running: list[int] = []
    s.config = dataclasses.replace(s.config, async_scheduling=False)
    drive(
        s,
        [w.execute],
        on_step=lambda s, _wid, _so: running.append(len(s.workers[0].running)),
        max_steps=max_steps,
    )
    return running


def add_six(s: Scheduler) -> None:
    # 5-token prompts, 7 output tokens: 12 tokens = 3 blocks of 4 at their longest.
    for i in range(6):
        s.add_request(EngineRequest(f"r{i}", [5 + i] * 5, greedy(7), [EOS]))


def test_none_admits_by_current_need():
    s = make("none")
    add_six(s)
    so = s.schedule(0).output
    assert len(so.num_scheduled_tokens) == 6
    assert s.workers[0].kv.num_free_blocks == 16 - 6 * 2  # 2 blocks per 5-token prompt


def test_max_tokens_admits_only_whole_reservations():
    s, w = make("max_tokens"), ScriptedWorker()
    add_six(s)
    so = s.schedule(0).output
    # 16 // 3 = 5 reservations fit; the sixth waits although 6 free blocks remain.
    assert list(so.num_scheduled_tokens) == [f"r{i}/0" for i in range(5)]
    assert s.workers[0].kv.num_free_blocks == 16 - 5 * 2  # blocks are taken as they grow
    s.update(0, so, w.execute(so))
    assert [seq.seq_id for seq in s.workers[0].waiting] == ["r5/0"]
    running = run(s, w)
    assert max(running) == 5
    assert s.num_preemptions == 0
    assert s.workers[0].kv.num_free_blocks == 16 and not s.requests


def test_reservation_counts_blocks_running_sequences_have_not_taken_yet():
    # 8 blocks: a 4-token prompt with max_tokens 12 reserves 4 blocks but holds 1 at first.
    s, w = make("max_tokens", num_blocks=8), ScriptedWorker()
    s.add_request(EngineRequest("a", [7] * 4, greedy(12), [EOS]))
    so = s.schedule(0).output
    s.update(0, so, w.execute(so))
    assert len(s.workers[0].kv.get_block_ids("a/0")) == 1
    s.add_request(EngineRequest("b", [8] * 4, greedy(16), [EOS]))  # reserves 5 blocks: 4 + 5 > 8
    so = s.schedule(0).output
    assert list(so.num_scheduled_tokens) == ["a/0"]
    assert s.workers[0].kv.num_free_blocks == 6  # ...although 6 blocks are free now
    s.update(0, so, w.execute(so))
    s.add_request(EngineRequest("c", [9] * 4, greedy(12), [EOS]))  # FCFS: c waits behind b
    run(s, w)
    assert s.num_preemptions == 0 and not s.requests


def test_max_model_len_reserves_the_longest_sequence():
    # max_model_len 32 = 8 blocks of 4: two sequences fit a 16-block pool, whatever they need.
    s, w = make("max_model_len", max_model_len=32), ScriptedWorker()
    for i in range(4):
        s.add_request(EngineRequest(f"r{i}", [5] * 3, greedy(2), [EOS]))
    so = s.schedule(0).output
    assert list(so.num_scheduled_tokens) == ["r0/0", "r1/0"]
    s.update(0, so, w.execute(so))
    assert max(run(s, w)) == 2


def test_reservation_is_capped_at_the_pool():
    # max_model_len 256 > the 64-slot pool: one sequence at a time, never stuck.
    s, w = make("max_model_len", max_model_len=256), ScriptedWorker()
    for i in range(3):
        s.add_request(EngineRequest(f"r{i}", [5] * 3, greedy(2), [EOS]))
    assert max(run(s, w)) == 1
    assert not s.requests


def test_paged_preempts_where_reservation_waits():
    # 5 blocks; two 6-token prompts growing to 11 slots (3 blocks): paged admits both and
    # preempts one, the reservation runs them one after the other.
    for reserve, preempted in (("none", True), ("max_tokens", False)):
        s, w = make(reserve, num_blocks=5), ScriptedWorker()
        s.add_request(EngineRequest("a", [1] * 6, greedy(6), [EOS]))
        s.add_request(EngineRequest("b", [3] * 6, greedy(6), [EOS]))
        running = run(s, w)
        assert (s.num_preemptions > 0) is preempted
        assert max(running) == (2 if reserve == "none" else 1)


def test_bad_reserve_is_refused():
    with pytest.raises(ValueError, match="admission_reserve"):
        SchedulerConfig(admission_reserve="max")
