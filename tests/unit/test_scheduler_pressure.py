"""Memory pressure: recompute counters, projected-growth admission, least-waste victims.

One fake worker (``ScriptedWorker``: token = 100 + known length, so outputs do not depend
on the schedule); prefix caching off where exact recompute counts are asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from helpers import ScriptedWorker, drive

from pagedserve.cluster.metrics import snapshot_families
from pagedserve.scheduler.admission import Footprint, peak_blocks
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.request import SequenceStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec


def make(num_blocks, block_size=4, admission="projected", victim="least-waste", max_len=256, **kw):
    cfg = SchedulerConfig(
        max_num_seqs=kw.pop("max_seqs", 16),
        max_num_batched_tokens=kw.pop("budget", 256),
        max_model_len=max_len,
        admission=admission,
        preemption_victim=victim,
        enable_prefix_caching=kw.pop("caching", False),
        **kw,
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])


def greedy(max_tokens, priority=0):
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority
    )


def run(s, w, max_steps=2000):
    """The serial engine loop to completion within ``max_steps`` (``helpers.drive``);
    returns the tokens per request id (one choice each)."""
    s.config = dataclasses.replace(s.config, async_scheduling=False)
    driven = drive(s, [w.execute], max_steps=max_steps)
    toks: dict[str, list[int]] = {}
    for o in driven.outputs:
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    return toks


# ------------------------------------------------------------------ counters
def test_recomputed_tokens_are_counted_exactly_per_worker_and_in_stats():
    # 4 blocks of 4 slots, two 6-token prompts: at its fourth step a needs a third block;
    # b (latest) is preempted with 8 computed tokens (6 prompt + 2 outputs) and recomputes
    # exactly those 8 (no prefix cache) when a has finished.
    s, w = make(4, admission="fits-now", victim="latest"), ScriptedWorker()
    s.add_request(EngineRequest("a", [1] * 6, greedy(6)))
    s.add_request(EngineRequest("b", [3] * 6, greedy(6)))
    toks = run(s, w)
    assert toks["a"] == toks["b"] == [106, 107, 108, 109, 110, 111]
    st = s.stats()
    assert s.num_preemptions == st.num_preemptions == 1
    assert s.num_recomputed_tokens == st.num_recomputed_tokens == 8
    (ws,) = st.workers
    assert ws.num_preemptions == 1 and ws.num_recomputed_tokens == 8
    assert ws.num_free_blocks == 4
    names = {
        (fam.name, tuple(sorted(smp.labels.items())), smp.value)
        for fam in snapshot_families(s.metrics_snapshot(), "m")
        for smp in fam.samples
    }
    assert (
        "pagedserve:num_recomputed_tokens",
        (("model_name", "m"), ("worker", "0")),
        8,
    ) in {(n.removesuffix("_total"), labels, v) for n, labels, v in names}


def test_prefix_cache_hits_after_preemption_are_not_recomputed():
    # Same as above with prefix caching: b's two full blocks were cached, but freeing goes
    # tail first, so a's third block is b's second one; b's first block (four 3s) is still
    # cached when b returns, so only tokens 4..7 are computed again.
    s, w = make(4, admission="fits-now", victim="latest", caching=True), ScriptedWorker()
    s.add_request(EngineRequest("a", [1] * 6, greedy(6)))
    s.add_request(EngineRequest("b", [3] * 6, greedy(6)))
    run(s, w)
    assert s.num_preemptions == 1
    assert s.num_recomputed_tokens == 4


# ------------------------------------------------------------------ projected admission
def test_projected_admission_waits_instead_of_preempting():
    s, w = make(4), ScriptedWorker()
    s.add_request(EngineRequest("a", [1] * 6, greedy(6)))
    s.add_request(EngineRequest("b", [3] * 6, greedy(6)))
    so = s.schedule(0).output
    # a's peak is 6 + 5 = 11 slots = 3 blocks, so b (3 blocks at its peak) waits.
    assert list(so.num_scheduled_tokens) == ["a/0"]
    s.update(0, so, w.execute(so))
    toks = run(s, w)
    assert toks["a"] == [107, 108, 109, 110, 111]  # its first token came from the step above
    assert toks["b"] == [106, 107, 108, 109, 110, 111]
    assert s.num_preemptions == 0 and s.num_recomputed_tokens == 0
    assert s.workers[0].kv.num_free_blocks == 4


def _mixed_workload(s):
    rng = random.Random(7)
    for i in range(12):
        prompt = [rng.randint(5, 90) for _ in range(rng.randint(3, 20))]
        s.add_request(
            EngineRequest(f"r{i}", prompt, greedy(rng.randint(2, 16)), arrival_s=float(i))
        )


def test_projected_admission_removes_preemptions_on_a_deterministic_workload():
    results = {}
    for admission in ("fits-now", "projected"):
        s, w = make(12, admission=admission), ScriptedWorker()
        _mixed_workload(s)
        results[admission] = (run(s, w), s.num_preemptions, s.num_recomputed_tokens)
        assert s.workers[0].kv.num_free_blocks == 12
        assert not s.sequences
    (toks_now, pre_now, redo_now), (toks_proj, pre_proj, redo_proj) = results.values()
    assert toks_now == toks_proj  # same tokens, whatever the schedule
    assert (pre_now, redo_now) == (7, 71)
    assert (pre_proj, redo_proj) == (0, 0)


def test_growth_ratio_below_one_admits_more_and_may_preempt():
    s, w = make(12, admission_growth_ratio=0.5), ScriptedWorker()
    _mixed_workload(s)
    run(s, w)
    assert s.workers[0].kv.num_free_blocks == 12
    assert s.num_preemptions == 1  # fits-now: 7 (above)


def _brute_peak(other, fps, bs):
    horizon = max((f.growth for f in fps), default=0)
    return max(
        other + sum(f.base + -(-(f.tokens + t) // bs) for f in fps if f.growth >= t)
        for t in range(horizon + 1)
    )


def test_peak_blocks_matches_brute_force_and_beats_sum_of_maxima():
    # A finishes now (1 block); B grows from 4 to 12 slots (3 blocks): the peak is 3, not
    # the 4 a sum-of-maxima reservation would count.
    fps = [Footprint(0, 4, 0), Footprint(0, 4, 8)]
    assert peak_blocks(0, fps, 4) == 3
    rng = random.Random(0)
    for _ in range(400):
        bs = rng.choice([1, 2, 4, 16])
        fps = [
            Footprint(rng.randint(-2, 2), rng.randint(1, 60), rng.randint(0, 40))
            for _ in range(rng.randint(0, 8))
        ]
        other = rng.randint(0, 5)
        assert peak_blocks(other, fps, bs) == (_brute_peak(other, fps, bs) if fps else other)


# ------------------------------------------------------------------ victim choice
def _three(victim, policy="fcfs", c_priority=0):
    # 5 blocks of 4. a (oldest, 4-token prompt) needs a second block at its second step;
    # b has 2 computed tokens, c (latest) 9.
    s = make(5, admission="fits-now", victim=victim, scheduling_policy=policy)
    s.add_request(EngineRequest("a", [1, 2, 3, 4], greedy(3), arrival_s=1.0))
    s.add_request(EngineRequest("b", [5, 6], greedy(3), arrival_s=2.0))
    s.add_request(
        EngineRequest("c", list(range(10, 19)), greedy(3, priority=c_priority), arrival_s=3.0)
    )
    w = ScriptedWorker()
    so = s.schedule(0).output
    assert so.num_scheduled_tokens == {"a/0": 4, "b/0": 2, "c/0": 9}
    s.update(0, so, w.execute(so))
    so = s.schedule(0).output
    return s, w, so


def test_least_waste_preempts_the_sequence_with_fewest_computed_tokens():
    s, w, so = _three("least-waste")
    assert s.sequences["b/0"].status is SequenceStatus.WAITING
    assert set(so.num_scheduled_tokens) == {"a/0", "c/0"}
    s.update(0, so, w.execute(so))
    run(s, w)
    assert s.num_preemptions == 1 and s.num_recomputed_tokens == 2


def test_latest_victim_preempts_the_last_arrival():
    s, w, so = _three("latest")
    assert s.sequences["c/0"].status is SequenceStatus.WAITING
    s.update(0, so, w.execute(so))
    run(s, w)
    assert s.num_preemptions == 1 and s.num_recomputed_tokens == 9


def test_least_waste_respects_priority():
    # c is less urgent: it is the victim although it has computed the most.
    s, _, _ = _three("least-waste", policy="priority", c_priority=3)
    assert s.sequences["c/0"].status is SequenceStatus.WAITING
    assert s.sequences["b/0"].status is SequenceStatus.RUNNING


def _drive(s, seed):
    """The pressure benchmark's workload shape on a fake worker: 48 requests (prompts of
    10..200 tokens, 4..64 outputs, 30% cancelled after a random number of tokens), 16 in
    flight, pool of 96 blocks of 16; through the engine loop (serial or overlapped, as the
    config says), the next requests added after each step and the cancellations made as
    the deltas arrive (``benchmarks/memory/pressure_sim.py``'s closed loop)."""
    rng = random.Random(seed)
    w = ScriptedWorker()
    todo, live = list(range(48)), {}

    def top_up() -> None:
        while len(live) < 16 and todo:
            i = todo.pop()
            prompt = [rng.randint(5, 900) for _ in range(rng.randint(10, 200))]
            max_tokens = rng.randint(4, 64)
            s.add_request(EngineRequest(f"r{i}", prompt, greedy(max_tokens)))
            live[f"r{i}"] = rng.randint(1, max_tokens) if rng.random() < 0.3 else None

    def sink(outs) -> None:
        for o in outs:
            if o.finish_reason is not None:
                live.pop(o.request_id, None)
            elif (cut := live.get(o.request_id)) is not None and o.num_output_tokens >= cut:
                s.abort_request(o.request_id)
                live.pop(o.request_id)

    def stepped(*_) -> None:
        s.check_integrity()
        top_up()

    top_up()
    engine = EngineLoop(s, {0: InlineWorker(w.execute)}, sink, on_step=stepped)
    asyncio.run(asyncio.wait_for(engine.run_until_idle(), 120))
    assert not todo and not live and not s.sequences


def test_projected_admission_never_preempts_serial_or_overlapped():
    for overlap in (False, True):
        for seed in range(2):
            s = make(96, block_size=16, async_scheduling=overlap, max_seqs=64, max_len=512)
            _drive(s, seed)
            assert s.num_preemptions == 0, (overlap, seed)
            assert s.workers[0].kv.num_free_blocks == 96
    # The same workload admitted by current need preempts (and recomputes) a lot.
    s = make(
        96, block_size=16, admission="fits-now", async_scheduling=True, max_seqs=64, max_len=512
    )
    _drive(s, 0)
    assert (s.num_preemptions, s.num_recomputed_tokens) == (19, 388)
