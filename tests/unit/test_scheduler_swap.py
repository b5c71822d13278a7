"""Swap preemption in the scheduler, with a fake worker whose KV pool holds token ids.

The fake worker writes each computed token's id into its slot, moves block contents on
swap-out / swap-in / copy-on-write, and before sampling reads the whole sequence back
through the block table: any block restored wrongly fails the test there. It samples a
token that depends on every token it read, so outputs also reveal lost KV.

Overlapped scheduling (the ``overlapped`` tests): :func:`run_overlapped` runs the engine
loop that serves, overlapped (each worker's step t+1 planned and run before step t's
answer is applied), and the actor itself is driven over fake worker handles with a host
store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from helpers import ActorStreams, InProcessWorker, drive, swaps_of

from pagedserve.scheduler import swapping
from pagedserve.scheduler.actor import SchedulerActor
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.outputs import (
    RunnerOutput,
    SchedulerOutput,
    SwapPlan,
    SwapResult,
    SwapTransfer,
)
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import HostBlockPool, SwapSpec, SwapStats

BS = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30] * 13, [40, 41, 42, 43, 44, 45], [50, 51]]


class FakeKVWorker:
    """Mirrors a worker: per-slot token ids in a paged pool, swap moves them."""

    def __init__(
        self,
        num_blocks: int,
        host: dict[int, list],
        fail_swap: set[str] = frozenset(),
        store_dies_after: int | None = None,
        remotes: dict[str, dict[int, list]] | None = None,
    ):
        self.pool: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.host = host  # shared by the workers of a "node"
        self.remotes = remotes or {}  # other stores' host dicts, by their remote address
        self.num_remote_pulls = 0
        self.fail_swap = set(fail_swap)  # "out", "in" and/or "free"
        self.seqs: dict[str, dict] = {}
        self.store_dies_after = store_dies_after  # transfers before the store dies

    def _swap(self, so: SchedulerOutput) -> dict[str, SwapResult]:
        res = {}
        plan = swaps_of(so)
        n = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        if self.store_dies_after is not None and n:
            self.store_dies_after -= n
            if self.store_dies_after < 0:  # dead before this step: its blocks are gone
                self.host.clear()
                self.fail_swap |= {"out", "in", "free"}
                self.store_dies_after = None
        for t in plan.blocks_to_swap_out:
            if "out" in self.fail_swap:
                res[t.transfer_id] = SwapResult(False, error="store down")
                continue
            for b, h in zip(t.block_ids, t.host_block_ids, strict=True):
                self.host[h] = list(self.pool[b])
            res[t.transfer_id] = SwapResult(True, len(t.block_ids) * 100, 0.001)
        for t in plan.blocks_to_swap_in:
            source = self.host if t.source_address is None else self.remotes.get(t.source_address)
            if "in" in self.fail_swap or source is None:
                res[t.transfer_id] = SwapResult(False, error="checksum or source unreachable")
                for sid in t.seq_ids:
                    self.seqs.pop(sid, None)
                for h in t.host_blocks_to_free if source is not None else ():
                    source.pop(h, None)  # the worker frees them either way
                continue
            self.num_remote_pulls += t.source_address is not None
            for b, h in zip(t.block_ids, t.host_block_ids, strict=True):
                self.pool[b] = list(source[h])
            for h in t.host_blocks_to_free:
                source.pop(h, None)
            res[t.transfer_id] = SwapResult(True, len(set(t.host_block_ids)) * 100, 0.001)
        if plan.host_blocks_to_free and "free" in self.fail_swap:
            res[plan.free_transfer_id] = SwapResult(False, error="store down")
        elif plan.host_blocks_to_free:
            for h in plan.host_blocks_to_free:
                self.host.pop(h, None)
            res[plan.free_transfer_id] = SwapResult(True)
        return res

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for sid in so.finished_seq_ids:
            self.seqs.pop(sid, None)
        swaps = self._swap(so)
        failed = {
            s
            for t in swaps_of(so).blocks_to_swap_in
            if not swaps[t.transfer_id].ok
            for s in t.seq_ids
        }
        for new in so.new_seqs:
            if new.seq_id in failed:
                continue
            self.seqs[new.seq_id] = {"tokens": list(new.token_ids), "table": list(new.block_ids)}
        for c in so.cached_seqs:
            st = self.seqs[c.seq_id]
            st["table"][c.new_blocks_start :] = c.new_block_ids
            st["tokens"].extend(c.new_token_ids)
        for src, dst in so.blocks_to_copy:
            self.pool[dst] = list(self.pool[src])
        computed = {n.seq_id: n.num_computed_tokens for n in so.new_seqs}
        computed |= {c.seq_id: c.num_computed_tokens for c in so.cached_seqs}
        sampled = {}
        for sid, n in so.num_scheduled_tokens.items():
            if sid in failed:
                continue
            st = self.seqs[sid]
            start = computed[sid]
            for pos in range(start, start + n):
                self.pool[st["table"][pos // BS]][pos % BS] = st["tokens"][pos]
            end = start + n
            seen = [self.pool[st["table"][p // BS]][p % BS] for p in range(end)]
            assert seen == st["tokens"][:end], f"{sid}: KV lost or misplaced"
            if end == len(st["tokens"]):
                tok = sum((i + 1) * t for i, t in enumerate(seen)) % 97 + 3
                st["tokens"].append(tok)
                sampled[sid] = tok
        return RunnerOutput(so.step_id, sampled, 0.01, swap_results=swaps)


def make(num_blocks, mode="swap", host_blocks=64, workers=1, budget=6, **kw) -> Scheduler:
    spec = SwapSpec(host_blocks, 100, kw.get("bandwidth", 1e9), kw.get("prefill", 1e-3))
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_model_len=64,
            preemption_mode=mode,
            max_num_seqs=8,
            enable_prefix_caching=kw.get("prefix", True),
            host_prefix_cache=kw.get("host_prefix", False),
        ),
        [WorkerSpec(i, num_blocks, BS) for i in range(workers)],
        spec,
    )


def run(sched: Scheduler, fakes: list[FakeKVWorker]):
    """The serial engine loop over the fakes (``helpers.drive``); tokens per choice."""
    sched.config = dataclasses.replace(sched.config, async_scheduling=False)
    return drive(sched, [f.execute for f in fakes]).tokens


def reference(prompts, sampling=GREEDY):
    sched = make(256, mode="recompute")
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, sampling))
    return run(sched, [FakeKVWorker(256, {})])


def all_free(sched: Scheduler, host: dict) -> None:
    for ws in sched.workers.values():
        assert ws.kv.num_free_blocks == ws.spec.num_blocks
    sw = sched.swap_stats()
    assert sw.host_blocks_free == sw.host_blocks_total and sw.num_requests_swapped == 0
    assert host == {}


def test_forced_swap_keeps_every_token_and_frees_everything() -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    assert run(sched, [FakeKVWorker(10, host)]) == ref
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    assert sw.preemptions_by_mode == {"recompute": 0, "swap": sched.num_preemptions}
    # The worker's own count includes swap preemptions; none of them recomputed a token.
    (ws,) = sched.workers.values()
    assert ws.num_preemptions == sched.num_preemptions and ws.num_recomputed_tokens == 0
    assert sw.swap_out_bytes == sw.swap_in_bytes
    all_free(sched, host)


def test_n_choices_swap_as_one_group_and_share_again() -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    ref = reference(PROMPTS[:3], sampling)
    host: dict[int, list] = {}
    sched = make(12, budget=16)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add_request(EngineRequest(f"r{i}", p, sampling))
    groups: list[int] = []
    shared: list[int] = []

    def planned(sched: Scheduler, wid: int, so: SchedulerOutput, _inflight) -> None:
        groups.extend(len(t.seq_ids) for t in swaps_of(so).blocks_to_swap_out)

    def stepped(sched: Scheduler, wid: int, so: SchedulerOutput) -> None:
        kv = sched.workers[wid].kv
        for t in swaps_of(so).blocks_to_swap_in:
            tables = [kv.get_block_ids(s) for s in t.seq_ids if kv.has_seq(s)]
            shared.append(sum(map(len, tables)) - len({b for x in tables for b in x}))

    sched.config = dataclasses.replace(sched.config, async_scheduling=False)
    driven = drive(sched, [FakeKVWorker(12, host).execute], on_plan=planned, on_step=stepped)
    assert driven.tokens == ref
    assert max(groups) == 3  # all three choices left together
    assert max(shared) > 0  # and share blocks again after the swap-in
    all_free(sched, host)


def test_host_pool_full_falls_back_to_recompute() -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10, host_blocks=1)  # only a victim of one block fits
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    assert run(sched, [FakeKVWorker(10, host)]) == ref
    assert sched.swap_stats().preemptions_by_mode["recompute"] > 0
    all_free(sched, host)


@pytest.mark.parametrize("failing", ["out", "in"])
def test_failed_transfers_recompute(failing: str) -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    fake = FakeKVWorker(10, host, {failing})
    assert run(sched, [fake]) == ref
    sw = sched.swap_stats()
    assert sw.num_swap_failures > 0
    assert (sw.num_swap_ins if failing == "in" else sw.num_swap_outs) == 0
    all_free(sched, host)


def test_abort_while_swapped_frees_host_blocks() -> None:
    host: dict[int, list] = {}
    sched = make(6)
    fake = FakeKVWorker(6, host)
    sched.add_request(EngineRequest("a", [1] * 10, GREEDY))
    sched.add_request(EngineRequest("b", [2] * 10, GREEDY))
    sched.config = dataclasses.replace(sched.config, async_scheduling=False)
    # Until the first swap-out is applied: one group sits in the host store.
    drive(sched, [fake.execute], until=lambda: sched.swap_stats().num_swap_outs > 0)
    (victim,) = [sid for sid, g in sched._swaps.groups.items() if not g.pending]
    assert host  # its blocks are in the store
    sched.abort_request(victim.split("/")[0])
    assert sched.has_work(0)
    sched.check_integrity()
    run(sched, [fake])
    all_free(sched, host)


def test_a_pending_swap_out_is_not_stolen_and_migrates_once_done() -> None:
    host: dict[int, list] = {}
    sched = make(6, workers=2, prefix=False)  # no cached prefix keeps it on worker 0
    fakes = [FakeKVWorker(6, host), FakeKVWorker(6, host)]
    for rid, p in (("a", [1] * 10), ("b", [2] * 10)):
        seq = sched.add_request(EngineRequest(rid, p, GREEDY))[0]
        sched.workers[seq.queued_on].waiting.remove(seq)
        sched._enqueue(sched.workers[0], seq)
    so = None
    for _ in range(50):
        so = sched.schedule(0).output
        if swaps_of(so).blocks_to_swap_out:
            break
        sched.update(0, so, fakes[0].execute(so))
    assert so is not None and swaps_of(so).blocks_to_swap_out
    # Worker 1 is idle while worker 0's swap-out is in flight: it may not take the group.
    idle = sched.schedule(1).output
    assert not swaps_of(idle).blocks_to_swap_in and not idle.num_scheduled_tokens
    sched.update(0, so, fakes[0].execute(so))
    # Done: worker 1 steals the swapped sequence and swaps it in.
    took = sched.schedule(1).output
    assert swaps_of(took).blocks_to_swap_in
    sched.update(1, took, fakes[1].execute(took))
    run(sched, fakes)
    assert sched.swap_stats().num_swap_ins >= 1
    all_free(sched, host)


def test_auto_mode_compares_swap_and_recompute_costs() -> None:
    for bandwidth, mode in ((1e12, "swap"), (1.0, "recompute")):
        sched = make(10, mode="auto", bandwidth=bandwidth, prefill=1e-3)
        for i, p in enumerate(PROMPTS):
            sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
        host: dict[int, list] = {}
        run(sched, [FakeKVWorker(10, host)])
        by_mode = sched.swap_stats().preemptions_by_mode
        assert by_mode[mode] == sched.num_preemptions > 0


def test_validation() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="swapp")
    with pytest.raises(ValueError, match="bandwidth"):
        SwapSpec(4, 100, 0.0, 1e-3)
    with pytest.raises(ValueError, match="block_bytes"):
        SwapSpec(4, 0, 1.0, 1e-3)
    pool = HostBlockPool(2)
    assert pool.allocate(3) is None and pool.allocate(2) == [0, 1]
    pool.free([1])
    with pytest.raises(IntegrityError):
        pool.free([1])


# ---------------------------------------------------------------------- overlapped scheduling
def run_overlapped(sched: Scheduler, fakes: list, on_plan=None):
    """The overlapped engine loop over the fakes (``helpers.drive``): step t+1 is planned,
    and run by the fake (steps run in order), before step t's answer is applied, unless t
    swaps a group in (``Scheduler.can_plan_past``).

    ``on_plan(sched, wid, so, inflight_so)`` runs after each step is sent
    (``inflight_so``: the step still in flight, or None). ``fakes``: FakeKVWorkers or
    worker handles. Returns the tokens and how many steps were planned with another in
    flight."""
    assert sched.config.async_scheduling
    handles = [f.execute if isinstance(f, FakeKVWorker) else f for f in fakes]
    seen = drive(sched, handles, on_plan=on_plan)
    return seen.tokens, seen.ahead


def _victims_in_flight(counter: list[int]):
    """on_plan hook: count swap-outs of sequences that have a token in the step in flight."""

    def hook(sched, wid, so, cur):
        if cur is None:
            return
        for t in swaps_of(so).blocks_to_swap_out:
            counter[0] += sum(1 for sid in t.seq_ids if sid in cur.num_scheduled_tokens)

    return hook


def count_late_answers(sched: Scheduler) -> list[str]:
    """Record the sequences whose in-flight step's answer was applied after their
    swap-out (``_late_answer`` kept their tokens)."""
    applied: list[str] = []
    orig = sched._late_answer

    def wrapped(ws, seq, step_id, num_new, runner_out):
        before = seq.num_computed_tokens
        out = orig(ws, seq, step_id, num_new, runner_out)
        if seq.num_computed_tokens > before:
            applied.append(seq.seq_id)
        return out

    sched._late_answer = wrapped  # type: ignore[method-assign]
    return applied


def test_overlapped_forced_swap_keeps_every_token_and_frees_everything() -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    assert sched.config.async_scheduling
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    victims = [0]
    late = count_late_answers(sched)
    tokens, ahead = run_overlapped(sched, [FakeKVWorker(10, host)], _victims_in_flight(victims))
    assert tokens == ref
    # Victims' tokens in flight were swapped out with them and kept: the fake reads every
    # restored slot back, so a slot missing from the host copy would have failed there.
    assert late
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    # Every transfer is resolved by its own step's answer (none reported "no result").
    assert sw.num_swap_failures == 0
    assert sw.preemptions_by_mode == {"recompute": 0, "swap": sched.num_preemptions}
    assert victims[0] > 0  # victims whose token from the step in flight was dropped
    assert ahead > 0
    all_free(sched, host)


def test_overlapped_victim_with_its_prefill_in_flight_keeps_it() -> None:
    """Step 0 prefills A (8 tokens) and B (13); step 1, planned while step 0 runs, needs a
    block for A's decode and swaps B out: B has no computed token yet, its whole prefill
    is in flight. The swap-out (after step 0 on the worker) carries B's 4 blocks, step 0's
    answer is applied to the waiting B (its first token streamed) and B resumes with its
    prompt computed: nothing is recomputed."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20 + i for i in range(13)]]
    ref = reference(prompts)
    host: dict[int, list] = {}
    sched = make(6, budget=32)
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    late = count_late_answers(sched)
    outs: list[tuple[int, list[str], int]] = []

    def record(s, wid, so, cur):
        for t in swaps_of(so).blocks_to_swap_out:
            outs.append((so.step_id, t.seq_ids, len(t.block_ids)))

    tokens, _ = run_overlapped(sched, [FakeKVWorker(6, host)], record)
    assert tokens == ref
    assert outs[0] == (1, ["r1/0"], 4)
    assert late[0] == "r1/0"
    sw = sched.swap_stats()
    assert sw.preemptions_by_mode == {"recompute": 0, "swap": len(outs)}
    assert sched.num_recomputed_tokens == 0
    all_free(sched, host)


def test_overlapped_n_choices_swap_as_one_group() -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    ref = reference(PROMPTS[:3], sampling)
    host: dict[int, list] = {}
    sched = make(12, budget=16)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add_request(EngineRequest(f"r{i}", p, sampling))
    groups: list[int] = []

    def record(s, wid, so, cur):
        groups.extend(len(t.seq_ids) for t in swaps_of(so).blocks_to_swap_out)

    tokens, _ = run_overlapped(sched, [FakeKVWorker(12, host)], record)
    assert tokens == ref
    assert max(groups) == 3
    assert sched.swap_stats().num_swap_failures == 0
    all_free(sched, host)


@pytest.mark.parametrize("failing", ["out", "in"])
def test_overlapped_failed_transfers_recompute(failing: str) -> None:
    """A failed swap-in drops its sequences on the worker: the step after it is planned
    only once its answer is in (else the fake fails on a sequence it no longer holds)."""
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    tokens, _ = run_overlapped(sched, [FakeKVWorker(10, host, {failing})])
    assert tokens == ref
    sw = sched.swap_stats()
    assert sw.num_swap_failures > 0
    assert (sw.num_swap_ins if failing == "in" else sw.num_swap_outs) == 0
    all_free(sched, host)


def test_overlapped_store_dies_mid_run_recomputes() -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    fake = FakeKVWorker(10, host, store_dies_after=3)
    tokens, _ = run_overlapped(sched, [fake])
    assert tokens == ref
    sw = sched.swap_stats()
    assert fake.store_dies_after is None  # it died
    assert sw.num_swap_outs > 0 and sw.num_swap_failures > 0
    all_free(sched, host)


def test_overlapped_worker_death_with_two_steps_in_flight() -> None:
    """Worker 0 dies right after planning a step that swaps out while the step before it
    is also in flight: both steps' transfers fail, their sequences are recomputed on
    worker 1, and every token still equals the reference."""
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10, workers=2, prefix=False)
    for i, p in enumerate(PROMPTS):  # everything starts on worker 0
        seq = sched.add_request(EngineRequest(f"r{i}", p, GREEDY))[0]
        sched.workers[seq.queued_on].waiting.remove(seq)
        sched._enqueue(sched.workers[0], seq)
    died: list[int] = []

    handles = [InProcessWorker(FakeKVWorker(10, host).execute) for _ in range(2)]

    def kill(s, wid, so, cur):
        if wid == 0 and cur is not None and swaps_of(so).blocks_to_swap_out and not died:
            died.append(so.step_id)
            handles[0].dead = True  # both steps in flight fail with WorkerDied

    real_has_work = sched.has_work
    # Worker 1 idles (it would steal) until worker 0 is dead.
    sched.has_work = lambda w: real_has_work(w) and (w == 0 or not sched.workers[0].alive)  # type: ignore[method-assign]
    tokens, _ = run_overlapped(sched, handles, kill)
    assert died and not sched.workers[0].alive
    assert tokens == ref
    sw = sched.swap_stats()
    assert sw.num_swap_failures > 0  # the swap-out of the dead worker's last step
    all_free(sched, host)


def test_overlapped_step_error_fails_only_its_own_transfers() -> None:
    """Step t raises while t+1, which swaps a group out, is in flight: t's requests are
    aborted, t+1's swap-out is still resolved by t+1's answer (no failure)."""
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, GREEDY))
    handle = FailsLater(FakeKVWorker(10, host))
    failed: list[SchedulerOutput] = []
    after: list[SwapStats] = []

    def on_plan(s, wid, so, cur):
        if cur is not None and swaps_of(so).blocks_to_swap_out and not failed:
            failed.append(cur)
            handle.fail.add(cur.step_id)

    def on_step(s, wid, so):
        if failed and so.step_id == failed[0].step_id + 1:
            after.append(s.swap_stats())

    seen = drive(sched, [handle], on_plan=on_plan, on_step=on_step)
    assert failed, "no swap-out was planned with a step in flight"
    aborted = {r for r, f in seen.finish.items() if f.name == "ABORT"}
    assert aborted and aborted <= {sid.split("/")[0] for sid in failed[0].num_scheduled_tokens}
    assert after[0].num_swap_outs == 1 and after[0].num_swap_failures == 0
    for i in range(len(PROMPTS)):
        key = (f"r{i}", 0)
        toks = seen.tokens.get(key, [])
        if f"r{i}" in aborted:
            assert toks == ref[key][: len(toks)]
        else:
            assert toks == ref[key]
    all_free(sched, host)


class FailsLater:
    """A worker handle over a fake: each step runs when sent; the answer of a step in
    ``fail`` raises when awaited (the step failed on the worker)."""

    def __init__(self, fake: FakeKVWorker) -> None:
        self.fake = fake
        self.fail: set[int] = set()

    def execute(self, so: SchedulerOutput):
        return self._answer(so.step_id, self.fake.execute(so))

    async def _answer(self, step_id: int, out: RunnerOutput) -> RunnerOutput:
        await asyncio.sleep(0)
        if step_id in self.fail:
            raise RuntimeError("the step failed on the worker")
        return out


class FlakyKVWorker(FakeKVWorker):
    """A fake whose swap transfers fail at random (seeded): each step, with probability
    ``p``, every transfer of that step fails as if the store were briefly unreachable."""

    def __init__(self, num_blocks: int, host: dict[int, list], rng: random.Random, p: float):
        super().__init__(num_blocks, host)
        self.rng = rng
        self.p = p

    def _swap(self, so: SchedulerOutput) -> dict[str, SwapResult]:
        self.fail_swap = {"out", "in"} if self.rng.random() < self.p else set()
        return super()._swap(so)


def test_overlapped_random_swap_stress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, small pools, forced swap, n in 1..3, random aborts while steps are in
    flight, random transfer failures (8 seeds): the requests not aborted equal the
    reference, the aborted ones a prefix of it, integrity holds at every step and
    everything is freed."""
    monkeypatch.setattr(swapping, "_BACKOFF_S", 0.0)  # keep swapping after a failure
    totals = {"outs": 0, "ins": 0, "failures": 0, "aborted": 0}
    for seed in range(8):
        sw, aborted = _random_swap_run(seed)
        totals["outs"] += sw.num_swap_outs
        totals["ins"] += sw.num_swap_ins
        totals["failures"] += sw.num_swap_failures
        totals["aborted"] += aborted
    assert all(v > 0 for v in totals.values()), totals


def _random_swap_run(seed: int) -> tuple[SwapStats, int]:
    rng = random.Random(seed)
    prompts = [[rng.randint(3, 90) for _ in range(rng.randint(1, 14))] for _ in range(10)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True, n=rng.randint(1, 3)
        )
        for _ in prompts
    ]
    ref_sched = make(256, mode="recompute")
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        ref_sched.add_request(EngineRequest(f"r{i}", p, sp))
    ref = run(ref_sched, [FakeKVWorker(256, {})])
    host: dict[int, list] = {}
    sched = make(12, workers=2, budget=rng.choice([4, 8, 16]))
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        sched.add_request(EngineRequest(f"r{i}", p, sp))
    aborted: set[str] = set()

    def maybe_abort(s, wid, so, cur):
        if cur is not None and rng.random() < 0.03:
            live = sorted(s.requests)
            if live:
                rid = rng.choice(live)
                s.abort_request(rid)
                aborted.add(rid)

    fakes = [FlakyKVWorker(12, host, rng, 0.1) for _ in range(2)]
    tokens, ahead = run_overlapped(sched, fakes, maybe_abort)
    assert ahead > 0
    for key, want in ref.items():
        got = tokens.get(key, [])
        if key[0] in aborted:
            assert got == want[: len(got)], key
        else:
            assert got == want, key
    assert sched.num_preemptions > 0
    all_free(sched, host)
    return sched.swap_stats(), len(aborted)


def test_can_plan_past_only_blocks_after_a_swap_in() -> None:
    sched = make(10)
    assert sched.can_plan_past(SchedulerOutput(step_id=0))
    out = SwapTransfer("out-1", [1], [0], ["a/0"])
    assert sched.can_plan_past(
        SchedulerOutput(step_id=1, swap_plan=SwapPlan(blocks_to_swap_out=[out]))
    )
    assert sched.can_plan_past(
        SchedulerOutput(step_id=2, swap_plan=SwapPlan(host_blocks_to_free=[3]))
    )
    into = SwapTransfer("in-2", [1], [0], ["a/0"], [0])
    assert not sched.can_plan_past(
        SchedulerOutput(step_id=3, swap_plan=SwapPlan(blocks_to_swap_in=[into]))
    )


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class SwapHandle:
    """A worker actor handle over a :class:`FakeKVWorker`; records how the actor sends steps
    (a step is sent at ``execute_model.remote`` and runs, in order, when awaited)."""

    def __init__(self, fake: FakeKVWorker) -> None:
        self.fake = fake
        self.sent = 0
        self.answered = 0
        self.max_in_flight = 0
        self.after_swap_in: list[int] = []  # steps sent while a swap-in step was unanswered
        self._swap_in_step: int | None = None
        self.execute_model = _Remote(self._send)
        self.ping = _Remote(self._ok)
        self.reset = _Remote(self._ok)

    async def _ok(self):
        return True

    def _send(self, so: SchedulerOutput):
        if self._swap_in_step is not None:
            self.after_swap_in.append(so.step_id)
        self.sent += 1
        self.max_in_flight = max(self.max_in_flight, self.sent - self.answered)
        if swaps_of(so).blocks_to_swap_in:
            self._swap_in_step = so.step_id
        return self._run(so)

    async def _run(self, so: SchedulerOutput) -> RunnerOutput:
        await asyncio.sleep(0.001)
        out = self.fake.execute(so)
        self.answered += 1
        if self._swap_in_step == so.step_id:
            self._swap_in_step = None
        return out


def test_actor_with_a_host_store_runs_the_overlapped_loop() -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    handle = SwapHandle(FakeKVWorker(10, host))
    spec = SwapSpec(64, 100, 1e9, 1e-3)
    config = SchedulerConfig(
        max_num_batched_tokens=6,
        max_model_len=64,
        preemption_mode="swap",
        max_num_seqs=8,
        host_prefix_cache=False,
    )
    actor = SchedulerActor(
        config, [handle], [WorkerSpec(0, 10, BS)], 0.05, swap=spec, step_channel=False
    )
    assert actor._engine.overlapped

    streams = ActorStreams(actor)

    async def one(i: int, prompt: list[int]) -> list[int]:
        toks: list[int] = []
        async for batch in streams.generate(f"r{i}", prompt, GREEDY):
            toks.extend(t for o in batch for t in o.new_token_ids)
        return toks

    async def scenario():
        await actor.ready()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        for _ in range(200):  # the last answer's host frees go out with one more step
            if not actor._scheduler.has_work(0) and not actor._scheduler._swaps._inflight.get(0):
                break
            await asyncio.sleep(0.01)
        await actor.check_integrity()
        sched = actor._scheduler
        await actor.shutdown()
        return results, sched

    results, sched = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    for i, toks in enumerate(results):
        assert toks == ref[(f"r{i}", 0)], i
    assert handle.max_in_flight == 2  # step t+1 was sent while t ran
    assert handle.after_swap_in == []  # never while a swap-in step was unanswered
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    assert sw.num_swap_failures == 0
    all_free(sched, host)
