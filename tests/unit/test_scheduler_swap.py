"""Swap preemption in the scheduler, with a fake worker whose KV pool holds token ids.

The fake worker writes each computed token's id into its slot, moves block contents on
swap-out / swap-in / copy-on-write, and before sampling reads the whole sequence back
through the block table: any block restored wrongly fails the test there. It samples a
token that depends on every token it read, so outputs also reveal lost KV.
"""

from __future__ import annotations

import pytest

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput, SwapResult
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import HostBlockPool, SwapSpec

BS = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30] * 13, [40, 41, 42, 43, 44, 45], [50, 51]]


class FakeKVWorker:
    """Mirrors a worker: per-slot token ids in a paged pool, swap moves them."""

    def __init__(self, num_blocks: int, host: dict[int, list], fail_swap: set[str] = frozenset()):
        self.pool: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.host = host  # shared by the workers of a "node"
        self.fail_swap = set(fail_swap)  # "out" and/or "in"
        self.seqs: dict[str, dict] = {}

    def _swap(self, so: SchedulerOutput) -> dict[str, SwapResult]:
        res = {}
        for t in so.blocks_to_swap_out:
            if "out" in self.fail_swap:
                res[t.transfer_id] = SwapResult(False, error="store down")
                continue
            for b, h in zip(t.block_ids, t.host_block_ids, strict=True):
                self.host[h] = list(self.pool[b])
            res[t.transfer_id] = SwapResult(True, len(t.block_ids) * 100, 0.001)
        for t in so.blocks_to_swap_in:
            if "in" in self.fail_swap:
                res[t.transfer_id] = SwapResult(False, error="checksum")
                for sid in t.seq_ids:
                    self.seqs.pop(sid, None)
                for h in t.host_blocks_to_free:  # the worker frees them either way
                    self.host.pop(h, None)
                continue
            for b, h in zip(t.block_ids, t.host_block_ids, strict=True):
                self.pool[b] = list(self.host[h])
            for h in t.host_blocks_to_free:
                self.host.pop(h, None)
            res[t.transfer_id] = SwapResult(True, len(set(t.host_block_ids)) * 100, 0.001)
        if so.host_blocks_to_free:
            for h in so.host_blocks_to_free:
                self.host.pop(h, None)
            res[so.free_transfer_id] = SwapResult(True)
        return res

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for sid in so.finished_seq_ids:
            self.seqs.pop(sid, None)
        swaps = self._swap(so)
        failed = {s for t in so.blocks_to_swap_in if not swaps[t.transfer_id].ok for s in t.seq_ids}
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
        ),
        [WorkerSpec(i, num_blocks, BS) for i in range(workers)],
        spec,
    )


def run(sched: Scheduler, fakes: list[FakeKVWorker], max_rounds: int = 2000):
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_rounds):
        live = [i for i in range(len(fakes)) if sched.has_work(i)]
        if not live:
            break
        for wid in live:
            so = sched.schedule(wid)
            if so.is_empty:
                continue
            for o in sched.update(wid, so, fakes[wid].execute(so)):
                tokens.setdefault((o.request_id, o.choice_index), []).extend(o.new_token_ids)
            sched.check_integrity()
    assert not any(sched.has_work(i) for i in range(len(fakes))), "stalled"
    return tokens


def reference(prompts, sampling=GREEDY):
    sched = make(256, mode="recompute")
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, sampling)
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
        sched.add_request(f"r{i}", p, GREEDY)
    assert run(sched, [FakeKVWorker(10, host)]) == ref
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    assert sw.preemptions_by_mode == {"recompute": 0, "swap": sched.num_preemptions}
    assert sw.swap_out_bytes == sw.swap_in_bytes
    all_free(sched, host)


def test_n_choices_swap_as_one_group_and_share_again() -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    ref = reference(PROMPTS[:3], sampling)
    host: dict[int, list] = {}
    sched = make(12, budget=16)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add_request(f"r{i}", p, sampling)
    groups: list[int] = []
    fake = FakeKVWorker(12, host)

    def step(wid: int = 0):
        so = sched.schedule(wid)
        for t in so.blocks_to_swap_out:
            groups.append(len(t.seq_ids))
        return so

    tokens: dict[tuple[str, int], list[int]] = {}
    shared = []
    for _ in range(2000):
        if not sched.has_work(0):
            break
        so = step()
        if so.is_empty:
            continue
        for o in sched.update(0, so, fake.execute(so)):
            tokens.setdefault((o.request_id, o.choice_index), []).extend(o.new_token_ids)
        for t in so.blocks_to_swap_in:
            kv = sched.workers[0].kv
            tables = [kv.get_block_ids(s) for s in t.seq_ids if kv.has_seq(s)]
            shared.append(sum(map(len, tables)) - len({b for x in tables for b in x}))
        sched.check_integrity()
    assert tokens == ref
    assert max(groups) == 3  # all three choices left together
    assert max(shared) > 0  # and share blocks again after the swap-in
    all_free(sched, host)


def test_host_pool_full_falls_back_to_recompute() -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10, host_blocks=1)  # only a victim of one block fits
    for i, p in enumerate(PROMPTS):
        sched.add_request(f"r{i}", p, GREEDY)
    assert run(sched, [FakeKVWorker(10, host)]) == ref
    assert sched.swap_stats().preemptions_by_mode["recompute"] > 0
    all_free(sched, host)


@pytest.mark.parametrize("failing", ["out", "in"])
def test_failed_transfers_recompute(failing: str) -> None:
    ref = reference(PROMPTS)
    host: dict[int, list] = {}
    sched = make(10)
    for i, p in enumerate(PROMPTS):
        sched.add_request(f"r{i}", p, GREEDY)
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
    sched.add_request("a", [1] * 10, GREEDY)
    sched.add_request("b", [2] * 10, GREEDY)
    for _ in range(50):
        so = sched.schedule(0)
        sched.update(0, so, fake.execute(so))
        if sched.swap_stats().num_swap_outs:
            break
    (victim,) = [sid for sid, g in sched._groups.items() if not g.pending]
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
        seq = sched.add_request(rid, p, GREEDY)[0]
        sched.workers[seq.queued_on].waiting.remove(seq)
        sched._enqueue(sched.workers[0], seq)
    so = None
    for _ in range(50):
        so = sched.schedule(0)
        if so.blocks_to_swap_out:
            break
        sched.update(0, so, fakes[0].execute(so))
    assert so is not None and so.blocks_to_swap_out
    # Worker 1 is idle while worker 0's swap-out is in flight: it may not take the group.
    idle = sched.schedule(1)
    assert not idle.blocks_to_swap_in and not idle.num_scheduled_tokens
    sched.update(0, so, fakes[0].execute(so))
    # Done: worker 1 steals the swapped sequence and swaps it in.
    took = sched.schedule(1)
    assert took.blocks_to_swap_in
    sched.update(1, took, fakes[1].execute(took))
    run(sched, fakes)
    assert sched.swap_stats().num_swap_ins >= 1
    all_free(sched, host)


def test_auto_mode_compares_swap_and_recompute_costs() -> None:
    for bandwidth, mode in ((1e12, "swap"), (1.0, "recompute")):
        sched = make(10, mode="auto", bandwidth=bandwidth, prefill=1e-3)
        for i, p in enumerate(PROMPTS):
            sched.add_request(f"r{i}", p, GREEDY)
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
