"""Speculative decoding in the scheduler: proposals, lookahead slots, rollback, stops."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import ScriptedWorker, drive

from pagedserve.scheduler.config import SchedulerConfig, SpeculativeConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.outputs import RunnerOutput
from pagedserve.scheduler.proposer import NgramProposer
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

EOS = 2


def make(k=4, num_blocks=16, block_size=4, ngram=(1, 2), spec=True, **kw):
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_model_len=256,
        async_scheduling=False,
        speculative_config=SpeculativeConfig("ngram", k, *ngram) if spec else None,
        **kw,
    )
    return Scheduler(cfg, [WorkerSpec(0, num_blocks, block_size)])


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="speculative method"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig("ngram", 2, 0, 3)
    with pytest.raises(ValueError, match="ngram_max"):
        SpeculativeConfig("ngram", 2, 3, 2)
    with pytest.raises(ValueError, match="speculative_config"):
        SchedulerConfig(speculative_config={"method": "ngram"})  # type: ignore[arg-type]


def test_ngram_proposer_longest_then_latest_match():
    p = NgramProposer(1, 3)
    # trailing 3-gram [1, 2, 3] recurs at 0 and 4: the latest (4) wins
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 3) == [8, 7, 1]
    # no 3- or 2-gram match; the 1-gram [5] recurs at 1
    assert p.propose([4, 5, 6, 7, 5], 2) == [6, 7]
    assert p.propose([4, 5, 6, 7, 5], 0) == []
    assert p.propose([1, 2, 3], 4) == []
    # a match near the end proposes what there is
    assert p.propose([7, 7], 4) == [7]
    assert NgramProposer(2, 2).propose([4, 5, 6, 7, 5], 2) == []


def test_ngram_proposer_equals_a_plain_scan():
    """The byte search (4-byte ids, unaligned matches skipped) finds what a scan of every
    start position finds, small vocabularies (many unaligned byte matches) included."""
    import random

    def scan(toks, k, lo, hi):
        num = len(toks)
        for n in range(min(hi, num - 1), lo - 1, -1):
            for i in range(num - n - 1, -1, -1):
                if toks[i : i + n] == toks[num - n :]:
                    return toks[i + n : i + n + k]
        return []

    # ids whose bytes shift into each other (0, 1, 256, 65536, ...): unaligned byte matches
    shifty = [0, 1, 256, 257, 65536, 16777216, 16777217]
    rng = random.Random(1)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 300, 70000, 2**32 - 1])
        if trial % 2:
            toks = [rng.choice(shifty) for _ in range(rng.randrange(40))]
        else:
            toks = [rng.randrange(vocab) for _ in range(rng.randrange(40))]
        lo = rng.randrange(1, 4)
        hi, k = lo + rng.randrange(3), rng.randrange(6)
        assert NgramProposer(lo, hi).propose(toks, k) == scan(toks, k, lo, hi)


def test_refuses_beam_search_and_structured_outputs():
    from pagedserve.scheduler.structured_outputs import StructuredOutputs

    s = make()
    with pytest.raises(InvalidRequest, match="beam search"):
        s.add_request(EngineRequest("b", [1, 2], SamplingParams(beam_width=2, max_tokens=4), []))
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="a+"))
    with pytest.raises(InvalidRequest, match="structured_outputs"):
        s.add_request(EngineRequest("c", [1, 2], constrained, []))
    assert not s.requests
    assert make(spec=False).add_request(EngineRequest("c", [1, 2], constrained, []))


def test_slots_reserved_then_rolled_back_exact_blocks_and_no_hash():
    s = make(k=4)
    kv = s.workers[0].kv
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], greedy(16), [EOS]))
    so = s.schedule(0).output
    assert so.num_scheduled_tokens == {"a/0": 5}
    assert so.new_seqs[0].block_ids == [0, 1]
    s.update(0, so, RunnerOutput(so.step_id, {"a/0": 7}))
    assert kv.num_cached_blocks == 1  # block 0: prompt slots 0-3

    # tokens [5 6 7 5 6 7]: the trailing 2-gram [6 7] recurs at 1, its continuation [5 6 7]
    so = s.schedule(0).output
    (cached,) = so.cached_seqs
    assert cached.spec_token_ids == [5, 6, 7]
    assert so.num_scheduled_tokens == {"a/0": 4}  # the budget counts 1 + proposals
    assert cached.new_blocks_start == 2 and cached.new_block_ids == [2]
    assert kv.get_num_tokens("a/0") == 9
    assert kv.get_ref_count(2) == 1

    # the worker accepts one proposal (5) and samples 9 after it
    up = s.update(0, so, RunnerOutput(so.step_id, spec_token_ids={"a/0": [5, 9]}))
    assert [o.new_token_ids for o in up.outputs] == [(5, 9)]
    seq = s.sequences["a/0"]
    assert seq.num_computed_tokens == 7
    assert seq.all_token_ids == [5, 6, 7, 5, 6, 7, 5, 9]
    assert kv.get_block_ids("a/0") == [0, 1]
    assert kv.get_num_tokens("a/0") == 7
    assert kv.get_ref_count(2) == 0 and kv.num_free_blocks == 14
    # block 1 holds slots 4-7: slot 7 had a rejected proposal, so it is not hashed
    assert kv.num_cached_blocks == 1
    assert s.stats().spec_decode.num_drafts == 1
    assert s.stats().spec_decode.num_draft_tokens == 3
    assert s.stats().spec_decode.num_accepted_tokens == 1
    s.check_integrity()

    # no n-gram of [... 5 9] recurs: a plain decode, the worker's table cut back to 2
    so = s.schedule(0).output
    (cached,) = so.cached_seqs
    assert cached.spec_token_ids == [] and so.num_scheduled_tokens == {"a/0": 1}
    assert cached.new_blocks_start == 2 and cached.new_block_ids == []
    assert cached.num_computed_tokens == 7
    s.update(0, so, RunnerOutput(so.step_id, {"a/0": 4}))
    assert kv.num_cached_blocks == 2  # block 1 now holds computed, accepted tokens only
    s.check_integrity()


def test_stop_inside_an_accepted_run_drops_the_rest():
    s = make(k=4)
    kv = s.workers[0].kv
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], greedy(16), [EOS]))
    so = s.schedule(0).output
    s.update(0, so, RunnerOutput(so.step_id, {"a/0": 7}))
    so = s.schedule(0).output
    assert so.cached_seqs[0].spec_token_ids == [5, 6, 7]
    up = s.update(0, so, RunnerOutput(so.step_id, spec_token_ids={"a/0": [5, EOS, 7]}))
    (out,) = up.outputs
    assert out.new_token_ids == (5, EOS)
    assert out.finish_reason is FinishReason.STOP and out.num_output_tokens == 3
    assert kv.num_free_blocks == 16 and not s.sequences
    s.check_integrity()


def test_proposals_never_pass_max_tokens():
    s = make(k=4)
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], greedy(3), [EOS]))
    so = s.schedule(0).output
    s.update(0, so, RunnerOutput(so.step_id, {"a/0": 7}))
    so = s.schedule(0).output
    # 1 output, 3 allowed: one proposal plus the token sampled after it
    assert so.cached_seqs[0].spec_token_ids == [5]
    up = s.update(0, so, RunnerOutput(so.step_id, spec_token_ids={"a/0": [5, 6]}))
    assert up.outputs[0].finish_reason is FinishReason.LENGTH
    assert up.outputs[0].num_output_tokens == 3


class PatternWorker(ScriptedWorker):
    """'Samples' a function of the sequence's length alone (a cyclic pattern per request,
    else 100 + length), so every loop and step split yields the same tokens."""

    PATTERNS = {"r": [7, 8, 9], "x": [3, 4, 5, 6, 3, 4, 1, 1, 1, 1]}

    def _sample(self, rid: str) -> int:
        toks = self.tokens[rid]
        pattern = self.PATTERNS.get(rid.split("/")[0])
        tok = pattern[len(toks) % len(pattern)] if pattern else 100 + len(toks)
        toks.append(tok)
        return tok


def _repetitive(s, n=1, max_tokens=24):
    s.add_request(EngineRequest("r", [7, 8, 9, 7, 8], greedy(max_tokens, n=n), []))
    s.add_request(EngineRequest("x", [3, 4, 5], greedy(max_tokens), []))
    s.add_request(EngineRequest("p", [11, 12, 13, 14, 15, 16], greedy(max_tokens), []))


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize(
    "kw",
    [{}, {"num_blocks": 9}, {"num_blocks": 9, "preemption_victim": "latest"}],
    ids=["roomy", "preempting", "preempting-latest"],
)
def test_outputs_equal_without_speculation(overlapped, kw):
    """The scripted worker samples the same tokens whatever the step: speculative runs
    (accepted and rejected proposals, preemption by recompute in a small pool, both loops)
    stream exactly the tokens of the plain run; integrity is checked after every step."""
    results = []
    for spec in (False, True):
        s = make(k=3, spec=spec, **kw)
        s.config = dataclasses.replace(s.config, async_scheduling=overlapped)
        _repetitive(s)
        driven = drive(s, [PatternWorker().execute], max_steps=400)
        results.append((driven.tokens, driven.finish, driven.steps, s.stats()))
    (plain, pfin, psteps, _), (spec_toks, sfin, ssteps, st) = results
    assert spec_toks == plain and sfin == pfin
    assert all(len(t) == 24 for t in plain.values())
    assert st.spec_decode.num_accepted_tokens > 10
    assert ssteps < psteps
    if kw:
        assert st.num_preemptions > 0


def test_parallel_sampling_children_speculate_on_their_own_blocks():
    results = []
    for spec in (False, True):
        s = make(k=3, spec=spec, num_blocks=24)
        _repetitive(s, n=3, max_tokens=12)
        driven = drive(s, [PatternWorker().execute], max_steps=400)
        results.append(driven.tokens)
        assert s.workers[0].kv.num_free_blocks == 24
    assert results[0] == results[1]
    assert {c for (r, c) in results[1] if r == "r"} == {0, 1, 2}


def test_kv_rollback_frees_the_tail_and_refuses_shared_blocks():
    from pagedserve.scheduler.errors import IntegrityError
    from pagedserve.scheduler.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(8, 4)
    kv.allocate_slots("a", 5)  # blocks 0, 1
    kv.allocate_slots("a", 13)  # + 2, 3 (lookahead)
    assert kv.rollback("a", 6) == [2, 3]
    assert kv.get_block_ids("a") == [0, 1] and kv.get_num_tokens("a") == 6
    assert kv.num_free_blocks == 6
    assert kv.rollback("a", 6) == []
    with pytest.raises(ValueError, match="roll back"):
        kv.rollback("a", 7)
    kv.fork("a", "b")  # blocks 0, 1 shared
    with pytest.raises(IntegrityError, match="shared"):
        kv.rollback("a", 3)
    kv.check_integrity()


def test_no_proposals_in_a_batch_of_disable_by_batch_size():
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_model_len=256,
        async_scheduling=True,
        speculative_config=SpeculativeConfig("ngram", 3, 1, 2, disable_by_batch_size=2),
    )
    s = Scheduler(cfg, [WorkerSpec(0, 16, 4)])
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], greedy(16), [EOS]))
    s.add_request(EngineRequest("b", [5, 6, 7, 5, 6], greedy(2), [EOS]))
    so = s.schedule(0).output
    s.update(0, so, RunnerOutput(so.step_id, {"a/0": 7, "b/0": 7}))
    so = s.schedule(0).output  # two running: no proposals, may be planned past
    assert [c.spec_token_ids for c in so.cached_seqs] == [[], []]
    assert s.can_plan_past(so)
    s.update(0, so, RunnerOutput(so.step_id, {"a/0": 5, "b/0": 5}))  # b ends (max_tokens)
    so = s.schedule(0).output  # a alone: proposes, not planned past
    assert so.cached_seqs[0].spec_token_ids == [6, 7, 5]
    assert not s.can_plan_past(so)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=1)


def test_draft_method_sends_the_number_of_proposals_and_reserves_their_slots():
    """With a draft model the scheduler sends how many tokens to propose (K, cut by
    max_tokens) and no ids; the step counts 1 + K tokens and reserves their slots."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_model_len=256,
        async_scheduling=False,
        speculative_config=SpeculativeConfig("draft", 3, draft_model="/models/small"),
    )
    sched = Scheduler(cfg, [WorkerSpec(0, 16, 4)])
    sched.add_request(EngineRequest("r", [5, 6, 7], greedy(6), (EOS,)))
    so = sched.schedule(0).output  # prefill: no proposals
    assert so.num_scheduled_tokens == {"r/0": 3}
    sched.update(0, so, RunnerOutput(so.step_id, {"r/0": 10}))
    so = sched.schedule(0).output
    (cached,) = so.cached_seqs
    assert (cached.num_draft_tokens, cached.spec_token_ids) == (3, [])
    assert so.num_scheduled_tokens == {"r/0": 4}
    assert sched.workers[0].kv.num_free_blocks == 16 - 2  # 3 + 1 + 3 slots in 4-slot blocks
    # 2 of 3 accepted, then one more: 4 known + 3 = 7 tokens, 6 computed
    sched.update(0, so, RunnerOutput(so.step_id, {}, spec_token_ids={"r/0": [11, 12, 13]}))
    assert sched.spec_decode.snapshot().num_accepted_tokens == 2
    so = sched.schedule(0).output
    (cached,) = so.cached_seqs
    # max_tokens 6, 4 outputs: one sampled, at most one proposed before it
    assert (cached.num_draft_tokens, cached.num_computed_tokens) == (1, 6)
