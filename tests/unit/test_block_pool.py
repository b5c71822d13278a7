"""BlockPool and FreeBlockQueue: O(1) queue ops, ref counts, LRU eviction, integrity."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.block_hash import hash_block_tokens
from pagedserve.scheduler.block_pool import Block, BlockPool, FreeBlockQueue
from pagedserve.scheduler.errors import IntegrityError


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def refs_of(pool: BlockPool) -> list[int]:
    return [b.ref_count for b in pool.blocks]


def cache(pool: BlockPool, block: Block, tokens: tuple[int, ...], parent=None) -> bytes:
    h = hash_block_tokens(parent, tokens, ())
    assert pool.cache_block(block, h, parent, tokens, ())
    return h


# ----------------------------------------------------------------------------- queue
def test_queue_order_and_middle_removal():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    assert 2 not in q and 3 in q
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 1, 3, 4, 0]
    assert len(q) == 5


def test_queue_errors():
    b = Block(0)
    q = FreeBlockQueue()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(IntegrityError):
        q.remove(b)
    q.append(b)
    with pytest.raises(IntegrityError):
        q.append(b)
    with pytest.raises(IntegrityError):
        q.appendleft(b)


# ------------------------------------------------------------------------------ pool
@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 16), (-1, 16), (4, 0), (4, 1.5), (True, 16), (4, "16")]
)
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_allocate_release_ref_counts():
    pool = BlockPool(4, 2)
    got = pool.allocate(3)
    assert ids(got) == [0, 1, 2]
    assert refs_of(pool) == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    pool.touch(got[1])
    assert refs_of(pool) == [1, 2, 1, 0]
    pool.release(got[1])
    assert pool.num_free_blocks == 1  # still referenced: not freed
    pool.check_integrity([1, 1, 1, 0])
    pool.release(got[1])
    assert ids(pool.free_queue) == [1, 3]  # uncached: to the head
    with pytest.raises(IntegrityError, match="double free"):
        pool.release(got[1])
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2  # failed allocate changed nothing
    pool.check_integrity([1, 0, 1, 0])


def test_cached_blocks_go_to_tail_and_are_evicted_lru():
    pool = BlockPool(4, 2)
    a, b, _c = pool.allocate(3)
    ha = cache(pool, a, (1, 2))
    cache(pool, b, (3, 4), parent=ha)
    pool.release(b)
    pool.release(a)
    assert ids(pool.free_queue) == [3, 1, 0]
    assert pool.num_cached_blocks == 2
    pool.check_integrity([0, 0, 1, 0])
    (x,) = pool.allocate(1)
    assert x.block_id == 3 and pool.num_cached_blocks == 2
    (y,) = pool.allocate(1)
    assert y is b and b.block_hash is None and pool.num_cached_blocks == 1  # evicted
    assert pool.lookup(ha, None, (1, 2), ()) is a
    pool.check_integrity([0, 1, 1, 1])


def test_touch_revives_cached_block_from_middle():
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    h = cache(pool, blocks[1], (7, 7))
    for blk in blocks:
        pool.release(blk)
    assert ids(pool.free_queue) == [2, 0, 1]  # uncached to the head, cached to the tail
    pool.touch(blocks[1])
    assert ids(pool.free_queue) == [2, 0]
    assert blocks[1].ref_count == 1 and blocks[1].block_hash == h
    pool.check_integrity([0, 1, 0])


def test_lookup_compares_content_not_only_hash():
    pool = BlockPool(2, 2)
    (blk,) = pool.allocate(1)
    h = cache(pool, blk, (1, 2))
    assert pool.lookup(h, None, (1, 2), ()) is blk
    assert pool.lookup(h, None, (1, 3), ()) is None  # same key, other tokens: a "collision"
    assert pool.lookup(h, b"\x00" * 32, (1, 2), ()) is None
    assert pool.lookup(h, None, (1, 2), ("salt",)) is None
    assert pool.lookup(b"\x01" * 32, None, (1, 2), ()) is None


def test_cache_block_duplicates_and_rehash():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    h = cache(pool, a, (1, 2))
    assert pool.cache_block(a, h, None, (1, 2), ())  # already this hash
    assert not pool.cache_block(b, h, None, (1, 2), ())  # duplicate content stays uncached
    assert b.block_hash is None
    other = hash_block_tokens(None, (5, 5))
    assert not pool.cache_block(a, other, None, (5, 5), ())  # a block keeps its first hash
    pool.check_integrity([1, 1, 0])


def test_reset_prefix_cache():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    cache(pool, a, (1, 2))
    assert not pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 1
    pool.release(a)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and a.block_hash is None
    pool.check_integrity([0, 0])


def test_integrity_detects_corruption():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    cache(pool, a, (1, 2))
    pool.check_integrity([1, 1, 0])
    with pytest.raises(IntegrityError, match="ref_count"):
        pool.check_integrity([2, 1, 0])
    a.token_ids = (1, 3)
    with pytest.raises(IntegrityError, match="do not match"):
        pool.check_integrity([1, 1, 0])
    a.token_ids = (1, 2)
    pool.free_queue.append(b)  # referenced and free at once
    with pytest.raises(IntegrityError, match="referenced and free"):
        pool.check_integrity([1, 1, 0])
    pool.free_queue.remove(b)
    pool.free_queue.remove(pool.blocks[2])  # ref 0 but lost from the queue: a leak
    with pytest.raises(IntegrityError, match="not free"):
        pool.check_integrity([1, 1, 0])


def test_queue_take_pops_the_head_in_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[1])
    assert q.take(0) == []
    assert [b.block_id for b in q.take(2)] == [0, 2]
    with pytest.raises(IndexError):
        q.take(3)  # two left: nothing taken
    assert ids(q) == [3, 4]
    assert q.take(2) == [blocks[3], blocks[4]] and len(q) == 0
