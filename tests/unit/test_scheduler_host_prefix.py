"""The host tier of the prefix cache in the scheduler, with the fake KV worker of
``test_scheduler_swap`` (its pool holds token ids, spills and loads move them, and every
step reads each sequence back through its block table, so a block loaded wrongly fails
there).

The common scenario: prompt ``A`` runs and finishes (its full blocks cached on the
device), ``B`` fills the whole pool (evicting ``A``'s blocks, which are spilled to the
host tier), and ``A`` is sent again: its full blocks are loaded from the host tier.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import drive, swaps_of
from test_scheduler_swap import BS, PROMPTS, FakeKVWorker, reference

from pagedserve.cluster.metrics import snapshot_families
from pagedserve.scheduler.block_pool import EvictedBlock
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.host_prefix import HostEntry, HostPrefixCache, SpillHitRate
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import SwapSpec

SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
A = list(range(100, 113))  # 13 tokens: 3 full blocks cacheable, the 4th holds the last one
B = list(range(200, 229))  # 29 tokens + 2 outputs: all 8 blocks of the pool
NUM_BLOCKS = 8


def make(
    host_blocks: int = 16,
    fraction: float = 0.5,
    workers: int = 1,
    swap: SwapSpec | dict[int, SwapSpec] | None = None,
    mode: str = "swap",
    tier: bool = True,
    overlap: bool = False,
    **kw: float,
) -> Scheduler:
    spec = swap or SwapSpec(host_blocks, 100, kw.get("bandwidth", 1e9), kw.get("prefill", 1e-3))
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64,
            max_model_len=64,
            preemption_mode=mode,
            max_num_seqs=8,
            host_prefix_cache=tier,
            host_prefix_cache_fraction=fraction,
            async_scheduling=overlap,
        ),
        [WorkerSpec(i, NUM_BLOCKS, BS) for i in range(workers)],
        spec,
    )


def send(sched, fakes, rid, prompt, sampling=SHORT, on_plan=None, salt=None):
    """Run one request to its end; its tokens."""
    if salt is not None:
        sampling = dataclasses.replace(sampling, cache_salt=salt)
    sched.add_request(EngineRequest(rid, prompt, sampling))
    return drive(sched, [f.execute for f in fakes], on_plan=on_plan).tokens[(rid, 0)]


def loads_of(so: SchedulerOutput):
    return [t for t in swaps_of(so).blocks_to_swap_in if t.transfer_id.startswith("load")]


def spills_of(so: SchedulerOutput):
    return [t for t in swaps_of(so).blocks_to_swap_out if t.transfer_id.startswith("spill")]


def evict_a(sched, fake, salt=None):
    """Run ``A`` then ``B`` (evicting ``A``'s blocks from the device); ``A``'s tokens."""
    toks = send(sched, [fake], "a0", A, salt=salt)
    send(sched, [fake], "b0", B)
    kv = sched.workers[0].kv
    assert kv.get_computed_blocks(A, salt, count=False)[1] == 0  # gone from the device
    return toks


def test_a_resent_prompt_is_loaded_from_the_host_tier() -> None:
    ref = reference([A], SHORT)[("r0", 0)]
    host: dict[int, list] = {}
    fake = FakeKVWorker(NUM_BLOCKS, host)
    sched = make()
    spilled: list = []
    assert send(sched, [fake], "a0", A) == ref
    send(sched, [fake], "b0", B, on_plan=lambda s, w, so, cur: spilled.extend(spills_of(so)))
    # A freed tail-first: B evicts its cached blocks 2, 1, 0 in that order, spilled
    # newest (the chain's head) first.
    (spill,) = spilled
    assert spill.host_block_ids == [0, 1, 2] and spill.block_ids == [0, 1, 2]
    assert sorted(host) == [0, 1, 2] and host[0] == A[0:4] and host[2] == A[8:12]
    seen: list = []

    def on_plan(s, w, so, cur):
        for t in loads_of(so):
            kv = s.workers[0].kv
            table = kv.get_block_ids("a1/0")
            seen.append((t.host_block_ids, t.block_ids, table[:3], so.num_scheduled_tokens))
            assert [kv.get_ref_count(b) for b in table] == [1, 1, 1, 1]
            assert t.host_blocks_to_free == [] and t.source_address is None

    assert send(sched, [fake], "a1", A, on_plan=on_plan) == ref
    ((host_ids, dev, head, scheduled),) = seen
    assert host_ids == [0, 1, 2] and dev == head
    assert scheduled == {"a1/0": 1}  # only the last prompt token is computed
    hp = sched.swap_stats().host_prefix
    assert (hp.num_hit_blocks, hp.num_hit_tokens, hp.num_loads) == (3, 12, 1)
    assert hp.load_bytes == 300 and hp.num_failures == 0 and hp.num_spills >= 3
    assert sched.sequences == {} and sched.workers[0].num_recomputed_tokens == 0
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in snapshot_families(sched.metrics_snapshot(), "m")
        for s in fam.samples
    }
    m = (("model_name", "m"),)
    assert got[("pagedserve:host_prefix_cache_hits_total", m)] == 12
    assert got[("pagedserve:host_prefix_cache_bytes_total", (("direction", "load"), *m))] == 300
    # the loaded blocks are in the device prefix cache again
    assert sched.workers[0].kv.get_computed_blocks(A, count=False)[1] == 12
    sched.check_integrity()


def test_another_salt_never_hits_the_host_tier() -> None:
    fake = FakeKVWorker(NUM_BLOCKS, {})
    sched = make(host_blocks=64)
    ref = evict_a(sched, fake, salt="alice")
    loads: list = []
    record = lambda s, w, so, cur: loads.extend(loads_of(so))  # noqa: E731
    assert send(sched, [fake], "x", A, on_plan=record, salt="bob") == ref
    assert send(sched, [fake], "y", A, on_plan=record) == ref  # no salt
    assert loads == [] and sched.swap_stats().host_prefix.num_hit_blocks == 0
    send(sched, [fake], "b1", B)  # evicts A again (its unsalted copy spills too)
    hits = sched.swap_stats().host_prefix.num_hit_blocks
    assert send(sched, [fake], "z", A, on_plan=record, salt="alice") == ref
    assert len(loads) == 1 and sched.swap_stats().host_prefix.num_hit_blocks == hits + 3


def test_abort_during_a_load_frees_everything() -> None:
    fake = FakeKVWorker(NUM_BLOCKS, {})
    sched = make()
    evict_a(sched, fake)
    sched.add_request(EngineRequest("a1", A, SHORT))
    so = sched.schedule(0).output
    (load,) = loads_of(so)
    assert load.seq_ids == ["a1/0"] and load.host_block_ids == [0, 1, 2]
    tier = sched._swaps.tier.caches[""]
    assert all(tier.lookup(*k).pins == 1 for k in _keys(sched, A))  # pinned while in flight
    sched.abort_request("a1")
    sched.check_integrity()
    sched.update(0, so, fake.execute(so))
    sched.check_integrity()
    kv = sched.workers[0].kv
    assert kv.num_free_blocks == NUM_BLOCKS and sched.sequences == {}
    assert all(tier.lookup(*k).pins == 0 for k in _keys(sched, A))  # still there, unpinned
    # the aborted load's blocks were never registered on the device
    assert kv.get_computed_blocks(A, count=False)[1] == 0
    assert sched.swap_stats().host_prefix.num_hit_tokens == 12  # the transfer itself ran


def _keys(sched, prompt, salt=None):
    return list(sched.workers[0].kv.prefix_keys(prompt, salt, 0, None))


@pytest.mark.parametrize("dead", [False, True])
def test_a_failed_load_recomputes(dead: bool) -> None:
    ref = reference([A], SHORT)[("r0", 0)]
    host: dict[int, list] = {}
    fake = FakeKVWorker(NUM_BLOCKS, host)
    sched = make()
    evict_a(sched, fake)
    if dead:
        fake.store_dies_after = 0  # the store (and its blocks) die before the next transfer
    else:
        fake.fail_swap = {"in"}  # a checksum mismatch on the load
    steps: list = []
    assert send(sched, [fake], "a1", A, on_plan=lambda s, w, so, c: steps.append(so)) == ref
    assert len(loads_of(steps[0])) == 1 and all(not loads_of(so) for so in steps[1:])
    assert steps[1].num_scheduled_tokens == {"a1/0": 13}  # recomputed whole
    hp = sched.swap_stats().host_prefix
    assert hp.num_failures >= 1 and hp.num_hit_blocks == 0
    tier = sched._swaps.tier.caches[""]
    assert all(tier.lookup(*k) is None for k in _keys(sched, A))  # dropped
    assert sched.workers[0].kv.num_free_blocks == NUM_BLOCKS
    sched.check_integrity()


def test_load_only_when_cheaper_than_recompute() -> None:
    fake = FakeKVWorker(NUM_BLOCKS, {})
    # a 100-byte block at 1e9 B/s (100 ns) > its 4 tokens at 1 ns: recompute
    sched = make(prefill=1e-9, mode="auto")
    ref = evict_a(sched, fake)
    steps: list = []
    assert send(sched, [fake], "a1", A, on_plan=lambda s, w, so, c: steps.append(so)) == ref
    assert not any(loads_of(so) for so in steps)
    assert steps[0].num_scheduled_tokens == {"a1/0": 13}
    assert sched.swap_stats().host_prefix.num_spills == 0  # no load could pay for one
    forced = make(prefill=1e-9, mode="swap")  # swap loads whatever it finds
    evict_a(forced, fake)
    steps.clear()
    assert send(forced, [fake], "a1", A, on_plan=lambda s, w, so, c: steps.append(so)) == ref
    assert len(loads_of(steps[0])) == 1


def test_the_tier_keeps_its_capacity_by_lru() -> None:
    fake = FakeKVWorker(NUM_BLOCKS, {})
    sched = make(host_blocks=8, fraction=0.5)  # the tier holds 4 host blocks
    prompts = [list(range(300 + 20 * i, 313 + 20 * i)) for i in range(4)]
    for i, p in enumerate(prompts):
        send(sched, [fake], f"p{i}", p)
        other = list(range(1000 + 40 * i, 1029 + 40 * i))  # a B of its own
        send(sched, [fake], f"b{i}", other)  # evicts p (and spills it)
        hp = sched.swap_stats().host_prefix
        assert hp.num_blocks <= hp.capacity_blocks == 4
    tier = sched._swaps.tier.caches[""]
    # the last prompt's 3 blocks are the most recent: kept; the first's are gone
    assert all(tier.lookup(*k) is not None for k in _keys(sched, prompts[-1]))
    assert all(tier.lookup(*k) is None for k in _keys(sched, prompts[0]))
    sched.check_integrity()


def test_swap_preemption_takes_the_tiers_blocks_when_the_pool_is_short() -> None:
    host: dict[int, list] = {}
    fake = FakeKVWorker(NUM_BLOCKS, host)
    sched = make(host_blocks=6, fraction=1.0)
    for i in range(3):
        send(sched, [fake], f"p{i}", list(range(300 + 20 * i, 313 + 20 * i)))
        send(sched, [fake], f"b{i}", B)
    sw = sched.swap_stats()
    assert sw.host_prefix.num_blocks == 6 and sw.host_blocks_free == 0  # the tier holds all
    ref = reference(PROMPTS)
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, sampling))
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=6)
    assert drive(sched, [fake.execute]).tokens == ref
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    assert sw.preemptions_by_mode["recompute"] == 0
    sched.check_integrity()


def test_integrity_catches_a_leaked_or_overfull_tier() -> None:
    fake = FakeKVWorker(NUM_BLOCKS, {})
    sched = make()
    evict_a(sched, fake)
    tier = sched._swaps.tier.caches[""]
    assert len(tier) == 3  # A's blocks (B's are still on the device)
    sched.check_integrity()
    assert tier.evict_lru() is not None  # dropped without returning its host id
    with pytest.raises(IntegrityError, match="host pool"):
        sched.check_integrity()
    tier.capacity = 1
    with pytest.raises(IntegrityError, match="capacity"):
        sched.check_integrity()


def test_host_prefix_cache_lru_and_pins() -> None:
    cache = HostPrefixCache(2)
    e0, e1 = (HostEntry(bytes([i]) * 32, i, None, (i,), ()) for i in range(2))
    cache.add(e0)
    cache.add(e1)
    assert cache.lookup(e0.block_hash, None, (0,), ()) is None  # not ready: spill in flight
    assert cache.evict_lru() is None
    e0.ready = e1.ready = True
    e0.pins = 1
    assert cache.lookup(e0.block_hash, None, (9,), ()) is None  # another content: a miss
    assert cache.evict_lru() == 1  # e0 is pinned by a load
    e0.pins = 0
    cache.add(HostEntry(b"\x07" * 32, 7, None, (7,), ()))
    cache.touch(e0.block_hash)
    assert cache.clear() == [0] and len(cache) == 0
    with pytest.raises(ValueError, match="capacity"):
        HostPrefixCache(-1)
    with pytest.raises(ValueError, match="host_prefix_cache_fraction"):
        SchedulerConfig(host_prefix_cache_fraction=0.0)


def test_off_spills_nothing() -> None:
    host: dict[int, list] = {}
    fake = FakeKVWorker(NUM_BLOCKS, host)
    spec = SwapSpec(16, 100, 1e9, 1e-3)
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        max_model_len=64,
        preemption_mode="swap",
        host_prefix_cache=False,
        async_scheduling=False,
    )
    sched = Scheduler(config, [WorkerSpec(0, NUM_BLOCKS, BS)], spec)
    evict_a(sched, fake)
    assert host == {} and not sched.swap_stats().host_prefix.enabled


def _store(name: str, pull: dict[str, float] | None = None) -> SwapSpec:
    return SwapSpec(
        16,
        100,
        1e9,
        1e-3,
        store_id=name,
        remote_address=f"{name}-node:1",
        pull_bandwidth_bytes_per_s=pull or {},
    )


def test_router_scores_host_hits_below_device_hits() -> None:
    host_a: dict[int, list] = {}
    host_b: dict[int, list] = {}
    fakes = [FakeKVWorker(NUM_BLOCKS, host_a), FakeKVWorker(NUM_BLOCKS, host_b)]
    sched = make(workers=2, swap={0: _store("a"), 1: _store("b")})
    sched.config = dataclasses.replace(sched.config, routing_load_threshold=100)
    ws0, ws1 = sched.workers[0], sched.workers[1]
    # A runs on worker 1 and is spilled to store b by B there
    for rid, p in (("a0", A), ("b0", B)):
        sched.add_request(EngineRequest(rid, p, SHORT))
        (seq,) = sched.requests[rid]
        ws0.waiting.remove(seq)
        sched._enqueue(ws1, seq)
        drive(sched, [f.execute for f in fakes])
    assert len(sched._swaps.tier.caches["b"]) == 3 and not sched._swaps.tier.caches["a"]
    seqs = sched.add_request(EngineRequest("a1", A, SHORT))
    assert seqs[0].queued_on == 1  # a host hit on worker 1's store beats a cold worker 0
    drive(sched, [f.execute for f in fakes])
    assert sched.swap_stats().host_prefix.num_hit_blocks == 3
    # now A is on worker 1's device: a device hit of A's first 2 blocks on worker 0
    # (4 device-hit points each) is beaten by 3 device blocks on worker 1 ...
    assert sched.add_request(EngineRequest("a2", A, SHORT))[0].queued_on == 1
    drive(sched, [f.execute for f in fakes])
    # ... and a device hit of 2 blocks beats a host hit of 3 (8 points vs 6 points)
    sched.add_request(EngineRequest("a3", A[:9] + [7, 7, 7, 7], SHORT))
    (seq,) = sched.requests["a3"]
    sched._queue_of(seq).waiting.remove(seq)
    sched._enqueue(ws0, seq)
    drive(sched, [f.execute for f in fakes])  # A's first 2 blocks now cached on worker 0
    sched.add_request(EngineRequest("b1", B, SHORT))
    (seq,) = sched.requests["b1"]
    sched._queue_of(seq).waiting.remove(seq)
    sched._enqueue(ws1, seq)
    drive(sched, [f.execute for f in fakes])  # A leaves worker 1's device for store b
    assert ws0.kv.get_computed_blocks(A, count=False)[1] == 8
    assert ws1.kv.get_computed_blocks(A, count=False)[1] == 0
    assert (
        sched._swaps.host_prefix_tokens(ws1, sched.add_request(EngineRequest("q", A, SHORT))[0])
        == 12
    )
    assert sched.requests["q"][0].queued_on == 0


@pytest.mark.parametrize("pull_bw", [1e9, 10.0])
def test_a_host_hit_on_another_nodes_store_is_pulled_when_cheaper(pull_bw: float) -> None:
    ref = reference([A], SHORT)[("r0", 0)]
    host_a: dict[int, list] = {}
    host_b: dict[int, list] = {}
    remotes = {"a-node:1": host_a, "b-node:1": host_b}
    fakes = [
        FakeKVWorker(NUM_BLOCKS, host_a, remotes=remotes),
        FakeKVWorker(NUM_BLOCKS, host_b, remotes=remotes),
    ]
    stores = {0: _store("a", {"b": pull_bw}), 1: _store("b", {"a": pull_bw})}
    sched = make(workers=2, swap=stores, mode="auto")
    ws0 = sched.workers[0]
    for rid, p in (("a0", A), ("b0", B)):
        sched.add_request(EngineRequest(rid, p, SHORT))
        drive(sched, [f.execute for f in fakes])
    assert len(sched._swaps.tier.caches["a"]) == 3
    ws0.alive = False  # worker 0 is gone; its store still serves
    loads: list = []
    sched.add_request(EngineRequest("a1", A, SHORT))
    (seq,) = sched.requests["a1"]
    assert seq.queued_on == 1
    toks = drive(
        sched, [f.execute for f in fakes], on_plan=lambda s, w, so, c: loads.extend(loads_of(so))
    )
    assert toks.tokens[("a1", 0)] == ref
    if pull_bw > 1e6:
        (load,) = loads
        assert load.source_address == "a-node:1" and fakes[1].num_remote_pulls == 1
        assert sched.swap_stats().host_prefix.num_hit_tokens == 12
        assert sorted(host_a) == [0, 1, 2]  # a load frees nothing on the source
    else:
        assert loads == [] and sched.swap_stats().host_prefix.num_hit_tokens == 0
    sched.check_integrity()


def _multi_turn(sched: Scheduler, fake: FakeKVWorker, turns: int = 3) -> tuple[list, int]:
    """Four conversations, each turn resent with its previous output and 4 new tokens,
    all four at once; the outputs per turn and the prompt tokens the worker computed."""
    convs = [[50 + 10 * c + i for i in range(9)] for c in range(4)]
    outs: list = []
    computed = 0

    def count(s, w, so, cur):
        nonlocal computed
        computed += sum(so.num_scheduled_tokens.values())

    for t in range(turns):
        for c, conv in enumerate(convs):
            sched.add_request(EngineRequest(f"t{t}c{c}", list(conv), SHORT))
        toks = drive(sched, [fake.execute], on_plan=count).tokens
        for c, conv in enumerate(convs):
            out = toks[(f"t{t}c{c}", 0)]
            outs.append(out)
            conv.extend(out + [7 + t, 8, 9, 10 + c])
    return outs, computed


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_turn_conversations_load_from_the_host_tier(overlap: bool) -> None:
    off = make(host_blocks=64, tier=False, overlap=overlap)
    on = make(host_blocks=64, overlap=overlap)
    ref, computed_off = _multi_turn(off, FakeKVWorker(NUM_BLOCKS, {}))
    outs, computed_on = _multi_turn(on, FakeKVWorker(NUM_BLOCKS, {}))
    assert outs == ref
    hp = on.swap_stats().host_prefix
    assert hp.num_hit_tokens > 0 and hp.num_failures == 0
    assert computed_on == computed_off - hp.num_hit_tokens  # each loaded token not computed
    assert not off.swap_stats().host_prefix.enabled


def test_blocks_a_transfer_holds_are_never_reused_before_its_answer() -> None:
    """A spill in flight pins its host ids: swap preemption cannot reclaim them and a
    reset of the prefix cache frees them only once the spill answers."""
    fake = FakeKVWorker(NUM_BLOCKS, {})
    sched = make(host_blocks=3, fraction=1.0)
    send(sched, [fake], "a0", A)
    sched.add_request(EngineRequest("b0", B, SHORT))
    so = sched.schedule(0).output
    (spill,) = spills_of(so)
    assert spill.host_block_ids == [0, 1, 2]
    sw = sched._swaps
    pool = sw.host_pools[""]
    assert pool.num_free_blocks == 0
    sw.tier.reclaim("", 3)  # what a swap-out that finds the store short asks
    assert pool.num_free_blocks == 0  # not ready yet: nothing reclaimed
    sw.tier.clear()  # new weights while the spill runs
    assert pool.num_free_blocks == 0
    sched.check_integrity()
    sched.update(0, so, fake.execute(so))
    assert pool.num_free_blocks == 3 and len(sw.tier.caches[""]) == 0
    sched.check_integrity()
    drive(sched, [fake.execute])
    sched.check_integrity()


def test_spill_hit_rate_decays_per_spilled_block_and_rises_with_hits() -> None:
    rate = SpillHitRate(window=4.0, prior=2.0)
    assert rate.rate == 1.0
    rate.on_spill(2)  # both counts * (3/4)^2, then + 2 spilled
    assert rate.hits == pytest.approx(2 * 0.5625)
    assert rate.spilled == pytest.approx(2 * 0.5625 + 2)
    assert rate.rate == pytest.approx(1.125 / 3.125)
    rate.on_hit(3)
    assert rate.rate == pytest.approx(4.125 / 3.125)
    assert SpillHitRate(prior=0.0).rate == 1.0
    with pytest.raises(ValueError):
        SpillHitRate(window=0.5)  # a decay factor below 0 would flip signs


def test_auto_spills_a_probe_block_every_8_evicting_steps_while_nothing_comes_back() -> None:
    # A 100-byte block at 1e9 B/s (100 ns) vs its 4 tokens at 1 us: a load would pay, so
    # auto spills; the tier's hit rate decides how much.
    def spilled_blocks(sched) -> list[list[int]]:
        out: list = []
        fake = FakeKVWorker(NUM_BLOCKS, {})
        send(sched, [fake], "a0", A)
        send(sched, [fake], "b0", B, on_plan=lambda s, w, so, c: out.extend(spills_of(so)))
        return [t.block_ids for t in out]

    assert spilled_blocks(make(prefill=1e-6, mode="auto")) == [[0, 1, 2]]  # optimistic start
    sched = make(prefill=1e-6, mode="auto")
    # a 100 ns copy against 4 us - 100 ns saved: spills pay from a rate of 1 / 39
    rate = sched._swaps.tier.hit_rate
    rate.hits, rate.spilled = 1.0, 38.0
    assert sched._swaps._spills_pay(sched.workers[0])
    rate.spilled = 40.0
    assert not sched._swaps._spills_pay(sched.workers[0])
    assert spilled_blocks(sched) == [[0]]  # the newest evicted block: the chain's head
    # then nothing for 7 steps that evict, and a probe again on the 8th
    swaps, ws = sched._swaps, sched.workers[0]
    rate.hits = 0.0

    def evicted(i: int) -> list[EvictedBlock]:
        return [EvictedBlock(b, bytes([i, b]) * 16, None, (i, b), ()) for b in (5, 6)]

    planned = [swaps.plan_spills(ws, evicted(i)) for i in range(8)]
    assert [p is None for p in planned] == [True] * 7 + [False]
    assert planned[7].block_ids == [6] and swaps._probe_wait[0] == 7
    # a probe that finds every evicted block in the tier already spills nothing and waits
    # for the next evicting step, not 8
    swaps._probe_wait[0] = 0
    assert swaps.plan_spills(ws, evicted(7)[1:]) is None and swaps._probe_wait[0] == 0
    assert swaps.plan_spills(ws, evicted(7)).block_ids == [5]  # the one the tier lacks
    assert swaps._probe_wait[0] == 7
    swap_mode = make(prefill=1e-6, mode="swap")
    swap_mode._swaps.tier.hit_rate.hits = 0.0
    assert spilled_blocks(swap_mode) == [[0, 1, 2]]  # swap spills every block
