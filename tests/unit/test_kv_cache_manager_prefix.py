"""KVCacheManager prefix caching: hits, verification, salts, LRU eviction, abort accounting."""

from __future__ import annotations

import pytest
from helpers import CheckedKVCacheManager

from pagedserve.scheduler import block_hash
from pagedserve.scheduler.kv_cache_manager import (
    AllocationResult,
    PrefixCacheStats,
)

Checked = CheckedKVCacheManager


def run_prompt(m: Checked, seq: str, tokens: list[int], salt: str | None = None) -> list[int]:
    """Admit a sequence like the scheduler does: lookup, allocate, compute, cache."""
    hit, _ = m.get_computed_blocks(tokens, salt)
    assert m.allocate_slots(seq, len(tokens), hit) is not None
    m.cache_blocks(seq, tokens, len(tokens), salt)
    return hit


P40 = list(range(100, 140))


def test_second_request_hits_all_full_blocks_but_the_last_tokens():
    m = Checked(10, 16)
    assert run_prompt(m, "a", P40) == []
    assert m.num_cached_blocks == 2  # blocks 0, 1 full; block 2 holds 8 tokens
    hit, n = m.get_computed_blocks(P40)
    assert (hit, n) == ([0, 1], 32)
    r = m.allocate_slots("b", 40, hit)
    assert r == AllocationResult([0, 1, 3], [], False, 0)
    assert [m.get_ref_count(i) for i in range(4)] == [2, 2, 1, 1]


def test_prompt_of_whole_blocks_never_hits_its_last_block():
    m = Checked(10, 16)
    p48 = list(range(48))
    run_prompt(m, "a", p48)
    assert m.num_cached_blocks == 3
    assert m.get_computed_blocks(p48) == ([0, 1], 32)  # block 2 holds the last token
    assert m.get_computed_blocks(p48 + [7]) == ([0, 1, 2], 48)
    assert m.get_computed_blocks([]) == ([], 0)
    assert m.get_computed_blocks(p48[:1]) == ([], 0)


def test_hit_revives_freed_cached_blocks():
    m = Checked(6, 16)
    run_prompt(m, "a", P40)
    m.free("a")
    assert m.num_free_blocks == 6 and m.num_cached_blocks == 2
    hit = run_prompt(m, "b", P40)
    assert hit == [0, 1]
    assert m.get_block_ids("b") == [0, 1, 2]
    assert m.num_free_blocks == 3


def test_revived_blocks_are_not_evicted_by_the_same_allocation():
    m = Checked(3, 4)
    p = list(range(9))
    run_prompt(m, "a", p)
    m.free("a")  # queue: [2 (uncached), 1, 0]
    assert m.num_blocks_needed(None, 9, [0, 1]) == 3
    assert run_prompt(m, "b", p) == [0, 1]
    assert m.get_block_ids("b") == [0, 1, 2]


def test_stats_count_tokens_and_reset():
    m = Checked(10, 16)
    run_prompt(m, "a", P40)
    run_prompt(m, "b", P40)
    assert m.prefix_cache_stats == PrefixCacheStats(queries_tokens=80, hits_tokens=32)
    assert m.prefix_cache_stats.hit_rate == pytest.approx(0.4)
    m.reset_prefix_cache_stats()
    assert m.prefix_cache_stats == PrefixCacheStats(0, 0)
    assert m.prefix_cache_stats.hit_rate == 0.0


def test_weak_polynomial_collision_does_not_hit():
    base = list(range(1, 17))
    other = list(base)
    other[3] += 31
    other[4] -= 1
    assert sum(t * 31**j for j, t in enumerate(base)) == sum(t * 31**j for j, t in enumerate(other))
    m = Checked(10, 16)
    run_prompt(m, "a", base + [0])
    assert m.get_computed_blocks(base + [0]) == ([0], 16)
    assert m.get_computed_blocks(other + [0]) == ([], 0)


def test_a_real_hash_collision_never_shares_wrong_kv(monkeypatch):
    def weak(parent, token_ids, extra_keys=()):
        return sum(t * 31**j for j, t in enumerate(token_ids)).to_bytes(32, "little")

    monkeypatch.setattr(block_hash, "hash_block_tokens", weak)
    base = list(range(1, 5))
    other = [1, 2 + 31, 3 - 1, 4]
    assert weak(None, base) == weak(None, other)
    m = Checked(10, 4)
    run_prompt(m, "a", base + [0])
    assert m.get_computed_blocks(base + [0]) == ([0], 4)
    assert m.get_computed_blocks(other + [0]) == ([], 0)  # same hash, other tokens: miss
    run_prompt(m, "b", other + [0])  # its block stays uncached: the hash is taken
    assert m.get_block_ids("b") == [2, 3]
    assert m.num_cached_blocks == 1


def test_cache_salt_isolates_requests():
    m = Checked(12, 16)
    run_prompt(m, "a", P40, salt="tenant-1")
    assert m.get_computed_blocks(P40) == ([], 0)
    assert m.get_computed_blocks(P40, "tenant-2") == ([], 0)
    assert m.get_computed_blocks(P40, "tenant-1") == ([0, 1], 32)
    run_prompt(m, "b", P40)
    assert m.get_computed_blocks(P40) == ([3, 4], 32)


def test_pools_of_other_kv_dtypes_never_share_a_hit():
    fp32 = Checked(12, 16, kv_cache_dtype="float32")
    bf16 = Checked(12, 16, kv_cache_dtype="bfloat16")
    run_prompt(fp32, "a", P40)
    run_prompt(bf16, "a", P40)
    assert fp32.get_computed_blocks(P40) == ([0, 1], 32)
    # The same pool looked up as another dtype (the hashes a bf16 pool computes): no hit.
    fp32.m.kv_cache_dtype = "bfloat16"
    assert fp32.get_computed_blocks(P40) == ([], 0)
    fp32.m.kv_cache_dtype = ""
    assert fp32.get_computed_blocks(P40) == ([], 0)
    fp32.m.kv_cache_dtype = "float32"
    assert fp32.get_computed_blocks(P40) == ([0, 1], 32)
    want = block_hash.hash_full_blocks(P40, 16, 2, kv_cache_dtype="bfloat16")
    assert bf16.m._seqs["a"].block_hashes == want


def test_caching_disabled():
    m = Checked(10, 16, enable_prefix_caching=False)
    run_prompt(m, "a", P40)
    assert m.num_cached_blocks == 0
    assert m.get_computed_blocks(P40) == ([], 0)
    assert m.prefix_cache_stats == PrefixCacheStats(0, 0)
    m.free("a")
    assert m.num_free_blocks == 10


def test_cache_blocks_is_incremental_and_bounded_by_computed_tokens():
    m = Checked(10, 4)
    tokens = list(range(12))
    m.allocate_slots("a", 12)
    m.cache_blocks("a", tokens, 3)
    assert m.num_cached_blocks == 0
    m.cache_blocks("a", tokens, 6)
    assert m.num_cached_blocks == 1
    m.cache_blocks("a", tokens, 100)  # clamped to the 12 reserved slots
    assert m.num_cached_blocks == 3
    with pytest.raises(KeyError):
        m.cache_blocks("nope", tokens, 4)


def test_decode_outputs_are_cached_and_resume_after_preemption_hits():
    m = Checked(10, 4)
    prompt = [5, 6, 7, 8, 9, 10]
    run_prompt(m, "a", prompt)
    tokens = list(prompt)
    for t in range(20, 26):  # decode six tokens one at a time
        tokens.append(t)
        m.allocate_slots("a", len(tokens))
        m.cache_blocks("a", tokens, len(tokens))
    assert m.get_block_ids("a") == [0, 1, 2]
    m.free("a")  # recompute preemption
    assert len(tokens) == 12
    assert m.get_computed_blocks(tokens) == ([0, 1], 8)  # never the block of the last token
    assert m.get_computed_blocks(tokens + [99]) == ([0, 1, 2], 12)  # output blocks hit too


def test_same_prompt_computed_twice_concurrently_caches_once():
    m = Checked(10, 4)
    p = list(range(9))
    m.allocate_slots("a", 9)
    m.allocate_slots("b", 9)
    m.cache_blocks("a", p, 9)
    m.cache_blocks("b", p, 9)  # duplicates stay uncached
    assert m.num_cached_blocks == 2
    m.free("b")
    m.free("a")
    assert m.get_computed_blocks(p) == ([0, 1], 8)


def test_forked_children_share_hashes():
    m = Checked(10, 4)
    p = list(range(6))
    run_prompt(m, "p", p)
    m.fork("p", "c")
    tokens = p + [50, 51]
    m.allocate_slots("c", 8)
    m.cache_blocks("c", tokens, 8)
    assert m.get_block_ids("c") == [0, 2]
    assert m.get_computed_blocks(tokens + [1]) == ([0, 2], 8)


def test_lru_most_recently_freed_prefix_survives():
    m = Checked(6, 4)
    pa = [1] * 9
    pb = [2] * 9
    run_prompt(m, "a", pa)  # blocks 0, 1, 2
    m.free("a")
    run_prompt(m, "b", pb)  # reuses uncached 2 first, then 3, 4
    assert m.get_block_ids("b") == [2, 3, 4]
    m.free("b")
    assert m.num_cached_blocks == 4
    run_prompt(m, "c", [3] * 16)  # four new blocks: evicts all of a, none of b
    assert m.get_block_ids("c") == [4, 5, 1, 0]
    assert m.get_computed_blocks(pa) == ([], 0)
    assert m.get_computed_blocks(pb) == ([2, 3], 8)


def test_suffix_is_evicted_before_prefix():
    m = Checked(4, 4)
    pa = list(range(13))
    run_prompt(m, "a", pa)  # blocks 0..3, 0..2 cached
    m.free("a")
    m.allocate_slots("x", 4)  # takes the uncached block 3
    assert m.get_computed_blocks(pa) == ([0, 1, 2], 12)
    m.allocate_slots("y", 4)  # evicts the suffix block 2
    assert m.get_block_ids("y") == [2]
    assert m.get_computed_blocks(pa) == ([0, 1], 8)
    m.allocate_slots("z", 4)
    assert m.get_computed_blocks(pa) == ([0], 4)


def _state_fresh(m: Checked) -> None:
    m.allocate_slots("r", 10)


def _state_cached(m: Checked) -> None:
    run_prompt(m, "r", list(range(10)))


def _state_hit(m: Checked) -> None:
    run_prompt(m, "warm", list(range(10)))
    run_prompt(m, "r", list(range(10)))
    m.free("warm")


def _state_forked_cow(m: Checked) -> None:
    run_prompt(m, "p", list(range(10)))
    m.fork("p", "r")
    m.allocate_slots("r", 11)  # copy-on-write
    m.free("p")


def _state_waiting(m: Checked) -> None:
    m.allocate_slots("big", 4 * m.num_free_blocks)
    assert m.allocate_slots("r", 8) is None  # the pool is full: r waits, holds nothing
    m.free("big")
    m.allocate_slots("r", 0)


@pytest.mark.parametrize(
    "setup", [_state_fresh, _state_cached, _state_hit, _state_forked_cow, _state_waiting]
)
def test_abort_in_any_state_restores_the_free_count(setup):
    m = Checked(16, 4)
    run_prompt(m, "other", [9] * 7)  # an unrelated request keeps running
    baseline = m.num_free_blocks
    setup(m)
    m.free("r")
    assert m.num_free_blocks == baseline
    m.free("other")
    assert m.num_free_blocks == 16 and m.usage == 0.0


def test_at_idle_free_plus_evictable_plus_held_is_the_pool():
    m = Checked(32, 4)
    shared = list(range(12))
    for i in range(4):
        run_prompt(m, f"r{i}", shared + [100 + i] * (i + 2))
    m.fork("r0", "r0b")
    used = m.num_blocks - m.num_free_blocks
    assert used == round(m.usage * m.num_blocks)
    for seq in ["r0", "r0b", "r1", "r2", "r3"]:
        m.free(seq)
    assert m.num_free_blocks == 32 and m.usage == 0.0
    assert 0 < m.num_cached_blocks <= m.num_free_blocks


def test_reset_prefix_cache():
    m = Checked(8, 4)
    run_prompt(m, "a", list(range(9)))
    assert not m.reset_prefix_cache()
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.num_cached_blocks == 0
    assert m.get_computed_blocks(list(range(9))) == ([], 0)
