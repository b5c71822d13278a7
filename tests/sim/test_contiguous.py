"""Unit tests of the contiguous (pre-PagedAttention) KV allocator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.sim.contiguous import ContiguousAllocator, ContiguousRun


def test_first_fit_exact_offsets() -> None:
    a = ContiguousAllocator(100, 100)
    assert a.allocate("a", 40) == ContiguousRun(0, 40, 0)
    assert a.allocate("b", 20) == ContiguousRun(40, 20, 0)
    assert a.allocate("c", 15) == ContiguousRun(60, 15, 0)
    assert a.free_runs() == [(75, 25)]
    a.free("a")
    assert a.free_runs() == [(0, 40), (75, 25)]
    # First fit: the lowest address that fits (best fit would take the tighter 75..100).
    assert a.allocate("d", 12).start == 0
    assert a.free_runs() == [(12, 28), (75, 25)]
    # 30 does not fit in 12..40 nor 75..100.
    assert a.allocate("e", 30) is None
    assert a.allocate("e", 25).start == 12
    assert a.free_runs() == [(37, 3), (75, 25)]
    assert a.get_run("e") == ContiguousRun(12, 25, 0)
    a.check_integrity()


def test_external_fragmentation_total_free_enough_but_no_run() -> None:
    a = ContiguousAllocator(100, 100)
    for i, name in enumerate("abcd"):
        assert a.allocate(name, 25).start == 25 * i
    a.free("a")
    a.free("c")
    assert a.num_free_slots == 50
    assert a.largest_free_run == 25
    before = a.free_runs()
    assert a.allocate("x", 40) is None  # 50 free slots, but no 40-slot run
    assert a.free_runs() == before  # no state change on failure
    assert a.find_fit(40) is None
    assert a.unusable_free_slots(40) == 50
    assert a.unusable_free_slots(25) == 0
    a.check_integrity()
    # Freeing b merges 0..75 into one run; now 40 fits at 0.
    a.free("b")
    assert a.free_runs() == [(0, 75)]
    assert a.allocate("x", 40).start == 0
    a.check_integrity()


def test_merge_with_both_neighbours() -> None:
    a = ContiguousAllocator(30, 30)
    for name in "abc":
        a.allocate(name, 10)
    a.free("a")
    a.free("c")
    assert a.free_runs() == [(0, 10), (20, 10)]
    a.free("b")
    assert a.free_runs() == [(0, 30)]
    assert a.num_free_slots == 30
    a.check_integrity()


def test_reservation_modes() -> None:
    full = ContiguousAllocator(10_000, 2048, reserve="max_model_len")
    assert full.reservation_size(100, 50) == 2048
    assert full.reservation_size(100) == 2048
    cap = ContiguousAllocator(10_000, 2048, reserve="max_tokens")
    assert cap.reservation_size(100, 50) == 150
    assert cap.reservation_size(2000, 100) == 2048  # capped at max_model_len
    assert cap.reservation_size(100, None) == 2048  # no client cap
    with pytest.raises(ValueError, match="prompt_len"):
        cap.reservation_size(0, 5)
    with pytest.raises(ValueError, match="prompt_len"):
        cap.reservation_size(2049, 5)
    with pytest.raises(ValueError, match="max_tokens"):
        cap.reservation_size(10, 0)


def test_tokens_usage_and_internal_waste() -> None:
    a = ContiguousAllocator(100, 64)
    a.allocate("a", 64)
    assert a.append_slots("a", 40).num_tokens == 40
    assert a.num_live_tokens == 40
    assert a.num_reserved_slots == 64
    assert a.usage == pytest.approx(0.64)
    assert a.append_slots("a", 41).num_tokens == 41
    with pytest.raises(ValueError, match="num_total_tokens"):
        a.append_slots("a", 65)  # beyond the reservation: a run cannot grow
    with pytest.raises(ValueError, match="num_total_tokens"):
        a.append_slots("a", 10)  # shrinking
    a.free("a")
    assert a.num_live_tokens == 0 and a.num_free_slots == 100
    a.check_integrity()


def test_errors() -> None:
    with pytest.raises(ValueError, match="reserve"):
        ContiguousAllocator(10, 10, reserve="pow2")
    with pytest.raises(ValueError, match="num_slots"):
        ContiguousAllocator(0, 10)
    a = ContiguousAllocator(10, 10)
    a.allocate("a", 5)
    with pytest.raises(ValueError, match="already"):
        a.allocate("a", 1)
    with pytest.raises(ValueError, match="length"):
        a.allocate("b", 0)
    with pytest.raises(KeyError):
        a.free("nope")
    a.free("a")
    with pytest.raises(KeyError):
        a.free("a")


def test_check_integrity_detects_corruption() -> None:
    a = ContiguousAllocator(20, 20)
    a.allocate("a", 5)
    a._free_lens[0] += 1  # overlap past the pool end
    with pytest.raises(AssertionError):
        a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24)), max_size=60))
def test_matches_bitmap_first_fit_model(ops: list[tuple[bool, int]]) -> None:
    """Against a brute-force bitmap first-fit, after every operation."""
    n = 64
    a = ContiguousAllocator(n, n)
    used = [False] * n
    live: dict[str, tuple[int, int]] = {}
    for i, (do_alloc, size) in enumerate(ops):
        if do_alloc or not live:
            expected = next((s for s in range(n - size + 1) if not any(used[s : s + size])), None)
            run = a.allocate(f"s{i}", size)
            assert (run.start if run else None) == expected
            if run:
                live[f"s{i}"] = (run.start, size)
                used[run.start : run.start + size] = [True] * size
        else:
            victim = sorted(live)[size % len(live)]
            start, length = live.pop(victim)
            a.free(victim)
            used[start : start + length] = [False] * length
        a.check_integrity()
        assert a.num_free_slots == used.count(False)
