"""Scheduler policy tests with a fake worker: exact batches, block ids, preemption, stops."""

from __future__ import annotations

import pytest
from helpers import ScriptedWorker as FakeWorker

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import DuplicateRequest, InvalidRequest, RequestRejected
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

EOS = 2


def make(num_blocks=16, block_size=4, budget=64, max_seqs=8, chunked=True, caching=True):
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        max_model_len=256,
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])


def run(s: Scheduler, w: FakeWorker, max_steps=200):
    outs, steps = [], []
    for _ in range(max_steps):
        if not s.has_work(0):
            break
        so = s.schedule(0)
        steps.append(so)
        outs.extend(s.update(0, so, w.execute(so)))
        s.check_integrity()
    return outs, steps


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_single_request_blocks_and_tokens():
    s, w = make(), FakeWorker()
    s.add_request("a", [5, 6, 7, 8, 9], greedy(4), [EOS])
    so = s.schedule(0)
    assert so.num_scheduled_tokens == {"a/0": 5}
    assert so.new_seqs[0].block_ids == [0, 1]
    assert so.new_seqs[0].num_computed_tokens == 0
    outs, _ = [], None
    outs = s.update(0, so, w.execute(so))
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
    s.add_request("a", [1, 3], greedy(8), [EOS])
    s.add_request("b", [1, 3], greedy(8, stop_token_ids=(42,)), [EOS])
    s.add_request("c", [1, 3], greedy(3, ignore_eos=True), [EOS])
    outs, _ = run(s, w)
    final = {o.request_id: o for o in outs if o.finish_reason is not None}
    assert final["a"].finish_reason is FinishReason.STOP and final["a"].num_output_tokens == 2
    assert final["b"].finish_reason is FinishReason.STOP and final["b"].num_output_tokens == 2
    assert final["c"].finish_reason is FinishReason.LENGTH and final["c"].num_output_tokens == 3
    assert s.workers[0].kv.num_free_blocks == 16


def test_chunked_prefill_respects_budget():
    s, w = make(budget=4), FakeWorker()
    s.add_request("a", list(range(3, 13)), greedy(2), [EOS])  # 10 tokens -> chunks 4, 4, 2
    so1 = s.schedule(0)
    assert so1.num_scheduled_tokens == {"a/0": 4}
    assert s.update(0, so1, w.execute(so1)) == []
    so2 = s.schedule(0)
    assert so2.num_scheduled_tokens == {"a/0": 4}
    assert so2.cached_seqs[0].num_computed_tokens == 4
    assert s.update(0, so2, w.execute(so2)) == []
    so3 = s.schedule(0)
    assert so3.num_scheduled_tokens == {"a/0": 2}
    out = s.update(0, so3, w.execute(so3))
    assert out[0].new_token_ids == (110,)


def test_no_chunking_waits_for_budget():
    s = make(budget=4, chunked=False)
    s.add_request("a", list(range(3, 13)), greedy(2), [EOS])
    assert s.schedule(0).num_scheduled_tokens == {}


def test_running_first_then_admission_fcfs_and_max_seqs():
    s, w = make(max_seqs=2), FakeWorker()
    for rid in "abc":
        s.add_request(rid, [1, 2, 3], greedy(3), [EOS])
    so = s.schedule(0)
    assert list(so.num_scheduled_tokens) == ["a/0", "b/0"]
    s.update(0, so, w.execute(so))
    so = s.schedule(0)
    assert so.num_scheduled_tokens == {"a/0": 1, "b/0": 1}
    outs, _ = run(s, w)
    assert {o.request_id for o in outs if o.finish_reason} == {"a", "b", "c"}


def test_preemption_by_recompute_and_resume():
    # 4 blocks of 4 slots: two requests of 6-token prompts need 2 blocks each, then grow.
    s, w = make(num_blocks=4, block_size=4), FakeWorker()
    s.add_request("a", [1] * 6, greedy(6), [EOS])
    s.add_request("b", [3] * 6, greedy(6), [EOS])
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
    s.add_request("a", prompt, greedy(1), [EOS])
    run(s, w)
    s.add_request("b", prompt, greedy(1), [EOS])
    so = s.schedule(0)
    assert so.new_seqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b/0": 1}
    outs = s.update(0, so, w.execute(so))
    assert outs[0].num_cached_tokens == 8 and outs[0].finish_reason is FinishReason.LENGTH


def test_abort_in_every_state_returns_blocks():
    s, w = make(budget=4), FakeWorker()
    s.add_request("run", [1] * 8, greedy(5), [EOS])
    s.add_request("wait", [1] * 8, greedy(5), [EOS])
    so = s.schedule(0)  # 'run' gets a prefill chunk, 'wait' waits
    outs = s.abort_request("wait")
    assert outs[0].finish_reason is FinishReason.ABORT
    s.update(0, so, w.execute(so))
    assert s.abort_request("run")[0].finish_reason is FinishReason.ABORT
    assert s.abort_request("run") == []
    assert s.abort_request("unknown") == []
    so = s.schedule(0)
    assert so.finished_seq_ids == ["run/0"]
    s.check_integrity()
    assert s.workers[0].kv.num_free_blocks == 16
    assert not s.has_work(0)


def test_rejects_bad_requests():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequest, match="empty"):
        s.add_request("x", [], greedy(1))
    with pytest.raises(InvalidRequest, match="max_model_len"):
        s.add_request("x", [1] * 250, greedy(10))
    with pytest.raises(RequestRejected, match="KV slots"):
        s.add_request("x", [1] * 10, greedy(10))
    s.add_request("y", [1], greedy(1))
    with pytest.raises(DuplicateRequest, match="in flight"):
        s.add_request("y", [1], greedy(1))


def test_n_choices_are_separate_sequences():
    s, w = make(), FakeWorker()
    seqs = s.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, n=3, seed=1), [EOS])
    assert [q.seq_id for q in seqs] == ["a/0", "a/1", "a/2"]
    outs, _ = run(s, w)
    assert sorted(o.choice_index for o in outs if o.finish_reason) == [0, 1, 2]
    assert s.workers[0].kv.num_free_blocks == 16


def test_prefix_stats_count_a_blocked_request_once():
    s, w = make(num_blocks=4, block_size=4), FakeWorker()
    s.add_request("a", [1] * 12, greedy(2), [EOS])  # takes 3 of 4 blocks (+1 to grow)
    s.add_request("b", [2] * 12, greedy(2), [EOS])  # blocked at the head for a while
    run(s, w)
    st = s.stats()
    assert st.prefix_cache_queries == 24
