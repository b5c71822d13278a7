"""Swap preemption end to end in process: the real Scheduler, real Workers on a tiny random
Llama, and a real host block store (gRPC on loopback).

Greedy outputs must equal HF's under forced swapping (one worker, two workers with
migration, forked n > 1 choices), with the swap counters moving and every device and host
block free at the end; a tiny host pool, a dead store and corrupted blocks fall back to
recompute without stalling. The ``overlap`` cases step as the scheduler actor's overlapped
loop does: step t+1 is planned and run by the worker before t's answer is applied.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zlib
from pathlib import Path

import helpers
import pytest
from helpers import FakeScheduler, InProcessWorker, hf_greedy, swaps_of

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import SwapSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.host_store import HostBlockStore, serve_host_store
from pagedserve.worker.worker import Worker

MAX_NEW = 12
PROMPTS = [
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
    [99, 3, 3, 3, 120, 7, 8],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 60, 61, 62],
    [12, 13],
    [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80],
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture()
def store():
    server, port, st = serve_host_store(1 << 30)
    yield f"127.0.0.1:{port}", st
    server.stop(0)


def make_workers(
    model_dir: Path, n: int, num_blocks: int, address: str | None, kv_cache_dtype: str = "auto"
) -> list[Worker]:
    workers = []
    for wid in range(n):
        w = Worker(
            WorkerConfig(
                worker_id=wid,
                model=ModelConfig(model=str(model_dir), dtype="float32"),
                cache=CacheConfig(
                    block_size=4, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype
                ),
                device="cpu",
            )
        )
        if address is not None:
            w.connect_host_store(address)
        workers.append(w)
    return workers


def make_scheduler(
    workers: list[Worker],
    mode: str,
    host_blocks: int,
    budget: int = 6,
    host_prefix: bool = False,
    **cost: float,
) -> Scheduler:
    info = workers[0].get_info()
    spec = SwapSpec(
        num_host_blocks=host_blocks,
        block_bytes=info.block_bytes,
        bandwidth_bytes_per_s=cost.get("bandwidth", 1e9),
        prefill_s_per_token=cost.get("prefill", 1e-3),
    )
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=info.max_model_len,
            preemption_mode=mode,
            host_prefix_cache=host_prefix,
        ),
        [WorkerSpec(i, w.get_info().num_blocks, 4) for i, w in enumerate(workers)],
        spec,
    )


def drive(
    sched: Scheduler,
    workers: list,
    on_step=None,
    overlap: bool = False,
    sink: list | None = None,
):
    """Run the engine loop (``helpers.drive``: integrity checked after every step) until
    nothing is left; returns the tokens per (request id, choice).

    ``overlap`` sets the scheduler's ``async_scheduling`` (the loop kind); overlapped runs
    must plan steps ahead at all. ``on_step(sched, wid, so)`` runs after each step's
    answer is applied; ``sink`` gets every SequenceOutput. ``workers``: Workers or
    ``WorkerHandle``s."""
    sched.config = dataclasses.replace(sched.config, async_scheduling=overlap)
    handles = [w.execute_model if isinstance(w, Worker) else w for w in workers]
    seen = helpers.drive(sched, handles, on_step=on_step)
    if sink is not None:
        sink.extend(seen.outputs)
    assert (seen.ahead > 0) is overlap
    return seen.tokens


def assert_all_free(sched: Scheduler, st: HostBlockStore | None = None) -> None:
    for ws in sched.workers.values():
        assert ws.kv.num_free_blocks == ws.spec.num_blocks
    sw = sched.swap_stats()
    assert sw.host_blocks_free == sw.host_blocks_total
    assert sw.num_requests_swapped == 0
    if st is not None:
        assert st.num_blocks_stored == 0 and st.used_bytes == 0


def add_all(sched: Scheduler, prompts, sampling=GREEDY) -> None:
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, sampling, (2,)))


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_forced_swap_equals_hf(tiny_llama_dir: Path, expected, store, overlap: bool) -> None:
    address, st = store
    workers = make_workers(tiny_llama_dir, 1, 14, address)
    sched = make_scheduler(workers, "swap", 64)
    add_all(sched, PROMPTS)
    late: list[str] = []
    real_late = sched._late_answer

    def count_late(ws, seq, step_id, num_new, runner_out):
        before = seq.num_computed_tokens
        out = real_late(ws, seq, step_id, num_new, runner_out)
        if seq.num_computed_tokens > before:
            late.append(seq.seq_id)
        return out

    sched._late_answer = count_late  # type: ignore[method-assign]
    tokens = drive(sched, workers, overlap=overlap)
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref, i
    # Overlapped: victims' tokens in flight were swapped out with them and kept (their
    # K/V came back from the store, not recomputed), and outputs still equal HF.
    assert bool(late) is overlap
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    assert sw.swap_out_bytes == sw.swap_in_bytes > 0
    assert sw.swap_out_bytes % workers[0].get_info().block_bytes == 0
    assert sw.preemptions_by_mode["swap"] > 0 and sw.num_swap_failures == 0
    assert st.swap_out_bytes == sw.swap_out_bytes and st.num_swap_outs == sw.num_swap_outs
    assert_all_free(sched, st)


def test_forced_swap_of_an_int8_cache_changes_no_token(tiny_llama_dir: Path, store) -> None:
    """An int8 pool's scales live in its blocks: swapped out and back in (and shared by the
    prompts' common prefix), the blocks give the same greedy tokens as a run that never
    preempts."""
    address, st = store
    roomy = make_workers(tiny_llama_dir, 1, 64, None, kv_cache_dtype="int8")
    calm = make_scheduler(roomy, "swap", 64)
    add_all(calm, PROMPTS)
    want = drive(calm, roomy)
    assert calm.swap_stats().num_swap_outs == 0
    workers = make_workers(tiny_llama_dir, 1, 14, address, kv_cache_dtype="int8")
    info = workers[0].get_info()
    assert (info.kv_cache_dtype, info.block_bytes) == ("int8", 2 * 2 * 4 * 2 * (16 + 4))
    sched = make_scheduler(workers, "swap", 64)
    add_all(sched, PROMPTS)
    tokens = drive(sched, workers)
    assert tokens == want
    sw = sched.swap_stats()
    assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
    assert sw.swap_out_bytes % info.block_bytes == 0 and sw.num_swap_failures == 0
    assert_all_free(sched, st)


def test_migration_to_the_other_worker_equals_hf(tiny_llama_dir: Path, expected, store) -> None:
    """Worker 0 swaps sequences out, then dies: worker 1 swaps them in and finishes them."""
    address, st = store
    workers = make_workers(tiny_llama_dir, 2, 14, address)
    sched = make_scheduler(workers, "swap", 64)
    for i, p in enumerate(PROMPTS):
        seq = sched.add_request(EngineRequest(f"r{i}", p, GREEDY, (2,)))[0]
        if seq.queued_on != 0:  # everything starts on worker 0
            sched.workers[seq.queued_on].waiting.remove(seq)
            sched._enqueue(sched.workers[0], seq)
    migrated: list[str] = []

    def dies_once_swapped(so) -> bool:
        swapped = [sid for sid, g in sched._swaps.groups.items() if not g.pending]
        migrated.extend(swapped)
        return bool(swapped)

    real_has_work = sched.has_work
    # Worker 1 idles (it would steal) until worker 0 has swapped something out and died.
    sched.has_work = lambda w: real_has_work(w) and (w == 0 or not sched.workers[0].alive)  # type: ignore[method-assign]
    dying = InProcessWorker(workers[0].execute_model, die_when=dies_once_swapped)
    tokens = drive(sched, [dying, workers[1]])
    sched.has_work = real_has_work  # type: ignore[method-assign]
    assert migrated
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref, i
    sw = sched.swap_stats()
    assert sw.num_swap_ins >= 1 and sw.num_swap_failures == 0
    assert_all_free(sched, st)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_two_busy_workers_swap_and_equal_hf(
    tiny_llama_dir: Path, expected, store, overlap: bool
) -> None:
    address, st = store
    workers = make_workers(tiny_llama_dir, 2, 14, address)
    sched = make_scheduler(workers, "swap", 64)
    add_all(sched, PROMPTS + PROMPTS[:2])
    tokens = drive(sched, workers, overlap=overlap)
    for i, ref in enumerate(expected + expected[:2]):
        assert tokens[(f"r{i}", 0)] == ref, i
    assert sched.swap_stats().num_swap_ins > 0
    assert_all_free(sched, st)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_forked_choices_swap_as_a_group_and_keep_sharing(
    tiny_llama_dir: Path, store, overlap: bool
) -> None:
    address, st = store
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True, n=4)
    prompts = PROMPTS[:2]
    (ref_worker,) = make_workers(tiny_llama_dir, 1, 64, None)
    single = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True)
    independent = FakeScheduler(ref_worker, 4, 64).generate(
        [p for p in prompts for _ in range(4)], MAX_NEW, single, choice_indices=[0, 1, 2, 3] * 2
    )
    workers = make_workers(tiny_llama_dir, 1, 13, address)
    sched = make_scheduler(workers, "swap", 64, budget=64)
    shared_after_swap_in: list[int] = []

    def check_sharing(s: Scheduler, wid: int, so) -> None:
        for t in swaps_of(so).blocks_to_swap_in:
            members = [m for m in t.seq_ids if s.workers[wid].kv.has_seq(m)]
            if len(members) > 1:
                kv = s.workers[wid].kv
                tables = [kv.get_block_ids(m) for m in members]
                shared = sum(len(x) for x in tables) - len({b for x in tables for b in x})
                shared_after_swap_in.append(shared)
                assert len(t.block_ids) < sum(len(x) for x in tables)

    add_all(sched, prompts, sampling)
    tokens = drive(sched, workers, check_sharing, overlap=overlap)
    for i in range(2):
        for c in range(4):
            assert tokens[(f"r{i}", c)] == independent[4 * i + c], (i, c)
    assert shared_after_swap_in and max(shared_after_swap_in) > 0
    assert_all_free(sched, st)


def test_tiny_host_pool_falls_back_to_recompute(tiny_llama_dir: Path, expected, store) -> None:
    address, st = store
    workers = make_workers(tiny_llama_dir, 1, 14, address)
    sched = make_scheduler(workers, "swap", 2)  # 2 host blocks: most victims do not fit
    add_all(sched, PROMPTS)
    tokens = drive(sched, workers)
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref, i
    sw = sched.swap_stats()
    assert sw.preemptions_by_mode["recompute"] > 0
    assert_all_free(sched, st)


def test_auto_mode_follows_the_cost_model(tiny_llama_dir: Path, expected, store) -> None:
    address, _ = store
    for bandwidth, swaps in ((1e12, True), (1.0, False)):
        workers = make_workers(tiny_llama_dir, 1, 14, address)
        sched = make_scheduler(workers, "auto", 64, bandwidth=bandwidth, prefill=1e-3)
        sched._swaps.costs[0].observe_step = lambda *a: None  # type: ignore[method-assign]
        add_all(sched, PROMPTS)
        tokens = drive(sched, workers)
        for i, ref in enumerate(expected):
            assert tokens[(f"r{i}", 0)] == ref, i
        by_mode = sched.swap_stats().preemptions_by_mode
        assert (by_mode["swap"] > 0) is swaps and (by_mode["recompute"] > 0) is not swaps
        assert_all_free(sched)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_store_killed_mid_run_recovers_by_recompute(
    tiny_llama_dir: Path, expected, overlap: bool
) -> None:
    cmd = ["host-store", "--port", "0", "--swap-space", "0.01"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cluster.cli", *cmd], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        address = line.split(" on ")[1].split(",")[0]
        workers = make_workers(tiny_llama_dir, 1, 14, address)
        sched = make_scheduler(workers, "swap", 64)

        def kill_after_first_swap_out(s: Scheduler, wid: int, so) -> None:
            if swaps_of(so).blocks_to_swap_out and proc.poll() is None:
                proc.kill()  # swapped-out blocks are lost with it
                proc.wait(10)

        add_all(sched, PROMPTS)
        tokens = drive(sched, workers, kill_after_first_swap_out, overlap=overlap)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref, i
    sw = sched.swap_stats()
    assert sw.num_swap_failures > 0
    assert_all_free(sched)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_corrupted_blocks_fail_the_checksum_and_recompute(
    tiny_llama_dir: Path, expected, overlap: bool
) -> None:
    from pagedserve.v1 import kv_transfer_pb2 as pb
    from pagedserve.worker import host_store as hs

    class CorruptingStore(hs.HostBlockStore):
        def get(self, transfer_id, block_ids, max_chunk_bytes, *rank_and_size):
            for chunk in super().get(transfer_id, block_ids, max_chunk_bytes, *rank_and_size):
                data = bytearray(chunk.data)
                data[0] ^= 0xFF  # the checksum still covers the original bytes
                yield pb.KVChunk(
                    transfer_id=chunk.transfer_id,
                    host_block_ids=chunk.host_block_ids,
                    layer_start=chunk.layer_start,
                    layer_end=chunk.layer_end,
                    dtype=chunk.dtype,
                    shape=chunk.shape,
                    data=bytes(data),
                    checksum=zlib.crc32(chunk.data),
                )

    bad = CorruptingStore(1 << 30)
    server, port, _ = serve_host_store(0, store=bad)
    try:
        workers = make_workers(tiny_llama_dir, 1, 14, f"127.0.0.1:{port}")
        sched = make_scheduler(workers, "swap", 64)
        add_all(sched, PROMPTS)
        tokens = drive(sched, workers, overlap=overlap)
    finally:
        server.stop(0)
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref, i
    sw = sched.swap_stats()
    assert sw.num_swap_failures > 0 and sw.num_swap_ins == 0
    assert_all_free(sched, bad)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_beam_requests_swap_as_groups_and_equal_hf(
    tiny_llama_dir: Path, expected, store, overlap: bool
) -> None:
    """Four beam searches (K=3) on a pool that holds one or two at a time: beams of the
    younger ones are swapped out together and resume together; all equal HF's beams. A
    greedy request runs alongside (beams wait for their beam step, so under overlap it is
    the one whose steps are planned ahead) and equals HF's greedy."""
    from helpers import assert_same_beams, hf_beams
    from transformers import AutoModelForCausalLM

    address, st = store
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    k, max_new = 3, 10
    sampling = SamplingParams(max_tokens=max_new, beam_width=k, n=k, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[5]]
    refs = [hf_beams(hf, p, k, k, max_new, 1.0, None) for p in prompts]
    workers = make_workers(tiny_llama_dir, 1, 21, address)  # K x 7 blocks: one request fits
    sched = make_scheduler(workers, "swap", 64, budget=64)
    beam_groups: list[int] = []

    def record(s: Scheduler, wid: int, so) -> None:
        beam_groups.extend(len(t.seq_ids) for t in swaps_of(so).blocks_to_swap_out)

    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, sampling, (2,)))
    sched.add_request(EngineRequest("greedy", PROMPTS[4], GREEDY, (2,)))
    outputs: list = []
    tokens = drive(sched, workers, record, overlap=overlap, sink=outputs)
    assert tokens[("greedy", 0)] == expected[4]
    finals: dict[str, list] = {}
    for o in outputs:
        finals.setdefault(o.request_id, []).append(o)
    for i, ref in enumerate(refs):
        assert_same_beams(sorted(finals[f"r{i}"], key=lambda o: o.choice_index), ref)
    assert sched.num_preemptions > 0
    assert beam_groups and max(beam_groups) > 1  # beams left together
    assert_all_free(sched, st)


@pytest.mark.parametrize("store_dies", [False, True], ids=["loads", "store-dead"])
def test_host_prefix_tier_loads_a_resent_prompt_and_equals_hf(
    tiny_llama_dir: Path, expected, store, store_dies: bool
) -> None:
    """Prompt 1 runs, the others evict its blocks from the 14-block pool (spilled to the
    real store), then prompt 1 is sent again: its blocks come back from the store (the
    host tier of the prefix cache) and greedy tokens still equal HF's; with the store's
    blocks gone (a dead store), the load fails and the prompt is recomputed."""
    address, st = store
    workers = make_workers(tiny_llama_dir, 1, 14, address)
    sched = make_scheduler(workers, "swap", 64, host_prefix=True)
    kv = sched.workers[0].kv
    sched.add_request(EngineRequest("p", PROMPTS[1], GREEDY, (2,)))
    assert drive(sched, workers)[("p", 0)] == expected[1]
    for i in (0, 2, 3, 5):
        sched.add_request(EngineRequest(f"e{i}", PROMPTS[i], GREEDY, (2,)))
        assert drive(sched, workers)[(f"e{i}", 0)] == expected[i]
    device_hit = kv.get_computed_blocks(PROMPTS[1], count=False)[1]
    assert device_hit < 16  # some of its 4 cacheable blocks left the device
    hp = sched.swap_stats().host_prefix
    assert hp.num_spills > 0 and hp.spill_bytes == hp.num_spills * workers[0].get_info().block_bytes
    assert st.num_blocks_stored == hp.num_spills  # every spill landed in the real store
    if store_dies:
        st.free(range(64))  # the store lost every block: the load fails (NOT_FOUND)
    sched.add_request(EngineRequest("p2", PROMPTS[1], GREEDY, (2,)))
    assert drive(sched, workers)[("p2", 0)] == expected[1]
    hp = sched.swap_stats().host_prefix
    if store_dies:
        assert hp.num_hit_tokens == 0 and hp.num_failures == 1
    else:
        assert hp.num_hit_tokens == 16 - device_hit and hp.num_loads == 1
        assert hp.load_bytes == (hp.num_hit_tokens // 4) * workers[0].get_info().block_bytes
    assert kv.num_free_blocks == 14 and sched.swap_stats().num_requests_swapped == 0
    sched.check_integrity()
