"""Prefill/decode disaggregation in the scheduler, over fake workers whose KV pools hold
token ids (:class:`test_scheduler_swap.FakeKVWorker`: a block restored wrongly, or KV that
a handoff lost, changes the sampled tokens or fails the read-back there).

Worker 0 prefills prompts of at least ``LONG`` tokens, worker 1 decodes; both use one
store (one node) unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import drive, swaps_of
from test_scheduler_swap import BS, GREEDY, PROMPTS, FakeKVWorker, reference

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.disagg import DisaggConfig, DisaggManager
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.request import SequenceStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import SwapSpec

LONG = 7  # PROMPTS[0] (7 tokens) and PROMPTS[2] (13) are long; the others short
NUM_BLOCKS = 24


def make(
    num_blocks: tuple[int, ...] = (NUM_BLOCKS, NUM_BLOCKS),
    mode: str = "recompute",
    swap: SwapSpec | dict[int, SwapSpec] | None = None,
    overlap: bool = False,
    **disagg: float,
) -> Scheduler:
    if swap is None:
        swap = SwapSpec(64, 100, 1e9, 1e-3)
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=6,
            max_model_len=64,
            preemption_mode=mode,
            max_num_seqs=8,
            async_scheduling=overlap,
            host_prefix_cache=False,  # exact host block counts: no spilled prefix blocks
        ),
        [WorkerSpec(i, n, BS) for i, n in enumerate(num_blocks)],
        swap,
        DisaggConfig(frozenset({0}), LONG, **disagg),
    )


def add(sched: Scheduler, prompts=PROMPTS, sampling=GREEDY) -> None:
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, sampling))


def steps_by_worker(log: list[tuple[int, str, int, int]]):
    """on_plan hook: (worker, request id, tokens scheduled, computed before) per seq."""

    def hook(sched, wid, so, _cur):
        computed = {n.seq_id: n.num_computed_tokens for n in so.new_seqs}
        computed |= {c.seq_id: c.num_computed_tokens for c in so.cached_seqs}
        for sid, n in so.num_scheduled_tokens.items():
            log.append((wid, sched.sequences[sid].request_id, n, computed[sid]))

    return hook


def assert_all_free(sched: Scheduler, host: dict) -> None:
    for ws in sched.workers.values():
        assert ws.kv.num_free_blocks == ws.spec.num_blocks, ws.spec.worker_id
    sw = sched.swap_stats()
    assert sw.host_blocks_free == sw.host_blocks_total
    assert sw.num_requests_swapped == 0
    assert host == {}
    assert sched.disagg_stats().num_waiting == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_long_prompts_prefill_on_the_prefill_worker_and_decode_on_the_other(
    overlap: bool,
) -> None:
    host: dict = {}
    sched = make(overlap=overlap)
    add(sched)
    log: list = []
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, host)]
    tokens = drive(sched, [f.execute for f in fakes], on_plan=steps_by_worker(log)).tokens
    assert tokens == reference(PROMPTS)
    long = {f"r{i}" for i, p in enumerate(PROMPTS) if len(p) >= LONG}
    assert long == {"r0", "r2"}
    for rid in long:
        prompt = len(PROMPTS[int(rid[1:])])
        mine = [(w, n, c) for w, r, n, c in log if r == rid]
        prefill = [(w, n) for w, n, c in mine if c < prompt]
        decode = [(w, n, c) for w, n, c in mine if c >= prompt]
        # the prompt is computed once, on worker 0; the first decode step on worker 1
        # starts at the prompt's end: nothing is recomputed after the move
        assert {w for w, _ in prefill} == {0} and sum(n for _, n in prefill) == prompt
        assert decode and {w for w, _, _ in decode} <= {0, 1} and decode[-1][0] == 1
        assert next(c for w, _, c in decode if w == 1) >= prompt
        total = sum(n for _, n, _ in mine)
        assert total == prompt + GREEDY.max_tokens - 1, rid
    # short prompts never run on the prefill worker
    assert all(w == 1 for w, r, _, _ in log if r not in long)
    st = sched.disagg_stats()
    assert st.num_handoffs == st.num_resumed == 2 and st.num_fallbacks == st.num_timeouts == 0
    sw = sched.swap_stats()
    assert sw.swap_out_bytes == sw.swap_in_bytes == st.handoff_bytes == 100 * st.handoff_blocks
    assert sw.num_swap_failures == 0 and sched.num_recomputed_tokens == 0, sched.num_preemptions
    assert_all_free(sched, host)


def test_n_choices_move_as_one_group_and_equal_the_run_without() -> None:
    sampling = dataclasses.replace(GREEDY, n=3)
    host: dict = {}
    sched = make()
    add(sched, PROMPTS[:3], sampling)
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, host)]
    moved: list = []

    def on_plan(s, wid, so, _cur):
        for t in swaps_of(so).blocks_to_swap_out:
            moved.append((wid, sorted(t.seq_ids)))

    tokens = drive(sched, [f.execute for f in fakes], on_plan=on_plan).tokens
    assert tokens == reference(PROMPTS[:3], sampling)
    assert sorted(moved) == [(0, ["r0/0", "r0/1", "r0/2"]), (0, ["r2/0", "r2/1", "r2/2"])]
    assert sched.disagg_stats().num_resumed == 2
    assert_all_free(sched, host)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_preemption_on_both_workers_keeps_outputs(mode: str, overlap: bool) -> None:
    """Pools of 4 and 7 blocks: the decode worker preempts (the moved sequences too), the
    prefill worker too when overlapped, and the tokens equal the run without
    disaggregation."""
    host: dict = {}
    sched = make((4, 7), mode=mode, overlap=overlap)
    prompts = PROMPTS + [[60] * 9, [70] * 8, [80] * 11]
    add(sched, prompts)
    fakes = [FakeKVWorker(4, host), FakeKVWorker(7, host)]
    tokens = drive(sched, [f.execute for f in fakes]).tokens
    assert tokens == reference(prompts)
    assert sched.workers[1].num_preemptions > 0
    # Serially the prefill worker's admission never over-commits its pool here (each
    # handoff frees it first); overlapped, steps planned before a handoff grow into it.
    assert (sched.workers[0].num_preemptions > 0) is overlap
    assert sched.disagg_stats().num_handoffs == 5
    assert_all_free(sched, host)


def step(sched: Scheduler, fakes, wid: int):
    so = sched.schedule(wid).output
    out = sched.update(wid, so, fakes[wid].execute(so))
    sched.check_integrity()
    return so, out


def until_handed_off(sched: Scheduler, fakes) -> tuple:
    """Step worker 0 until a handoff is planned (its swap-out not answered yet): that
    step's output, not applied."""
    for _ in range(20):
        so = sched.schedule(0).output
        if swaps_of(so).blocks_to_swap_out:
            assert sched.disagg_stats().num_waiting > 0
            return so
        sched.update(0, so, fakes[0].execute(so))
    raise AssertionError("no handoff")


@pytest.mark.parametrize("stored", [False, True], ids=["swap-out-in-flight", "stored"])
def test_abort_while_waiting_for_remote_kv_frees_both_sides(stored: bool) -> None:
    host: dict = {}
    sched = make()
    sched.add_request(EngineRequest("long", [9] * 10, GREEDY))
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, host)]
    so = until_handed_off(sched, fakes)
    (seq,) = sched.requests["long"]
    assert seq.status is SequenceStatus.WAITING and seq.queued_on == 1
    assert sched.workers[0].kv.num_free_blocks == NUM_BLOCKS  # freed at the handoff
    total = sched.swap_stats().host_blocks_total
    assert sched.swap_stats().host_blocks_free == total - 3  # 10 prompt + 1 sampled: 3 blocks
    if stored:
        sched.update(0, so, fakes[0].execute(so))
        assert len(host) == 3
        sched.abort_request("long")
    else:
        sched.abort_request("long")  # the swap-out's answer frees its host blocks
        sched.update(0, so, fakes[0].execute(so))
    assert sched.disagg_stats().num_waiting == 0
    step(sched, fakes, 1)  # a worker of the store frees the host blocks
    assert sched.workers[0].kv.num_free_blocks == NUM_BLOCKS
    assert sched.workers[1].kv.num_free_blocks == NUM_BLOCKS
    assert sched.swap_stats().host_blocks_free == total
    assert host == {} and not sched.requests
    assert not any(sched.has_work(w) for w in sched.workers)


def test_prefill_worker_death_before_its_swap_out_answered_recomputes_on_the_decoder() -> None:
    host: dict = {}
    sched = make()
    prompt = [9] * 10
    sched.add_request(EngineRequest("r0", prompt, GREEDY))
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, host)]
    until_handed_off(sched, fakes)
    sched.mark_worker_dead(0)  # the step carrying the swap-out never answers
    assert sched.disagg_stats().num_waiting == 0
    (seq,) = sched.requests["r0"]
    assert seq.queued_on == 1 and seq.num_computed_tokens == 0  # recomputed there
    tokens = drive(sched, [fakes[0].execute, fakes[1].execute]).tokens
    first = reference([prompt])[("r0", 0)]
    assert tokens[("r0", 0)] == first[1:]  # the first token was streamed before the move
    step(sched, fakes, 1)
    assert sched.workers[1].kv.num_free_blocks == NUM_BLOCKS
    assert sched.swap_stats().host_blocks_free == sched.swap_stats().host_blocks_total
    assert host == {}


def test_decode_worker_death_while_waiting_moves_the_group_to_a_live_worker() -> None:
    host: dict = {}
    sched = make((NUM_BLOCKS, NUM_BLOCKS, NUM_BLOCKS))
    prompt = [9] * 10
    sched.add_request(EngineRequest("r0", prompt, GREEDY))
    fakes = [FakeKVWorker(NUM_BLOCKS, host) for _ in range(3)]
    so = until_handed_off(sched, fakes)
    (seq,) = sched.requests["r0"]
    target = seq.queued_on
    assert target in (1, 2)
    sched.update(0, so, fakes[0].execute(so))  # stored
    sched.mark_worker_dead(target)
    other = 3 - target
    assert seq.queued_on == other and sched.disagg_stats().num_waiting == 1
    tokens = drive(sched, [f.execute for f in fakes]).tokens
    assert tokens[("r0", 0)] == reference([prompt])[("r0", 0)][1:]  # the first came before
    assert sched.num_recomputed_tokens == 0 and sched.disagg_stats().num_resumed == 1
    assert sched.workers[other].kv.num_free_blocks == NUM_BLOCKS
    assert sched.swap_stats().host_blocks_free == sched.swap_stats().host_blocks_total
    assert host == {}


def test_a_wait_past_its_deadline_recomputes_and_frees_the_host_blocks() -> None:
    host: dict = {}
    sched = make(kv_wait_timeout_s=1e-9)
    add(sched)
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, host)]
    tokens = drive(sched, [f.execute for f in fakes]).tokens
    assert tokens == reference(PROMPTS)
    st = sched.disagg_stats()
    assert st.num_handoffs == st.num_timeouts == 2 and st.num_resumed == 0
    assert sched.swap_stats().num_swap_ins == 0
    assert_all_free(sched, host)


def test_a_prefill_worker_without_a_store_keeps_decoding() -> None:
    sched = make(swap={1: SwapSpec(64, 100, 1e9, 1e-3)})
    add(sched)
    fakes = [FakeKVWorker(NUM_BLOCKS, {}), FakeKVWorker(NUM_BLOCKS, {})]
    log: list = []
    tokens = drive(sched, [f.execute for f in fakes], on_plan=steps_by_worker(log)).tokens
    assert tokens == reference(PROMPTS)
    assert {w for w, r, _, _ in log if r in ("r0", "r2")} == {0}
    st = sched.disagg_stats()
    assert st.num_fallbacks == 2 and st.num_handoffs == 0


def test_pulls_from_the_prefill_workers_node_store() -> None:
    """Prefill worker on node "a", decode worker on node "b": the decoder pulls the
    group from "a" with no measured bandwidth (a handoff always pulls)."""
    hosts: dict = {"a": {}, "b": {}}
    specs = {
        0: SwapSpec(64, 100, 1e9, 1e-3, "a:1", store_id="a", remote_address="a-node:1"),
        1: SwapSpec(64, 100, 1e9, 1e-3, "b:1", store_id="b", remote_address="b-node:1"),
    }
    sched = make(swap=specs)
    add(sched)
    fakes = [
        FakeKVWorker(NUM_BLOCKS, hosts["a"]),
        FakeKVWorker(NUM_BLOCKS, hosts["b"], remotes={"a-node:1": hosts["a"]}),
    ]
    tokens = drive(sched, [f.execute for f in fakes]).tokens
    assert tokens == reference(PROMPTS)
    assert fakes[1].num_remote_pulls == 2
    sw = sched.swap_stats()
    assert sw.num_remote_swap_ins == 2
    assert sw.remote_swap_in_bytes == sched.disagg_stats().handoff_bytes
    assert hosts == {"a": {}, "b": {}}


def test_disagg_config_validation() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DisaggConfig(frozenset())
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        DisaggConfig(frozenset({0}), 0)
    with pytest.raises(ValueError, match="kv_wait_timeout_s"):
        DisaggConfig(frozenset({0}), 8, 0.0)
    with pytest.raises(ValueError, match="must decode"):
        DisaggManager(DisaggConfig(frozenset({0, 1})), [0, 1])
    with pytest.raises(ValueError, match="not workers"):
        DisaggManager(DisaggConfig(frozenset({5})), [0, 1])
    beam = SamplingParams(max_tokens=4, beam_width=2)
    sched = make()
    sched.add_request(EngineRequest("b", [1] * 10, beam))
    assert sched.requests["b"][0].queued_on == 1  # beam search is never disaggregated


def test_an_idle_decode_worker_is_woken_for_a_handoff() -> None:
    """Nothing else runs on the decode worker: the handoff's plan and its swap-out's
    answer wake it (the engine loop would stall otherwise)."""
    sampling = dataclasses.replace(GREEDY, n=3)
    host: dict = {}
    sched = make((NUM_BLOCKS, 7))
    prompts = [[40 + i for i in range(14)]]
    add(sched, prompts, sampling)
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(7, host)]
    tokens = drive(sched, [f.execute for f in fakes]).tokens
    assert tokens == reference(prompts, sampling)
    assert sched.disagg_stats().num_resumed == 1
    assert_all_free(sched, host)


def test_a_deadline_passing_during_the_swap_out_waits_for_its_answer() -> None:
    """The stored KV is given up only once the swap-out answered (its host blocks may
    still be written before that); then the sequence is recomputed on the decoder."""
    host: dict = {}
    sched = make(kv_wait_timeout_s=1e-9)
    sched.add_request(EngineRequest("r0", [9] * 10, GREEDY))
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, host)]
    so = until_handed_off(sched, fakes)
    (seq,) = sched.requests["r0"]
    early = sched.schedule(1).output  # past the deadline, swap-out in flight: kept
    assert not early.num_scheduled_tokens and sched._swaps.is_swapped(seq)
    assert sched.disagg_stats().num_timeouts == 0 and seq.num_computed_tokens == 10
    sched.update(1, early, fakes[1].execute(early))
    sched.update(0, so, fakes[0].execute(so))  # stored
    late = sched.schedule(1).output
    assert sched.disagg_stats().num_timeouts == 1 and not sched._swaps.is_swapped(seq)
    assert late.num_scheduled_tokens == {"r0/0": 6}  # recomputed from 0 (a chunk of 6)
    assert swaps_of(late).host_blocks_to_free  # the stored blocks are freed on the store
    sched.update(1, late, fakes[1].execute(late))
    sched.check_integrity()
    tokens = drive(sched, [f.execute for f in fakes]).tokens
    assert tokens[("r0", 0)] == reference([[9] * 10])[("r0", 0)][1:]
    assert_all_free(sched, host)
