"""Paged-vs-contiguous simulator on tiny hand-made workloads with exact figures."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.sim.backends import FREE, RESERVED, Group, PagedBackend
from pagedserve.sim.simulator import SimConfig, simulate, sweep_block_sizes
from pagedserve.sim.workload import WorkloadRequest as R


def paged(**kw) -> SimConfig:
    return SimConfig(allocator="paged", check_every=1, **kw)


def contiguous(**kw) -> SimConfig:
    return SimConfig(allocator="contiguous", check_every=1, **kw)


def test_one_request_prompt_40_block_16() -> None:
    w = [R(0, prompt_len=40, output_len=3)]
    res = simulate(w, paged(num_slots=64, block_size=16, max_model_len=64, snapshot_step=0))
    # Step 0 prefills 40 tokens into 3 blocks (48 slots): 8 slots wasted; steps 1-2 write 41, 42.
    assert res.held == (48, 48, 48)
    assert res.live == (40, 41, 42)
    rep = res.report
    assert rep.steps == 3 and rep.completed == 1 and rep.preemptions == 0
    assert rep.utilisation == pytest.approx(41 / 48)
    assert rep.internal_waste == pytest.approx(7 / 48)
    assert rep.mean_tail_waste == pytest.approx(7.0)  # (8 + 7 + 6) / 3
    assert rep.mean_block_table_len == pytest.approx(3.0)
    assert rep.tokens_per_step == pytest.approx(1.0)
    snap = res.snapshot
    assert snap is not None
    assert sum(1 for s in snap if s == 0) == 40
    assert snap.count(RESERVED) == 8 and snap.count(FREE) == 16

    res = simulate(w, contiguous(num_slots=64, max_model_len=64, snapshot_step=0))
    assert res.held == (64, 64, 64)
    assert res.report.utilisation == pytest.approx(41 / 64)
    assert res.snapshot == (0,) * 40 + (RESERVED,) * 24


def test_paged_admits_more_than_contiguous_for_the_same_memory() -> None:
    w = [R(0, prompt_len=20, output_len=10) for _ in range(4)]
    p = simulate(w, paged(num_slots=256, block_size=16, max_model_len=128)).report
    c = simulate(w, contiguous(num_slots=256, max_model_len=128)).report
    assert (p.max_running, c.max_running) == (4, 2)  # 4 x 2 blocks vs 2 x 128-slot runs
    assert (p.steps, c.steps) == (10, 20)
    assert p.mean_running == pytest.approx(4.0) and c.mean_running == pytest.approx(2.0)
    assert p.tokens_per_step == pytest.approx(2 * c.tokens_per_step)


@pytest.mark.parametrize("prompt,held,live", [(32, (32, 96), (32, 36)), (40, (48, 96), (40, 68))])
def test_parallel_samples_share_prompt_blocks(prompt, held, live) -> None:
    w = [R(0, prompt_len=prompt, output_len=2, n=4)]
    res = simulate(w, paged(num_slots=256, block_size=16, max_model_len=128))
    # Step 0: the 4 samples share the prompt's blocks. Step 1: each writes its first output
    # token: prompt 32 -> 4 new blocks; prompt 40 -> 3 copy-on-write copies of the last
    # prompt block (2 shared full blocks + 4 private tails).
    assert res.held == held
    assert res.live == live
    assert res.report.mean_running_seqs == pytest.approx(4.0)
    assert res.report.tokens_per_step == pytest.approx(4.0)
    c = simulate(w, contiguous(num_slots=512, max_model_len=128))
    assert c.held == (512, 512)  # 4 separate 128-slot runs
    assert c.live == (4 * prompt, 4 * (prompt + 1))


def test_prefix_id_shares_cached_prompt_blocks() -> None:
    w = [R(0, 40, 5, prefix_id=7, prefix_len=32), R(1, 40, 5, prefix_id=7, prefix_len=32)]
    res = simulate(w, paged(num_slots=256, block_size=16, max_model_len=64))
    # Step 1: A holds 3 blocks (41 tokens); B hits A's 2 prefix blocks and adds 1 block.
    assert res.held[1] == 4 * 16
    assert res.live[1] == 32 + 9 + 8
    assert res.report.prefix_hit_tokens == 32
    off = simulate(
        w, paged(num_slots=256, block_size=16, max_model_len=64, enable_prefix_caching=False)
    )
    assert off.held[1] == 6 * 16 and off.report.prefix_hit_tokens == 0
    c = simulate(w, contiguous(num_slots=256, max_model_len=64))
    assert c.held[1] == 128 and c.report.prefix_hit_tokens == 0


@pytest.mark.parametrize("caching,hits", [(True, 16), (False, 0)])
def test_preemption_by_recompute_on_a_tiny_pool(caching, hits) -> None:
    # 4 blocks of 16. A and B (prompt 15, 30 tokens out) each need 3 blocks at 33 tokens
    # (step 18): A is older, so B is preempted, waits for A to finish (step 29), resumes at
    # step 30 by re-prefilling 15 + 18 tokens (its cached first block hits) and ends at 41.
    w = [R(0, 15, 30), R(0, 15, 30)]
    res = simulate(
        w, paged(num_slots=64, block_size=16, max_model_len=64, enable_prefix_caching=caching)
    )
    rep = res.report
    assert rep.preemptions == 1
    assert rep.completed == 2
    assert rep.steps == 42
    assert rep.prefix_hit_tokens == hits
    assert res.running[17] == 2 and res.running[18] == 1 and res.running[30] == 1
    assert rep.tokens_per_step == pytest.approx(60 / 42)


def test_contiguous_external_fragmentation() -> None:
    # Runs of 30, 30, 30 at 0, 30, 60; D needs 40. B ends after step 4, leaving 30 + 10 free
    # slots (enough in total, no 40-slot run) until A and C end after step 19.
    w = [
        R(0, 10, 20, max_tokens=20),
        R(0, 10, 5, max_tokens=20),
        R(0, 10, 20, max_tokens=20),
        R(0, 10, 5, max_tokens=30),
    ]
    rep = simulate(w, contiguous(num_slots=100, max_model_len=100, reserve="max_tokens")).report
    assert rep.frag_blocked_steps == 15
    assert rep.external_fragmentation == pytest.approx((5 * 0.10 + 15 * 0.40) / 20)
    assert rep.steps == 25 and rep.completed == 4
    p = simulate(w, paged(num_slots=100, block_size=4, max_model_len=100)).report
    assert p.external_fragmentation == 0.0 and p.frag_blocked_steps == 0


def test_block_size_sweep_tail_waste() -> None:
    w = [R(0, 10 + i, 40) for i in range(16)]
    reps = sweep_block_sizes(w, [1, 4, 16], SimConfig(num_slots=4096, max_model_len=128))
    assert [r.block_size for r in reps] == [1, 4, 16]
    assert reps[0].mean_tail_waste == 0.0 and reps[0].utilisation == pytest.approx(1.0)
    # Lengths 10..25 + t cover every residue mod 4 and 16 equally: mean tail = (B - 1) / 2.
    assert reps[1].mean_tail_waste == pytest.approx(1.5)
    assert reps[2].mean_tail_waste == pytest.approx(7.5)
    assert (
        reps[0].mean_block_table_len > reps[1].mean_block_table_len > reps[2].mean_block_table_len
    )


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([R(0, 60, 10)], paged(num_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match="does not fit"):
        simulate([R(0, 40, 5)], paged(num_slots=32, block_size=16, max_model_len=64))
    with pytest.raises(ValueError, match="does not fit"):
        simulate([R(0, 10, 5)], contiguous(num_slots=32, max_model_len=64))
    with pytest.raises(ValueError, match="allocator"):
        SimConfig(allocator="buddy")
    with pytest.raises(ValueError, match="reserve"):
        SimConfig(reserve="pow2")


requests = st.builds(
    lambda t, p, o, n, pre: R(t, p, o, n, 0 if pre else None, min(p, 20) if pre else 0),
    st.integers(0, 6),
    st.integers(1, 40),
    st.integers(1, 20),
    st.integers(1, 3),
    st.booleans(),
)


@settings(max_examples=25, deadline=None)
@given(st.lists(requests, min_size=1, max_size=8), st.sampled_from([1, 4, 16]), st.integers(0, 30))
def test_measured_series_match_a_slot_map_scan(w, block_size, step) -> None:
    """held / live (from counters) equal a brute-force scan of the block tables, with
    forks, prefix hits and preemptions; integrity is checked every step and at the end."""
    w = sorted(w, key=lambda r: r.arrival_step)
    res = simulate(
        w, paged(num_slots=192, block_size=block_size, max_model_len=64, snapshot_step=step)
    )
    assert res.report.completed == len(w)
    if res.snapshot is not None:
        written = sum(1 for s in res.snapshot if s >= 0)
        assert res.live[step] == written
        assert res.held[step] == written + res.snapshot.count(RESERVED)


def test_final_check_requires_every_block_free() -> None:
    be = PagedBackend(num_slots=64, block_size=16)
    g = Group(0, R(0, 20, 5))
    assert be.try_admit(g)
    be.check()  # consistent while held
    with pytest.raises(AssertionError, match="still held"):
        be.check(final=True)
    be.release(g)
    be.check(final=True)
    assert be.kv.num_free_blocks == be.kv.num_blocks
