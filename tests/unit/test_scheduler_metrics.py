"""The scheduler's own metrics: exact counts, block usage and timings on a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import ScriptedWorker, drive

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.metrics import (
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS_S,
    Histogram,
    buckets_1_2_5,
)
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

EOS = 2


class Clock:
    """A manual clock (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=16, block_size=4, budget=64, caching=True, admission="projected"):
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_model_len=256,
        admission=admission,
    )
    s = Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])
    clock = Clock()
    s.metrics.clock = clock
    return s, clock


def step(s: Scheduler, w: ScriptedWorker, clock: Clock, dt: float = 0.0):
    so = s.schedule(0).output
    clock.now += dt
    out = s.update(0, so, w.execute(so)).outputs
    s.check_integrity()
    return so, out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_buckets_are_vllms():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(4096)[-1] == 2000
    assert REQUEST_LATENCY_BUCKETS_S[0] == 0.3 and REQUEST_LATENCY_BUCKETS_S[-1] == 7680.0
    assert ITERATION_TOKENS_BUCKETS[-1] == 16384
    with pytest.raises(ValueError):
        Histogram((1.0, 1.0))


def test_histogram_buckets_are_upper_bounds():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 1, 1)  # le=1 takes 0.5 and 1.0 (Prometheus: value <= bound)
    assert snap.cumulative() == [2, 3, 4]
    assert snap.count == 4 and snap.sum == 6.0


def test_exact_counts_and_timings_of_a_known_workload():
    s, clock = make()
    w = ScriptedWorker()
    # Two requests: 5 and 3 prompt tokens, 4 and 2 output tokens.
    s.add_request(EngineRequest("a", [5, 6, 7, 8, 9], greedy(4), [EOS], arrival_s=clock.now))
    s.add_request(EngineRequest("b", [5, 6, 7], greedy(2), [EOS], arrival_s=clock.now))
    clock.now += 0.5  # both wait 0.5 s before the first step admits them
    so, _ = step(s, w, clock, dt=0.25)  # prefill both: 5 + 3 tokens, first tokens at +0.75
    assert sum(so.num_scheduled_tokens.values()) == 8
    snap = s.metrics_snapshot()
    # a: 5 tokens = 2 blocks of 4; b: 3 tokens = 1 block.
    assert snap.stats.workers[0].num_blocks - snap.stats.workers[0].num_free_blocks == 3
    assert snap.stats.num_running == 2
    step(s, w, clock, dt=0.1)  # decode: a 2nd token, b 2nd token (b finishes: length)
    step(s, w, clock, dt=0.1)  # a 3rd
    step(s, w, clock, dt=0.1)  # a 4th (finishes)
    assert not s.requests

    snap = s.metrics_snapshot()
    h = snap.histograms
    assert snap.prompt_tokens == 8
    assert snap.generation_tokens == 6
    assert snap.request_success == {"stop": 0, "length": 2, "abort": 0}
    assert snap.num_preemptions == {"recompute": 0, "swap": 0}
    assert snap.stats.num_running == 0 and snap.stats.num_waiting == 0
    assert snap.stats.workers[0].num_free_blocks == 16
    # Steps computed 8, then 2, 1, 1 tokens (the last sampled token is never computed).
    assert h["iteration_tokens_total"].count == 4 and h["iteration_tokens_total"].sum == 12
    assert h["request_prompt_tokens"].sum == 8 and h["request_generation_tokens"].sum == 6
    assert h["request_queue_time_seconds"].sum == pytest.approx(1.0)  # 0.5 each
    assert h["time_to_first_token_seconds"].sum == pytest.approx(1.5)  # 0.75 each
    assert h["request_prefill_time_seconds"].sum == pytest.approx(0.5)
    # ITL: a has 3 gaps of 0.1 s, b one.
    assert h["inter_token_latency_seconds"].count == 4
    assert h["inter_token_latency_seconds"].sum == pytest.approx(0.4)
    assert h["request_decode_time_seconds"].sum == pytest.approx(0.4)
    assert h["request_time_per_output_token_seconds"].sum == pytest.approx(0.2)
    # e2e: a finishes at +1.05, b at +0.85.
    assert h["e2e_request_latency_seconds"].sum == pytest.approx(1.9)
    assert s.metrics.num_live_timers == 0


def test_prefix_cache_counters_are_tokens():
    s, clock = make()
    w = ScriptedWorker()
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks of 4 can be reused
    s.add_request(EngineRequest("a", prompt, greedy(1), [EOS]))
    step(s, w, clock)
    s.add_request(EngineRequest("b", prompt, greedy(1), [EOS]))
    step(s, w, clock)
    st = s.metrics_snapshot().stats
    assert st.prefix_cache_queries == 18
    assert st.prefix_cache_hits == 8


def test_preemptions_and_aborts_are_counted():
    # 4 blocks of 4 slots: two sequences growing to 12 tokens cannot both fit.
    s, clock = make(num_blocks=4, budget=64, admission="fits-now")
    w = ScriptedWorker()
    s.add_request(EngineRequest("a", [1, 3, 5, 7], greedy(8), [EOS]))
    s.add_request(EngineRequest("b", [1, 3, 5, 9], greedy(8), [EOS]))
    s.config = dataclasses.replace(s.config, async_scheduling=False)

    def planned(*_) -> None:  # each step takes 10 ms: between its schedule and update
        clock.now += 0.01

    drive(s, [w.execute], on_plan=planned, max_steps=40)
    snap = s.metrics_snapshot()
    assert snap.num_preemptions["recompute"] == s.num_preemptions > 0
    assert snap.request_success["length"] == 2
    assert snap.generation_tokens == 16  # recomputation appends no extra tokens
    s.add_request(EngineRequest("c", [1, 3], greedy(4), [EOS]))
    s.abort_request("c")
    snap = s.metrics_snapshot()
    assert snap.request_success["abort"] == 1
    assert snap.histograms["time_to_first_token_seconds"].count == 2  # c never produced one
    assert snap.histograms["request_queue_time_seconds"].count == 2


def test_stop_reason_from_the_frontend_counts_as_stop():
    s, clock = make()
    w = ScriptedWorker()
    s.add_request(EngineRequest("a", [1, 3], greedy(8), [EOS]))
    step(s, w, clock)
    s.abort_request("a", 0, FinishReason.STOP)
    assert s.metrics_snapshot().request_success["stop"] == 1
