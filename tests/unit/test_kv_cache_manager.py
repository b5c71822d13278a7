"""KVCacheManager: allocation, growth, fork / copy-on-write, free, errors, the PagedAttention paper's examples.

Every test drives the manager through ``Checked``, which runs ``check_integrity()`` after
every call.
"""

from __future__ import annotations

import random

import pytest
from helpers import CheckedKVCacheManager

from pagedserve.scheduler.kv_cache_manager import (
    AllocationResult,
    IntegrityError,
    KVCacheManager,
)

Checked = CheckedKVCacheManager


def refs(m: Checked, block_ids) -> list[int]:
    return [m.m.get_ref_count(b) for b in block_ids]


# ------------------------------------------------------------------------------ basics
@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 16), (-3, 16), (8, 0), (8, -1), (8, 2.0), (None, 16)]
)
def test_bad_sizes_raise(num_blocks, block_size):
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks, block_size)


def test_fresh_manager():
    m = Checked(10, 16)
    assert (m.num_blocks, m.block_size, m.num_free_blocks, m.usage) == (10, 16, 10, 0.0)
    assert not m.has_seq("a")


def test_forty_tokens_take_three_blocks_wasting_eight_slots():
    m = Checked(10, 16)
    r = m.allocate_slots("a", 40)
    assert r == AllocationResult([0, 1, 2], [], False, 0)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert len(m.get_block_ids("a")) * 16 - 40 == 8
    assert m.num_free_blocks == 7 and m.usage == pytest.approx(0.3)
    assert refs(m, [0, 1, 2]) == [1, 1, 1]


def test_growth_is_one_block_at_a_time():
    m = Checked(10, 4)
    assert m.allocate_slots("a", 4).new_block_ids == [0]
    r = m.allocate_slots("a", 5)
    assert r == AllocationResult([1], [], False, 1)
    assert m.allocate_slots("a", 8) == AllocationResult([], [], False, 2)
    assert m.allocate_slots("a", 8) == AllocationResult([], [], False, 2)
    assert m.allocate_slots("a", 17).new_block_ids == [2, 3, 4]
    assert m.get_block_ids("a") == [0, 1, 2, 3, 4]
    assert m.get_num_tokens("a") == 17
    with pytest.raises(ValueError, match="shrink"):
        m.allocate_slots("a", 16)


def test_zero_tokens_and_negative():
    m = Checked(4, 4)
    assert m.allocate_slots("a", 0) == AllocationResult([], [], False, 0)
    assert m.has_seq("a") and m.get_block_ids("a") == []
    assert m.allocate_slots("a", 1).new_block_ids == [0]
    with pytest.raises(ValueError):
        m.allocate_slots("b", -1)


def test_get_block_ids_returns_a_copy():
    m = Checked(4, 4)
    m.allocate_slots("a", 4)
    m.get_block_ids("a").append(99)
    assert m.get_block_ids("a") == [0]


def test_out_of_blocks_returns_none_without_state_change():
    m = Checked(4, 16)
    m.allocate_slots("a", 48)
    assert m.allocate_slots("b", 33) is None
    assert not m.has_seq("b") and m.num_free_blocks == 1
    assert m.allocate_slots("a", 80) is None
    assert m.get_block_ids("a") == [0, 1, 2] and m.get_num_tokens("a") == 48
    assert m.allocate_slots("a", 64).new_block_ids == [3]
    assert m.num_free_blocks == 0
    assert m.allocate_slots("b", 1) is None
    assert m.allocate_slots("b", 0) is not None  # needs no block


def test_free_returns_blocks_and_errors():
    m = Checked(8, 4)
    m.allocate_slots("a", 8)
    m.allocate_slots("b", 8)
    m.free("a")
    assert not m.has_seq("a") and m.num_free_blocks == 6
    with pytest.raises(KeyError):
        m.free("a")  # double free of a sequence
    with pytest.raises(KeyError):
        m.free("nope")
    with pytest.raises(KeyError):
        m.get_block_ids("a")
    # uncached freed blocks are reused first, in order
    assert m.allocate_slots("c", 8).new_block_ids == [0, 1]


def test_block_level_double_free_raises_loudly():
    m = KVCacheManager(4, 4)
    m.allocate_slots("a", 4)
    m.free("a")
    blk = m._pool.blocks[0]
    with pytest.raises(IntegrityError, match="double free"):
        m._pool.release(blk)


def test_integrity_catches_a_wrong_ref_count():
    m = KVCacheManager(4, 4)
    m.allocate_slots("a", 4)
    m._pool.blocks[0].ref_count = 2
    with pytest.raises(IntegrityError, match="ref_count 2"):
        m.check_integrity()
    assert issubclass(IntegrityError, AssertionError)


def test_integrity_catches_a_table_of_the_wrong_length():
    m = KVCacheManager(4, 4)
    m.allocate_slots("a", 4)
    m._seqs["a"].num_tokens = 5
    with pytest.raises(IntegrityError, match="blocks for 5 tokens"):
        m.check_integrity()


# ---------------------------------------------------------------------- fork and CoW
def test_ten_samples_of_a_200_token_prompt_share_13_blocks():
    m = Checked(200, 16)
    m.allocate_slots("s0", 200)
    for i in range(1, 10):
        m.fork("s0", f"s{i}")
    assert m.used() == 13  # not 130
    assert refs(m, range(13)) == [10] * 13
    assert all(m.get_block_ids(f"s{i}") == list(range(13)) for i in range(10))


def test_one_diverging_sample_costs_one_block_and_one_copy():
    m = Checked(200, 16)
    m.allocate_slots("s0", 200)
    for i in range(1, 10):
        m.fork("s0", f"s{i}")
    free_before = m.num_free_blocks
    r = m.allocate_slots("s3", 201)  # writes token 201 into the shared 8/16-full block 12
    assert r == AllocationResult([13], [(12, 13)], True, 12)
    assert m.num_free_blocks == free_before - 1
    assert m.get_block_ids("s3") == list(range(12)) + [13]
    assert m.get_block_ids("s0") == list(range(13))
    assert refs(m, [11, 12, 13]) == [10, 9, 1]
    # the writer now owns its last block: no further copies
    assert m.allocate_slots("s3", 202) == AllocationResult([], [], False, 13)


def test_last_holder_writes_in_place():
    m = Checked(200, 16)
    m.allocate_slots("s0", 200)
    for i in range(1, 10):
        m.fork("s0", f"s{i}")
    copies = []
    for i in range(10):
        copies += m.allocate_slots(f"s{i}", 201).blocks_to_copy
    assert len(copies) == 9 and all(src == 12 for src, _ in copies)
    assert m.used() == 13 + 9
    assert m.get_block_ids("s9") == list(range(13))  # the last one kept the original


def test_four_samples_of_a_1000_token_prompt_use_63_blocks():
    m = Checked(300, 16)
    m.allocate_slots("s0", 1000)
    for i in range(1, 4):
        m.fork("s0", f"s{i}")
    assert m.used() == 63 == -(-1000 // 16)


def test_fork_at_block_boundary_needs_no_copy():
    m = Checked(8, 16)
    m.allocate_slots("p", 32)
    m.fork("p", "c")
    assert m.allocate_slots("c", 33) == AllocationResult([2], [], False, 2)
    assert m.allocate_slots("p", 33) == AllocationResult([3], [], False, 2)
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]


def test_copy_on_write_and_growth_in_one_call():
    m = Checked(8, 16)
    m.allocate_slots("p", 20)
    m.fork("p", "c")
    table = m.get_block_ids("c")
    r = m.allocate_slots("c", 40)
    assert r == AllocationResult([2, 3], [(1, 2)], True, 1)
    r.apply_to(table)
    assert table == m.get_block_ids("c") == [0, 2, 3]
    with pytest.raises(ValueError):
        r.apply_to([0])


def test_copy_on_write_without_room_changes_nothing():
    m = Checked(2, 16)
    m.allocate_slots("p", 20)
    m.fork("p", "c")
    assert m.num_blocks_needed("c", 21) == 1
    assert m.allocate_slots("c", 21) is None  # 0 free, CoW needs 1
    assert m.get_block_ids("c") == [0, 1] and m.get_num_tokens("c") == 20
    assert refs(m, [0, 1]) == [2, 2]
    m.free("p")
    assert m.num_blocks_needed("c", 21) == 0
    assert m.allocate_slots("c", 21) == AllocationResult([], [], False, 2)  # sole owner


def test_fork_errors_and_free_of_shared_blocks():
    m = Checked(8, 4)
    m.allocate_slots("p", 6)
    with pytest.raises(KeyError):
        m.fork("nope", "c")
    m.fork("p", "c")
    with pytest.raises(ValueError):
        m.fork("p", "c")
    m.free("p")
    assert m.num_free_blocks == 6  # still held by c
    assert refs(m, [0, 1]) == [1, 1]
    m.free("c")
    assert m.num_free_blocks == 8


def test_fork_a_head_of_the_table():
    m = Checked(8, 4)
    m.allocate_slots("p", 10)  # blocks 0, 1 full; 2 holds 2
    m.cache_blocks("p", list(range(10)), 10)
    m.fork("p", "c", 7)  # [0, 7): blocks 0 and 1, the child reserves 3 slots of block 1
    assert m.get_block_ids("c") == [0, 1] and m.get_num_tokens("c") == 7
    assert refs(m, [0, 1, 2]) == [2, 2, 1]
    # Recomputing slot 6 writes into shared block 1: copied first.
    assert m.allocate_slots("c", 8) == AllocationResult([3], [(1, 3)], True, 1)
    m.fork("p", "d", 8)  # exactly two blocks: no copy when d writes slot 8
    assert m.allocate_slots("d", 9) == AllocationResult([4], [], False, 2)
    assert refs(m, [0, 1, 2, 3, 4]) == [3, 2, 1, 1, 1]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="num_tokens"):
            m.fork("p", "e", bad)
    assert not m.has_seq("e")


def test_num_blocks_needed_matches_allocation():
    m = Checked(16, 4)
    assert m.num_blocks_needed(None, 9) == 3
    assert m.num_blocks_needed("unknown", 0) == 0
    m.allocate_slots("a", 9)
    assert m.num_blocks_needed("a", 9) == 0
    assert m.num_blocks_needed("a", 12) == 0
    assert m.num_blocks_needed("a", 13) == 1
    m.fork("a", "b")
    assert m.num_blocks_needed("b", 10) == 1  # copy-on-write
    assert m.num_blocks_needed("b", 13) == 2
    free = m.num_free_blocks
    m.allocate_slots("b", 13)
    assert m.num_free_blocks == free - 2


def test_computed_block_argument_errors():
    m = Checked(8, 4)
    m.allocate_slots("a", 8)
    with pytest.raises(ValueError, match="exists"):
        m.allocate_slots("a", 12, [0])
    with pytest.raises(ValueError, match="not a cached block"):
        m.allocate_slots("b", 12, [0])  # block 0 is uncached
    with pytest.raises(ValueError, match="not a cached block"):
        m.allocate_slots("b", 12, [99])
    m.cache_blocks("a", list(range(8)), 8)
    with pytest.raises(ValueError, match="repeated"):
        m.allocate_slots("b", 12, [0, 0])
    with pytest.raises(ValueError, match="cover more"):
        m.allocate_slots("b", 7, [0, 1])
    assert not m.has_seq("b")


def test_usage_counts_referenced_blocks():
    m = Checked(4, 4)
    m.allocate_slots("a", 8)
    m.fork("a", "b")
    assert m.usage == 0.5
    m.free("a")
    m.free("b")
    assert m.usage == 0.0


# ------------------------------------------------------------------------------ decode fast path
def test_grow_in_place_takes_only_the_empty_delta():
    m = Checked(10, 4)
    assert m.grow_in_place("a", 3) == -1  # unknown sequence
    m.allocate_slots("a", 5)  # blocks 0, 1; 5 of 8 slots
    assert m.grow_in_place("a", 5) == -1  # nothing to reserve
    assert m.grow_in_place("a", 4) == -1  # shrinking: allocate_slots raises
    assert m.grow_in_place("a", 7) == 2 and m.get_num_tokens("a") == 7
    assert m.grow_in_place("a", 8) == 2 and m.get_num_tokens("a") == 8
    assert m.grow_in_place("a", 9) == -1  # a new block
    assert (m.get_num_tokens("a"), m.get_block_ids("a"), m.num_free_blocks) == (8, [0, 1], 8)
    m.fork("a", "b", 6)  # b shares blocks 0 and 1; its last one is 2/4 reserved
    assert m.grow_in_place("b", 7) == -1  # would write into a shared block: copy-on-write
    assert m.get_num_tokens("b") == 6
    assert m.allocate_slots("b", 7) == AllocationResult([2], [(1, 2)], True, 1)
    assert m.grow_in_place("b", 8) == 2  # its own copy now


def test_grow_in_place_then_allocate_equals_allocate_alone():
    """A scheduler that tries grow_in_place first (the decode fast path) leaves every table,
    reference count and delta exactly as allocate_slots alone does, through growth, forks,
    copy-on-write, running out of blocks and frees."""
    rng = random.Random(7)
    fast, slow = Checked(24, 4), Checked(24, 4)
    live: list[str] = []
    num_fast = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.1 or not live:
            sid = f"s{step}"
            n = rng.randint(1, 9)
            assert (fast.allocate_slots(sid, n) is None) == (slow.allocate_slots(sid, n) is None)
            if fast.has_seq(sid):
                live.append(sid)
        elif op < 0.15:
            parent = rng.choice(live)
            sid = f"s{step}"
            n = rng.randint(1, slow.get_num_tokens(parent) or 1)
            if slow.get_num_tokens(parent) >= 1:
                fast.fork(parent, sid, n)
                slow.fork(parent, sid, n)
                live.append(sid)
        elif op < 0.22:
            sid = live.pop(rng.randrange(len(live)))
            fast.free(sid)
            slow.free(sid)
        else:
            sid = rng.choice(live)
            n = slow.get_num_tokens(sid) + rng.choice([1, 1, 1, 1, 2, 5])
            start = fast.grow_in_place(sid, n)
            expected = slow.allocate_slots(sid, n)
            if start >= 0:
                num_fast += 1
                assert expected == AllocationResult([], [], False, start)
            else:
                assert fast.allocate_slots(sid, n) == expected
                assert expected is None or expected.new_block_ids or expected.blocks_to_copy
        for sid in live:
            assert fast.get_block_ids(sid) == slow.get_block_ids(sid)
            assert fast.get_num_tokens(sid) == slow.get_num_tokens(sid)
        assert fast.num_free_blocks == slow.num_free_blocks
    assert num_fast > 500  # the fast path was taken, and not always
    assert all(fast.get_usage(s) == slow.get_usage(s) for s in live)


def test_get_usage_counts_blocks_held_alone():
    m = Checked(10, 4)
    assert m.get_usage("a") == (0, 0)  # no table
    m.allocate_slots("a", 6)  # blocks 0, 1
    assert m.get_usage("a") == (2, 6)
    m.fork("a", "b", 6)  # both blocks shared
    assert (m.get_usage("a"), m.get_usage("b")) == ((0, 6), (0, 6))
    m.allocate_slots("b", 7)  # b copies block 1 into block 2
    assert (m.get_usage("a"), m.get_usage("b")) == ((1, 6), (1, 7))
    m.free("a")
    assert m.get_usage("b") == (2, 7)
