"""Swap state per host block store and per worker (one store per node): each store's
capacity, a worker without a store, a failure that backs off only its worker, and a
swapped group that cannot resume on a worker of another store.

Each fake store is its own ``host`` dict: a worker that read or wrote another store's
host blocks would fail in :class:`FakeKVWorker` (a missing key) or leave blocks behind.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import swaps_of
from test_scheduler_swap import GREEDY, PROMPTS, FakeKVWorker, reference

from pagedserve.scheduler import swapping
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import SwapSpec, WorkerSwapStats, swap_specs

NUM_BLOCKS = 10


def spec(host_blocks: int, store: str, pull: dict[str, float] | None = None) -> SwapSpec:
    """A store of ``host_blocks`` blocks of 100 bytes; with ``pull`` (other store ->
    bytes/s) it is reachable from other nodes at ``<store>-node:1`` and its worker's pulls
    are measured."""
    if pull is None:
        return SwapSpec(host_blocks, 100, 1e9, 1e-3, f"{store}:1", store_id=store)
    return SwapSpec(
        host_blocks,
        100,
        1e9,
        1e-3,
        f"{store}:1",
        store_id=store,
        remote_address=f"{store}-node:1",
        pull_bandwidth_bytes_per_s=pull,
    )


def make(swap: dict[int, SwapSpec], workers: int = 2, mode: str = "swap") -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=6,
            max_model_len=64,
            preemption_mode=mode,
            max_num_seqs=8,
            enable_prefix_caching=False,
            async_scheduling=False,
        ),
        [WorkerSpec(i, NUM_BLOCKS, 4) for i in range(workers)],
        swap,
    )


def queue_on(sched: Scheduler, worker_id: int, prefix: str, prompts=PROMPTS) -> None:
    """Add one request per prompt, queued on ``worker_id`` (not where routing put it)."""
    for i, p in enumerate(prompts):
        seq = sched.add_request(EngineRequest(f"{prefix}{i}", p, GREEDY))[0]
        sched.workers[seq.queued_on].waiting.remove(seq)
        sched._enqueue(sched.workers[worker_id], seq)


def transfers_by_worker(seen: dict[int, list[SchedulerOutput]]):
    """on_plan hook recording every step that moves KV, per worker."""

    def hook(sched, wid, so, _cur):
        plan = swaps_of(so)
        if plan.blocks_to_swap_out or plan.blocks_to_swap_in:
            seen.setdefault(wid, []).append(so)

    return hook


def run(sched: Scheduler, fakes: list[FakeKVWorker], on_plan=None):
    from helpers import drive

    return drive(sched, [f.execute for f in fakes], on_plan=on_plan).tokens


def expected(prefixes: tuple[str, ...]) -> dict[tuple[str, int], list[int]]:
    ref = reference(PROMPTS)
    return {(f"{p}{i}", 0): ref[(f"r{i}", 0)] for p in prefixes for i in range(len(PROMPTS))}


def test_each_store_has_its_own_capacity() -> None:
    """Store "a" holds 64 blocks, store "b" one: worker 1 falls back to recompute when
    "b" is full while worker 0 keeps swapping; the stats sum both stores."""
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a"), 1: spec(1, "b")})
    assert sched.swap_stats().host_blocks_total == 65
    queue_on(sched, 0, "x")
    queue_on(sched, 1, "y")
    moves: dict[int, list[SchedulerOutput]] = {}
    fakes = [FakeKVWorker(NUM_BLOCKS, hosts["a"]), FakeKVWorker(NUM_BLOCKS, hosts["b"])]
    assert run(sched, fakes, transfers_by_worker(moves)) == expected(("x", "y"))
    for so in moves.get(1, []):
        for t in swaps_of(so).blocks_to_swap_out:
            assert t.host_block_ids == [0]  # store "b" has one block: id 0
    assert moves[0]  # worker 0 swapped
    w0 = sched.stats().workers[0]  # every preemption on "a" was a swap
    assert sched.workers[0].num_preemptions == w0.swap.num_swap_outs > 0
    assert sched.workers[1].num_recomputed_tokens > 0  # "b" was full
    sw = sched.swap_stats()
    assert sw.host_blocks_free == sw.host_blocks_total == 65 and sw.num_swap_failures == 0
    assert hosts == {"a": {}, "b": {}}


def test_a_worker_without_a_spec_preempts_by_recompute() -> None:
    """Worker 1's probe failed at start-up (no spec): it never swaps; worker 0 does."""
    host: dict[int, list] = {}
    sched = make({0: spec(64, "n")})
    assert sched.swap_spec(1) is None and sched.swap_spec(0) == spec(64, "n")
    queue_on(sched, 0, "x")
    queue_on(sched, 1, "y")
    moves: dict[int, list[SchedulerOutput]] = {}
    fakes = [FakeKVWorker(NUM_BLOCKS, host), FakeKVWorker(NUM_BLOCKS, {})]
    assert run(sched, fakes, transfers_by_worker(moves)) == expected(("x", "y"))
    assert 1 not in moves and moves[0]
    assert sched.workers[1].num_recomputed_tokens > 0
    assert sched.workers[0].num_preemptions == sched.stats().workers[0].swap.num_swap_outs
    assert sched.swap_stats().preemption_mode == "swap" and host == {}
    w0, w1 = sched.stats().workers
    assert w1.swap == WorkerSwapStats()  # can_swap False, nothing moved
    assert w0.swap.can_swap and w0.swap.num_swap_outs == sched.swap_stats().num_swap_outs > 0
    assert w0.swap.num_swap_ins == w0.swap.num_swap_outs


def test_a_failed_transfer_backs_off_only_its_worker(monkeypatch) -> None:
    """Worker 1's store refuses swap-outs; once it failed (and backs off for good here),
    worker 0, on another store, still swaps every victim."""
    monkeypatch.setattr(swapping, "_BACKOFF_S", 1e6)
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a"), 1: spec(64, "b")})
    fakes = [FakeKVWorker(NUM_BLOCKS, hosts["a"]), FakeKVWorker(NUM_BLOCKS, hosts["b"], {"out"})]
    queue_on(sched, 1, "y")
    for _ in range(100):  # worker 1 alone until its first failure
        so = sched.schedule(1).output
        sched.update(1, so, fakes[1].execute(so))
        if sched.swap_stats().num_swap_failures:
            break
    assert sched.swap_stats().num_swap_failures == 1
    queue_on(sched, 0, "x")
    moves: dict[int, list[SchedulerOutput]] = {}
    run(sched, fakes, transfers_by_worker(moves))
    assert moves[0] and 1 not in moves  # 1 backs off; 0 does not
    assert sched.workers[0].num_preemptions == sched.stats().workers[0].swap.num_swap_outs
    assert sched.swap_stats().num_swap_failures == 1
    w0, w1 = sched.stats().workers
    assert (w0.swap.num_swap_failures, w1.swap.num_swap_failures) == (0, 1)
    assert w0.swap.num_swap_outs > 0 and w1.swap.num_swap_outs == 0
    assert hosts == {"a": {}, "b": {}}


def test_a_group_is_not_stolen_by_a_worker_of_another_store() -> None:
    """Worker 1 (store "b") is idle while worker 0's swapped group waits: it steals
    nothing of it; with store "a" shared it would (see the pinned test in
    test_scheduler_swap)."""
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a"), 1: spec(64, "b")})
    fakes = [FakeKVWorker(6, hosts["a"]), FakeKVWorker(6, hosts["b"])]
    sched.workers[0].kv = type(sched.workers[0].kv)(6, 4, False, None)
    sched.workers[0].spec = dataclasses.replace(sched.workers[0].spec, num_blocks=6)
    queue_on(sched, 0, "x", [[1] * 10, [2] * 10])
    for _ in range(100):
        so = sched.schedule(0).output
        sched.update(0, so, fakes[0].execute(so))
        if any(not g.pending for g in sched._swaps.groups.values()):
            break
    (swapped,) = {g.transfer_id for g in sched._swaps.groups.values()}
    idle = sched.schedule(1).output
    assert not swaps_of(idle).blocks_to_swap_in
    assert all(s.queued_on == 0 for s in sched.sequences.values() if s.worker_id is None)
    sched.update(1, idle, fakes[1].execute(idle))
    assert swapped in {g.transfer_id for g in sched._swaps.groups.values()}


def test_a_group_moved_to_another_store_is_recomputed() -> None:
    """Worker 0 dies while one of its groups sits in store "a": routing moves it to
    worker 1 (store "b"), which recomputes it (store "a" is not reachable from other
    nodes and the pair is unmeasured), the tokens unchanged and store "a"'s blocks
    freed."""
    prompts = [[1] * 10, [2] * 10]
    ref = reference(prompts)
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a"), 1: spec(64, "b")})
    fakes = [FakeKVWorker(6, hosts["a"]), FakeKVWorker(NUM_BLOCKS, hosts["b"])]
    sched.workers[0].kv = type(sched.workers[0].kv)(6, 4, False, None)
    sched.workers[0].spec = dataclasses.replace(sched.workers[0].spec, num_blocks=6)
    queue_on(sched, 0, "r", prompts)
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(100):
        so = sched.schedule(0).output
        for o in sched.update(0, so, fakes[0].execute(so)).outputs:
            tokens.setdefault((o.request_id, o.choice_index), []).extend(o.new_token_ids)
        if any(not g.pending for g in sched._swaps.groups.values()):
            break
    assert sched._swaps.groups and hosts["a"]
    sched.mark_worker_dead(0)
    moves: dict[int, list[SchedulerOutput]] = {}
    more = run(sched, fakes, transfers_by_worker(moves))
    for key, toks in more.items():
        tokens.setdefault(key, []).extend(toks)
    assert tokens == ref
    for so in moves.get(1, []):
        assert not swaps_of(so).blocks_to_swap_in  # nothing of store "a" came to worker 1
    assert not sched._swaps.groups
    sw = sched.swap_stats()
    assert sw.num_swap_failures == 0
    # Store "a"'s blocks are freed in the metadata once a worker of "a" steps again; with
    # worker 0 dead they wait in its free queue.
    assert sched._swaps.has_frees(0) and not sched._swaps.has_frees(1)


def test_swap_specs_validation() -> None:
    one = spec(4, "n")
    assert swap_specs(one, [0, 1]) == {0: one, 1: one}
    assert swap_specs(None, [0]) == {}
    assert swap_specs({1: one}, [0, 1]) == {1: one}
    with pytest.raises(ValueError, match="unknown workers"):
        swap_specs({2: one}, [0, 1])
    with pytest.raises(ValueError, match="store 'n'"):
        swap_specs({0: one, 1: spec(5, "n")}, [0, 1])
    with pytest.raises(ValueError, match="store 'n'"):
        make({0: one, 1: spec(5, "n")})


def swap_out_on_small_worker_0(sched, fakes, prompts) -> dict[tuple[str, int], list[int]]:
    """Worker 0 (6 blocks) alone until one of its groups is stored (swap-out answered);
    the tokens streamed so far."""
    sched.workers[0].kv = type(sched.workers[0].kv)(6, 4, False, None)
    sched.workers[0].spec = dataclasses.replace(sched.workers[0].spec, num_blocks=6)
    queue_on(sched, 0, "r", prompts)
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(100):
        so = sched.schedule(0).output
        for o in sched.update(0, so, fakes[0].execute(so)).outputs:
            tokens.setdefault((o.request_id, o.choice_index), []).extend(o.new_token_ids)
        sched.check_integrity()
        if any(not g.pending for g in sched._swaps.groups.values()):
            return tokens
    raise AssertionError("worker 0 never swapped a group out")


def stored_group(sched):
    """The one stored group: (its host ids, its members)."""
    (g,) = {id(g): g for g in sched._swaps.groups.values() if not g.pending}.values()
    return sorted(g.host_ids()), list(g.host_tables)


def test_a_group_moved_to_another_store_is_pulled_from_it() -> None:
    """Worker 0 (store "a") dies while one of its groups sits in "a": worker 1 (store
    "b") resumes it by pulling exactly its host blocks from "a" (freed there afterwards)
    into blocks of its own pool; the tokens equal the run without preemption, and the
    stats count one remote swap-in with its bytes."""
    prompts = [[1] * 10, [2] * 10]
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a", {"b": 1e9}), 1: spec(64, "b", {"a": 1e9})})
    fakes = [
        FakeKVWorker(6, hosts["a"]),
        FakeKVWorker(NUM_BLOCKS, hosts["b"], remotes={"a-node:1": hosts["a"]}),
    ]
    tokens = swap_out_on_small_worker_0(sched, fakes, prompts)
    host_ids, members = stored_group(sched)
    assert sorted(hosts["a"]) == host_ids
    sched.mark_worker_dead(0)
    pulls: list = []

    def on_plan(sched, wid, so, _cur):
        for t in swaps_of(so).blocks_to_swap_in:
            assert wid == 1
            pulls.append(t)
            # the blocks it scatters into are worker 1's, held by the members it restores
            held = {b for sid in t.seq_ids for b in sched.workers[1].kv.get_block_ids(sid)}
            assert set(t.block_ids) <= held
            assert all(sched.workers[1].kv.get_ref_count(b) >= 1 for b in t.block_ids)

    more = run(sched, fakes, on_plan)
    for key, toks in more.items():
        tokens.setdefault(key, []).extend(toks)
    assert tokens == reference(prompts)
    (pull,) = pulls
    assert pull.source_address == "a-node:1"
    assert sorted(pull.host_blocks_to_free) == host_ids
    assert sorted(set(pull.host_block_ids)) == host_ids
    assert pull.seq_ids == members
    assert fakes[1].num_remote_pulls == 1
    assert hosts == {"a": {}, "b": {}}  # freed on "a" by worker 1
    sw = sched.swap_stats()
    assert sw.num_remote_swap_ins == 1 and sw.remote_swap_in_bytes == 100 * len(host_ids)
    assert sw.num_swap_failures == 0 and sw.host_blocks_free == sw.host_blocks_total
    w1 = sched.stats().workers[1].swap
    assert (w1.num_remote_swap_ins, w1.remote_swap_in_bytes) == (1, 100 * len(host_ids))
    assert w1.num_swap_ins >= 1
    sched.check_integrity()


def test_a_failed_remote_pull_recomputes() -> None:
    """Store "a" is unreachable from worker 1 when it pulls (its node is gone): the
    swap-in fails, the group is recomputed on worker 1 with the same tokens, worker 1
    backs off, and store "a"'s host ids return to its pool only after that answer."""
    prompts = [[1] * 10, [2] * 10]
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a", {"b": 1e9}), 1: spec(64, "b", {"a": 1e9})})
    fakes = [FakeKVWorker(6, hosts["a"]), FakeKVWorker(NUM_BLOCKS, hosts["b"], remotes={})]
    tokens = swap_out_on_small_worker_0(sched, fakes, prompts)
    host_ids, _ = stored_group(sched)
    sched.mark_worker_dead(0)
    pool_a = sched._swaps.host_pools["a"]
    free_before = pool_a.num_free_blocks
    pulls: list = []

    def on_plan(sched, wid, so, _cur):
        if swaps_of(so).blocks_to_swap_in:
            pulls.append(swaps_of(so).blocks_to_swap_in[0])
            assert pool_a.num_free_blocks == free_before  # still held while in flight

    more = run(sched, fakes, on_plan)
    for key, toks in more.items():
        tokens.setdefault(key, []).extend(toks)
    assert tokens == reference(prompts)
    assert [t.source_address for t in pulls] == ["a-node:1"]
    assert sorted(pulls[0].host_blocks_to_free) == host_ids
    sw = sched.swap_stats()
    assert sw.num_swap_failures == 1 and sw.num_remote_swap_ins == 0
    assert pool_a.num_free_blocks == pool_a.num_blocks
    assert sched.stats().workers[1].swap.num_swap_failures == 1
    assert not sched._swaps._allowed(1)  # worker 1 backs off (the 1 s window)
    sched.check_integrity()


def test_a_pull_costlier_than_recompute_is_not_made() -> None:
    """Under ``auto``, pulling from "a" is measured at 1 byte/s for worker 1: recomputing
    the group is cheaper, so it is dissolved and recomputed there, as with no pull at
    all."""
    prompts = [[1] * 10, [2] * 10]
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a", {"b": 1e9}), 1: spec(64, "b", {"a": 1.0})}, mode="auto")
    fakes = [
        FakeKVWorker(6, hosts["a"]),
        FakeKVWorker(NUM_BLOCKS, hosts["b"], remotes={"a-node:1": hosts["a"]}),
    ]
    tokens = swap_out_on_small_worker_0(sched, fakes, prompts)
    (g,) = {id(g): g for g in sched._swaps.groups.values() if not g.pending}.values()
    assert not sched._swaps.pull_wins(1, g)
    forced = make({0: spec(64, "a", {"b": 1e9}), 1: spec(64, "b", {"a": 1.0})}, mode="swap")
    assert forced._swaps.pull_wins(1, g)  # `swap` pulls whatever it can
    sched.mark_worker_dead(0)
    moves: dict[int, list[SchedulerOutput]] = {}
    more = run(sched, fakes, transfers_by_worker(moves))
    for key, toks in more.items():
        tokens.setdefault(key, []).extend(toks)
    assert tokens == reference(prompts)
    assert all(not swaps_of(so).blocks_to_swap_in for so in moves.get(1, []))
    assert fakes[1].num_remote_pulls == 0
    assert sched.swap_stats().num_remote_swap_ins == 0 and not sched._swaps.groups
    sched.check_integrity()


@pytest.mark.parametrize("bandwidth", [1e9, 1.0])
def test_a_thief_of_another_store_steals_only_when_the_pull_wins(bandwidth: float) -> None:
    """Idle worker 1 (store "b") takes worker 0's stored group by a pull from "a" when the
    pull beats recompute (1 GB/s), and leaves it pinned to worker 0 when it does not."""
    hosts: dict[str, dict[int, list]] = {"a": {}, "b": {}}
    sched = make({0: spec(64, "a", {"b": 1e9}), 1: spec(64, "b", {"a": bandwidth})}, mode="auto")
    fakes = [
        FakeKVWorker(6, hosts["a"]),
        FakeKVWorker(NUM_BLOCKS, hosts["b"], remotes={"a-node:1": hosts["a"]}),
    ]
    swap_out_on_small_worker_0(sched, fakes, [[1] * 10, [2] * 10])
    _, members = stored_group(sched)
    idle = sched.schedule(1).output
    pulled = swaps_of(idle).blocks_to_swap_in
    if bandwidth > 1:
        assert [t.source_address for t in pulled] == ["a-node:1"]
        assert pulled[0].seq_ids == members
    else:
        assert not pulled
    sched.update(1, idle, fakes[1].execute(idle))
    sched.check_integrity()
