"""Scheduler policy tests with a fake worker: exact batches, block ids, preemption, stops."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import ScriptedWorker as FakeWorker
from helpers import drive

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import DuplicateRequest, InvalidRequest, RequestRejected
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

EOS = 2


def make(
    num_blocks=16, block_size=4, budget=64, max_seqs=8, chunked=True, caching=True,
    admission="projected",
):  # fmt: skip
    cfg = SchedulerConfig(
        admission=admission,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        max_model_len=256,
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])


def serial(s: Scheduler) -> Scheduler:
    """``s`` with the serial engine loop (schedule, execute, update: exact batches)."""
    s.config = dataclasses.replace(s.config, async_scheduling=False)
    return s


def run(s: Scheduler, w: FakeWorker, max_steps=200):
    """The serial engine loop to completion (``helpers.drive``, every worker answered by
    ``w``); returns the deltas and the steps planned, in order."""
    steps = []
    driven = drive(
        serial(s),
        [w.execute] * len(s.workers),
        on_plan=lambda _s, _wid, so, _cur: steps.append(so),
        max_steps=max_steps,
    )
    return driven.outputs, steps


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_single_request_blocks_and_tokens():
    s, w = make(), FakeWorker()
    s.add_request(EngineRequest("a", [5, 6, 7, 8, 9], greedy(4), [EOS]))
    so = s.schedule(0).output
    assert so.num_scheduled_tokens == {"a/0": 5}
    assert so.new_seqs[0].block_ids == [0, 1]
    assert so.new_seqs[0].num_computed_tokens == 0
    outs, _ = [], None
    outs = s.update(0, so, w.execute(so)).outputs
    assert [o.new_token_ids for o in outs] == [(105,)]
    more, steps = run(s, w)
    toks = [t for o in outs + more for t in o.new_token_ids]
    assert toks == [105, 106, 107, 108]
    assert more[-1].finish_reason is FinishReason.LENGTH
    assert all(
        st.num_scheduled_tokens == {"a/0": 1} for st in steps[:-1] if st.num_scheduled_tokens
    )
    assert s.workers[0].kv.num_free_blocks == 16
    assert not s.requests and not s.sequences


def test_eos_and_stop_token_ids_and_ignore_eos():
    s = make()
    w = FakeWorker(script={"a": [11, EOS, 12], "b": [11, 42, 12], "c": [EOS, EOS, 7]})
    s.add_request(EngineRequest("a", [1, 3], greedy(8), [EOS]))
    s.add_request(EngineRequest("b", [1, 3], greedy(8, stop_token_ids=(42,)), [EOS]))
    s.add_request(EngineRequest("c", [1, 3], greedy(3, ignore_eos=True), [EOS]))
    outs, _ = run(s, w)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert final["a"].finish_reason is FinishReason.STOP and final["a"].num_output_tokens == 2
    assert final["b"].finish_reason is FinishReason.STOP and final["b"].num_output_tokens == 2
    assert final["c"].finish_reason is FinishReason.LENGTH and final["c"].num_output_tokens == 3
    assert s.workers[0].kv.num_free_blocks == 16


def test_chunked_prefill_respects_budget():
    s, w = make(budget=4), FakeWorker()
    s.add_request(
        EngineRequest("a", list(range(3, 13)), greedy(2), [EOS])
    )  # 10 tokens -> chunks 4, 4, 2
    so1 = s.schedule(0).output
    assert so1.num_scheduled_tokens == {"a/0": 4}
    assert s.update(0, so1, w.execute(so1)).outputs == []
    so2 = s.schedule(0).output
    assert so2.num_scheduled_tokens == {"a/0": 4}
    assert so2.cached_seqs[0].num_computed_tokens == 4
    assert s.update(0, so2, w.execute(so2)).outputs == []
    so3 = s.schedule(0).output
    assert so3.num_scheduled_tokens == {"a/0": 2}
    out = s.update(0, so3, w.execute(so3)).outputs
    assert out[0].new_token_ids == (110,)


def test_no_chunking_waits_for_budget():
    s = make(budget=4, chunked=False)
    s.add_request(EngineRequest("a", list(range(3, 13)), greedy(2), [EOS]))
    assert s.schedule(0).output.num_scheduled_tokens == {}


def test_running_first_then_admission_fcfs_and_max_seqs():
    s, w = make(max_seqs=2), FakeWorker()
    for rid in "abc":
        s.add_request(EngineRequest(rid, [1, 2, 3], greedy(3), [EOS]))
    so = s.schedule(0).output
    assert list(so.num_scheduled_tokens) == ["a/0", "b/0"]
    s.update(0, so, w.execute(so))
    so = s.schedule(0).output
    assert so.num_scheduled_tokens == {"a/0": 1, "b/0": 1}
    s.update(0, so, w.execute(so))  # a planned step is in flight until its answer is applied
    outs, _ = run(s, w)
    assert {o.request_id for o in outs if o.finish_reason} == {"a", "b", "c"}


def test_preemption_by_recompute_and_resume():
    # 4 blocks of 4 slots: two requests of 6-token prompts need 2 blocks each, then grow.
    s, w = make(num_blocks=4, block_size=4, admission="fits-now"), FakeWorker()
    s.add_request(EngineRequest("a", [1] * 6, greedy(6), [EOS]))
    s.add_request(EngineRequest("b", [3] * 6, greedy(6), [EOS]))
    outs, steps = run(s, w)
    assert s.num_preemptions >= 1
    # b (newest) was preempted, so some step re-sent b in full with its outputs as prompt
    resent = [nr for st in steps for nr in st.new_seqs if nr.seq_id == "b/0"]
    assert len(resent) >= 2
    assert len(resent[-1].token_ids) > 6 and resent[-1].num_prompt_tokens == 6
    toks = {}
    for o in outs:
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert toks["a"] == [106, 107, 108, 109, 110, 111]
    assert toks["b"] == [106, 107, 108, 109, 110, 111]
    assert s.workers[0].kv.num_free_blocks == 4


def test_prefix_cache_hit_reports_cached_tokens():
    s, w = make(block_size=4), FakeWorker()
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    s.add_request(EngineRequest("a", prompt, greedy(1), [EOS]))
    run(s, w)
    s.add_request(EngineRequest("b", prompt, greedy(1), [EOS]))
    so = s.schedule(0).output
    assert so.new_seqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b/0": 1}
    outs = s.update(0, so, w.execute(so)).outputs
    assert outs[0].num_cached_tokens == 8 and outs[0].finish_reason is FinishReason.LENGTH


def test_reset_prefix_cache_refuses_while_busy_then_forgets_every_hash():
    s, w = (
        Scheduler(
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
            [WorkerSpec(0, 16, 4), WorkerSpec(1, 16, 4)],
        ),
        FakeWorker(),
    )
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    s.add_request(EngineRequest("a", prompt, greedy(1), [EOS]))
    so = s.schedule(0).output
    assert so.new_seqs[0].block_ids == [0, 1, 2]
    assert not s.reset_prefix_cache()  # "a" holds 3 blocks on worker 0
    s.update(0, so, w.execute(so))
    run(s, w)  # tells the worker "a" finished
    assert s.reset_prefix_cache()
    s.add_request(EngineRequest("b", prompt, greedy(1), [EOS]))
    so = s.schedule(0).output
    assert so.new_seqs[0].num_computed_tokens == 0  # computed again: no hit
    assert so.num_scheduled_tokens == {"b/0": 9}
    s.update(0, so, w.execute(so))
    run(s, w)
    assert s.workers[0].kv.num_free_blocks == 16 and s.workers[1].kv.num_free_blocks == 16
    s.check_integrity()


def test_abort_in_every_state_returns_blocks():
    s, w = make(budget=4), FakeWorker()
    s.add_request(EngineRequest("run", [1] * 8, greedy(5), [EOS]))
    s.add_request(EngineRequest("wait", [1] * 8, greedy(5), [EOS]))
    so = s.schedule(0).output  # 'run' gets a prefill chunk, 'wait' waits
    outs = s.abort_request("wait")
    assert outs[0].finish_reason is FinishReason.ABORT
    s.update(0, so, w.execute(so))
    assert s.abort_request("run")[0].finish_reason is FinishReason.ABORT
    assert s.abort_request("run") == []
    assert s.abort_request("unknown") == []
    so = s.schedule(0).output
    assert so.finished_seq_ids == ["run/0"]
    s.check_integrity()
    assert s.workers[0].kv.num_free_blocks == 16
    assert not s.has_work(0)


def test_rejects_bad_requests():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequest, match="empty"):
        s.add_request(EngineRequest("x", [], greedy(1)))
    with pytest.raises(InvalidRequest, match="max_model_len"):
        s.add_request(EngineRequest("x", [1] * 250, greedy(10)))
    with pytest.raises(RequestRejected, match="KV slots"):
        s.add_request(EngineRequest("x", [1] * 10, greedy(10)))
    s.add_request(EngineRequest("y", [1], greedy(1)))
    with pytest.raises(DuplicateRequest, match="in flight"):
        s.add_request(EngineRequest("y", [1], greedy(1)))


def test_n_choices_fork_from_one_prefill_and_share_blocks():
    s, w = make(), FakeWorker()
    seqs = s.add_request(
        EngineRequest("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, n=3, seed=1), [EOS])
    )
    assert [q.seq_id for q in seqs] == ["a/0", "a/1", "a/2"]
    kv = s.workers[0].kv
    so = s.schedule(0).output  # one prefill for the whole request
    assert so.num_scheduled_tokens == {"a/0": 6}
    assert so.new_seqs[0].block_ids == [0, 1]
    assert s.stats().num_waiting == 2  # the pending choices
    outs = s.update(0, so, w.execute(so)).outputs
    assert [(o.choice_index, o.new_token_ids) for o in outs] == [(0, (106,))]
    # Forked at 5 tokens: both blocks shared by the three choices.
    assert [kv.get_block_ids(f"a/{c}") for c in range(3)] == [[0, 1]] * 3
    assert (kv.get_ref_count(0), kv.get_ref_count(1)) == (3, 3)
    assert s.stats().workers[0].num_used_blocks == 2
    so = s.schedule(0).output
    # Choice 0 appends its first output, choices 1 and 2 recompute the last prompt token:
    # the shared partial block 1 is copied for every writer but the last one.
    assert so.num_scheduled_tokens == {"a/0": 1, "a/1": 1, "a/2": 1}
    assert so.blocks_to_copy == [(1, 2), (1, 3)]
    assert so.cached_seqs[0].seq_id == "a/0"
    assert (so.cached_seqs[0].new_blocks_start, so.cached_seqs[0].new_block_ids) == (1, [2])
    assert [
        (n.seq_id, n.block_ids, n.num_computed_tokens, n.choice_index) for n in so.new_seqs
    ] == [
        ("a/1", [0, 3], 5, 1),
        ("a/2", [0, 1], 5, 2),
    ]
    assert [n.token_ids for n in so.new_seqs] == [[1, 2, 3, 4, 5, 6]] * 2
    assert [kv.get_ref_count(b) for b in range(4)] == [3, 1, 1, 1]
    outs = s.update(0, so, w.execute(so)).outputs
    assert [(o.choice_index, o.new_token_ids) for o in outs] == [
        (0, (107,)),
        (1, (106,)),
        (2, (106,)),
    ]
    s.check_integrity()
    so = s.schedule(0).output
    outs = s.update(0, so, w.execute(so)).outputs
    # Choice 0 finished first and freed only its private block 2.
    assert [(o.choice_index, o.finish_reason) for o in outs] == [
        (0, FinishReason.LENGTH),
        (1, None),
        (2, None),
    ]
    assert kv.get_ref_count(0) == 2 and kv.get_ref_count(2) == 0
    assert kv.get_block_ids("a/1") == [0, 3] and kv.get_block_ids("a/2") == [0, 1]
    more, _ = run(s, w)
    assert sorted(o.choice_index for o in more if o.finish_reason) == [1, 2]
    assert kv.num_free_blocks == 16
    assert not s.requests and not s.sequences


def test_fork_at_block_boundary_and_one_token_prompt():
    s, w = make(), FakeWorker()
    s.add_request(
        EngineRequest("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, n=2, seed=1), [EOS])
    )
    s.add_request(EngineRequest("b", [7], SamplingParams(max_tokens=2, n=2, seed=1), [EOS]))
    so = s.schedule(0).output
    assert [n.block_ids for n in so.new_seqs] == [[0, 1], [2]]
    s.update(0, so, w.execute(so))
    kv = s.workers[0].kv
    # a: forked at 4 tokens = exactly block 0; b: a 1-token prompt shares nothing.
    assert kv.get_block_ids("a/1") == [0] and kv.get_ref_count(0) == 2
    assert not kv.has_seq("b/1")
    so = s.schedule(0).output
    assert so.blocks_to_copy == []
    assert {n.seq_id: (n.block_ids, n.num_computed_tokens) for n in so.new_seqs} == {
        "a/1": ([0, 3], 4),
        "b/1": ([4], 0),
    }
    s.update(0, so, w.execute(so))
    run(s, w)
    assert kv.num_free_blocks == 16


def test_abort_before_fork_hands_the_prefill_to_the_next_choice():
    s, w = make(budget=4), FakeWorker()
    s.add_request(
        EngineRequest("a", list(range(1, 9)), SamplingParams(max_tokens=2, n=3, seed=1), [EOS])
    )
    so = s.schedule(0).output  # first chunk of choice 0's prompt
    assert so.num_scheduled_tokens == {"a/0": 4}
    s.update(0, so, w.execute(so))
    outs = s.abort_request("a", choice_index=0)
    assert [(o.choice_index, o.finish_reason) for o in outs] == [(0, FinishReason.ABORT)]
    so = s.schedule(0).output
    assert so.finished_seq_ids == ["a/0"]
    # Choice 1 now prefills; the block choice 0 computed is a prefix-cache hit.
    assert so.num_scheduled_tokens == {"a/1": 4}
    assert so.new_seqs[0].num_computed_tokens == 4
    outs = s.update(0, so, w.execute(so)).outputs
    more, _ = run(s, w)
    outs += more
    assert sorted(o.choice_index for o in outs if o.finish_reason) == [1, 2]
    assert s.workers[0].kv.num_free_blocks == 16 and not s.requests


def test_forked_choices_survive_preemption():
    # 6 blocks of 4: a 6-token prompt with n=3 and 8 outputs each needs up to 3 * 4 blocks
    # minus sharing, so choices are preempted and recomputed; outputs must not change.
    roomy, w1 = make(num_blocks=32), FakeWorker()
    tight, w2 = make(num_blocks=6), FakeWorker()
    results = []
    for s, w in ((roomy, w1), (tight, w2)):
        s.add_request(
            EngineRequest("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, n=3, seed=1), [EOS])
        )
        outs, _ = run(s, w)
        toks: dict[int, list[int]] = {}
        for o in outs:
            toks.setdefault(o.choice_index, []).extend(o.new_token_ids)
        results.append(toks)
        assert s.workers[0].kv.num_free_blocks == s.workers[0].spec.num_blocks
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert results[0] == results[1] == {c: list(range(106, 114)) for c in range(3)}


def test_n8_long_prompt_peak_blocks_are_shared_prompt_plus_two_tail_blocks_each():
    from helpers import CheckedKVCacheManager

    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)
    s, w = Scheduler(cfg, [WorkerSpec(0, 256, 16)]), FakeWorker()
    s.workers[0].kv = kv = CheckedKVCacheManager(256, 16, True)
    s.add_request(EngineRequest("a", [7] * 300, SamplingParams(max_tokens=16, n=8, seed=0), [EOS]))
    peak = 0

    def planned(s: Scheduler, _wid: int, _so, _cur) -> None:
        nonlocal peak  # after each schedule, before its update
        peak = max(peak, kv.used(), s.stats().workers[0].num_used_blocks)

    drive(serial(s), [w.execute], on_plan=planned)
    # 18 full prompt blocks shared by all 8 choices; the partial 19th (12 tokens) copied
    # for 7 choices; each choice's outputs at positions 300..314 reach one more block.
    assert peak == 18 + 8 + 8 == 34  # 8 independent sequences would hold 8 * 20 = 160
    assert kv.num_free_blocks == 256


def test_prefix_stats_count_a_blocked_request_once():
    s, w = make(num_blocks=4, block_size=4), FakeWorker()
    s.add_request(
        EngineRequest("a", [1] * 12, greedy(2), [EOS])
    )  # takes 3 of 4 blocks (+1 to grow)
    s.add_request(EngineRequest("b", [2] * 12, greedy(2), [EOS]))  # blocked at the head for a while
    run(s, w)
    st = s.stats()
    assert st.prefix_cache_queries == 24


def test_cache_salt_isolates_prefix_blocks():
    s, w = make(block_size=4), FakeWorker()
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    s.add_request(EngineRequest("a", prompt, greedy(1, cache_salt="alice"), [EOS]))
    run(s, w)
    hits = {}
    for rid, salt in (("b", "bob"), ("c", None), ("d", "alice")):
        s.add_request(EngineRequest(rid, prompt, greedy(1, cache_salt=salt), [EOS]))
        so = s.schedule(0).output
        hits[rid] = so.new_seqs[0].num_computed_tokens
        s.update(0, so, w.execute(so))
    assert hits == {"b": 0, "c": 0, "d": 8}


def test_min_tokens_defers_stops_and_stop_token_is_reported():
    s = make()
    w = FakeWorker(script={"a": [EOS, 42, 5, 42], "b": [7, 42]})
    s.add_request(EngineRequest("a", [1, 3], greedy(8, min_tokens=3, stop_token_ids=(42,)), [EOS]))
    s.add_request(EngineRequest("b", [1, 3], greedy(8, stop_token_ids=(42,)), [EOS]))
    outs, _ = run(s, w)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert final["a"].num_output_tokens == 4 and final["a"].stop_reason == 42
    assert final["b"].num_output_tokens == 2 and final["b"].stop_reason == 42
    assert {o.finish_reason for o in final.values()} == {FinishReason.STOP}


def test_logprobs_flow_into_deltas_with_cumulative_sum():
    from pagedserve.scheduler.outputs import RunnerOutput, SampleLogprobs

    s = make()
    s.add_request(EngineRequest("a", [1, 3], greedy(2, logprobs=1), [EOS]))
    s.add_request(EngineRequest("b", [1, 3], greedy(2), [EOS]))
    got = []
    for step, (ta, tb) in enumerate([(7, 8), (9, 10)]):
        so = s.schedule(0).output
        lp = SampleLogprobs(ta, -0.5 * (step + 1), ((ta, -0.5 * (step + 1)),))
        ro = RunnerOutput(so.step_id, {"a/0": ta, "b/0": tb}, logprobs={"a/0": lp})
        got.append({o.request_id: o for o in s.update(0, so, ro).outputs})
    assert [g["a"].cumulative_logprob for g in got] == [-0.5, -1.5]
    assert [g["a"].logprobs[0].logprob for g in got] == [-0.5, -1.0]
    assert got[1]["b"].logprobs == () and got[1]["b"].cumulative_logprob is None
