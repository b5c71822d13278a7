"""The scheduler's KV-cache block manager: block tables, copy-on-write, prefix caching.

Pure Python, no torch: the scheduler owns block *metadata*; workers own the tensors and apply
what :class:`AllocationResult` tells them (new block table entries, blocks to copy).

Sources: PagedAttention (Kwon et al., SOSP 2023) section 4.2 (block tables, on-demand
allocation), 4.3 (reference counts and copy-on-write for parallel sampling / beam search),
4.4 (shared prefixes); vLLM v1 ``KVCacheManager`` / ``BlockPool`` (hash full blocks only, never
the block holding the last prompt token; LRU eviction of ref-0 cached blocks; free a finished
request's blocks tail-first).

Slot semantics: ``allocate_slots(seq, n)`` reserves token slots ``[0, n)``. The manager
assumes that the slots reserved by earlier calls are written by the worker before the next
call for the same sequence (the scheduler only reserves what it schedules). Copy-on-write
keys on this: a call that extends a sequence whose last block is partially reserved and shared
(``ref_count > 1``) gives the sequence a private copy of that block first.

Hot-path cost: ``allocate_slots`` / ``cache_blocks`` are O(1) per step plus O(1) per new block
(one SHA-256 per block that became full); ``grow_in_place``, the decode step that stays in its
last block, builds no result object; ``free``/``fork`` are O(blocks of the sequence);
``get_computed_blocks`` is O(prompt blocks); ``check_integrity`` is O(pool + tables).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pagedserve.scheduler import block_hash as _bh
from pagedserve.scheduler.block_hash import BlockHash, extra_keys_for_block
from pagedserve.scheduler.block_pool import Block, BlockPool, EvictedBlock
from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.kv_cache_types import AllocationResult, PrefixCacheStats

__all__ = ["AllocationResult", "IntegrityError", "KVCacheManager", "PrefixCacheStats"]


class _SeqState:
    """One sequence's block table, reserved slot count and hash chain of its full blocks."""

    __slots__ = ("block_hashes", "blocks", "num_tokens")

    def __init__(self, blocks: list[Block], num_tokens: int, block_hashes: list[BlockHash]):
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.block_hashes = block_hashes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates KV-cache blocks to sequences, shares them by reference count, caches prefixes.

    Args:
        num_blocks: physical blocks in the pool (>= 1).
        block_size: token slots per block (>= 1; vLLM's default is 16).
        enable_prefix_caching: hash full blocks so later requests can reuse them.
        kv_cache_dtype: the pool's KV dtype name (e.g. ``"bfloat16"``), mixed into every
            block hash (``""``: none), so that equal prompts in pools of different dtypes
            hash apart and a block never moves to a pool that reads it as another dtype.
        track_evictions: keep the cached blocks that allocation evicts for
            :meth:`take_evicted` (the host tier of the prefix cache spills them).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` is not a positive int.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "",
        track_evictions: bool = False,
    ):
        self._pool = BlockPool(num_blocks, block_size, track_evictions and enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_cache_dtype = kv_cache_dtype
        self._seqs: dict[str, _SeqState] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-evictable (``ref_count == 0``)."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """KV-cache usage: fraction of blocks with ``ref_count > 0``, in ``[0, 1]``."""
        return (self.num_blocks - self._pool.num_free_blocks) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix-cache index (in use or evictable)."""
        return self._pool.num_cached_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Query / hit counters in tokens since construction or the last reset."""
        return PrefixCacheStats(self._queries_tokens, self._hits_tokens)

    def reset_prefix_cache_stats(self) -> None:
        """Zero the prefix-cache counters."""
        self._queries_tokens = 0
        self._hits_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (e.g. after a weight update). Only when nothing is in use.

        Returns:
            True on success; False, with nothing changed, while any block is referenced.
        """
        return self._pool.reset_prefix_cache()

    def has_seq(self, seq_id: str) -> bool:
        """Whether ``seq_id`` holds a block table (allocated and not yet freed)."""
        return seq_id in self._seqs

    def get_block_ids(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block table. Raises ``KeyError`` for an unknown seq."""
        return [b.block_id for b in self._seqs[seq_id].blocks]

    def get_ref_count(self, block_id: int) -> int:
        """Number of block tables holding physical block ``block_id``."""
        return self._pool.blocks[block_id].ref_count

    def get_num_tokens(self, seq_id: str) -> int:
        """Token slots reserved for the sequence. Raises ``KeyError`` for an unknown seq."""
        return self._seqs[seq_id].num_tokens

    def get_usage(self, seq_id: str) -> tuple[int, int]:
        """``(blocks only this sequence holds (ref_count 1), token slots reserved)``:
        what freeing it returns to the pool, and its table's extent; ``(0, 0)`` for a
        sequence that holds no table. O(table) with no copy (the admission projection
        asks it for every running sequence)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return 0, 0
        return [b.ref_count for b in seq.blocks].count(1), seq.num_tokens

    def num_blocks_needed(
        self, seq_id: str | None, num_total_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> int:
        """Blocks that :meth:`allocate_slots` would take from the free queue.

        ``allocate_slots(seq_id, num_total_tokens, computed_block_ids)`` succeeds exactly when
        this is ``<= num_free_blocks``. Counts new blocks, a copy-on-write block, and cached
        blocks at ``ref_count == 0`` that a prefix hit revives out of the free queue.

        Args:
            seq_id: an existing sequence, or ``None`` (or an unknown id) for a new one.
            num_total_tokens: token slots the table must cover.
            computed_block_ids: prefix-cache hits of a new sequence.
        """
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        bs = self.block_size
        if seq is None:
            blocks = self._pool.blocks
            revive = sum(1 for i in computed_block_ids if blocks[i].ref_count == 0)
            return max(0, _cdiv(num_total_tokens, bs) - len(computed_block_ids)) + revive
        if num_total_tokens <= seq.num_tokens:
            return 0
        cow = seq.num_tokens % bs != 0 and seq.blocks[-1].ref_count > 1
        return _cdiv(num_total_tokens, bs) - len(seq.blocks) + cow

    # --------------------------------------------------------------------------- prefix cache
    def get_computed_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None = None, count: bool = True
    ) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching a new sequence's prompt.

        Never covers the last token (its logits are needed), so at most
        ``(len(token_ids) - 1) // block_size`` blocks. Takes no references: call
        :meth:`allocate_slots` with the result before any other allocation. Every hit is
        verified against the stored token ids, so a hash collision cannot share wrong KV.

        Args:
            token_ids: the prompt (plus outputs when resuming a preempted sequence).
            cache_salt: only blocks cached with the same salt can hit.
            count: add this lookup to the prefix-cache stats; a caller that may retry
                the same lookup (a request blocked at the head of the queue) passes False
                and calls :meth:`record_prefix_query` once the sequence is admitted.

        Returns:
            ``(block_ids, num_computed_tokens)`` with ``num_computed_tokens =
            len(block_ids) * block_size``; ``([], 0)`` when caching is disabled (not counted).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        pool = self._pool
        hash_fn = _bh.hash_block_tokens
        out: list[int] = []
        parent: BlockHash | None = None
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            extra = extra_keys_for_block(i, cache_salt, self.kv_cache_dtype)
            h = hash_fn(parent, toks, extra)
            block = pool.lookup(h, parent, toks, extra)
            if block is None:
                break
            out.append(block.block_id)
            parent = h
        if count:
            self.record_prefix_query(len(token_ids), len(out) * bs)
        return out, len(out) * bs

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks evicted by allocations since the last call (see
        :meth:`BlockPool.take_evicted`; empty unless ``track_evictions``)."""
        return self._pool.take_evicted()

    def block_hash_of(self, block_id: int) -> BlockHash | None:
        """The prefix-cache hash of physical block ``block_id`` (None: not cached)."""
        return self._pool.blocks[block_id].block_hash

    def prefix_keys(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        start_block: int,
        parent_hash: BlockHash | None,
    ) -> Iterator[tuple[BlockHash, BlockHash | None, tuple[int, ...], tuple[str, ...]]]:
        """The content keys ``(hash, parent hash, token ids, extra keys)`` of the prompt's
        full blocks from ``start_block`` on (``parent_hash``: block ``start_block - 1``'s),
        lazily, never covering the last token (as :meth:`get_computed_blocks`)."""
        bs = self.block_size
        parent = parent_hash
        for i in range(start_block, max(0, (len(token_ids) - 1) // bs)):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            extra = extra_keys_for_block(i, cache_salt, self.kv_cache_dtype)
            h = _bh.hash_block_tokens(parent, toks, extra)
            yield h, parent, toks, extra
            parent = h

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup (tokens queried, tokens hit)."""
        self._queries_tokens += num_query_tokens
        self._hits_tokens += num_hit_tokens

    def cache_blocks(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
    ) -> None:
        """Register hashes of the sequence's blocks whose slots are all computed.

        Incremental: each block is hashed once per sequence (the sequence keeps its hash
        chain). A block whose content is already cached under another physical block stays
        uncached (it is freed as plain free space).

        Args:
            seq_id: the sequence.
            token_ids: its full token list (prompt + outputs), at least
                ``num_computed_tokens`` long.
            num_computed_tokens: tokens whose K/V are in the cache after this step.
            cache_salt: the request's salt (must be the same on every call for a sequence).

        Raises:
            KeyError: unknown sequence.
        """
        seq = self._seqs[seq_id]
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        start = len(hashes)
        if num_computed_tokens // bs <= start:  # fast path: no block became full
            return
        num_full = min(num_computed_tokens, seq.num_tokens, len(token_ids)) // bs
        if num_full <= start:
            return
        pool = self._pool
        hash_fn = _bh.hash_block_tokens
        parent = hashes[-1] if hashes else None
        for i in range(start, num_full):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            extra = extra_keys_for_block(i, cache_salt, self.kv_cache_dtype)
            h = hash_fn(parent, toks, extra)
            pool.cache_block(seq.blocks[i], h, parent, toks, extra)
            hashes.append(h)
            parent = h

    # ----------------------------------------------------------------------------- mutation
    def grow_in_place(self, seq_id: str, num_total_tokens: int) -> int:
        """The common decode step of :meth:`allocate_slots`, without building its result.

        When the sequence exists and its table already covers ``num_total_tokens`` slots
        beyond those reserved, with an unshared last block (no new block, no
        copy-on-write), reserve them: :meth:`allocate_slots` would have returned an empty
        delta starting at the table's length.

        Returns:
            The table's length (``start_index`` of that empty delta), or -1, with nothing
            changed, in every other case (unknown sequence, nothing to reserve, a new
            block or a copy is needed): call :meth:`allocate_slots`.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or num_total_tokens <= seq.num_tokens:
            return -1
        blocks = seq.blocks
        # NOTE: a table covers ceil(num_tokens / block_size) blocks, so room left in it
        # means a partially reserved last block: it must be unshared (else copy-on-write).
        if num_total_tokens > len(blocks) * self.block_size or blocks[-1].ref_count != 1:
            return -1
        seq.num_tokens = num_total_tokens
        return len(blocks)

    def allocate_slots(
        self, seq_id: str, num_total_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> AllocationResult | None:
        """Make the sequence's block table cover ``num_total_tokens`` token slots.

        The first call for a sequence may pass ``computed_block_ids`` (prefix-cache hits from
        :meth:`get_computed_blocks`); they become the head of its table (``ref_count + 1``;
        a cached block at ``ref_count == 0`` is revived out of the free queue in O(1)).
        Later calls extend the table; copy-on-write replaces a shared, partially reserved
        last block before new slots are written into it (see :class:`AllocationResult`).

        Returns:
            The table delta, or ``None`` with no state change when fewer than
            :meth:`num_blocks_needed` blocks are free (the caller preempts or waits).

        Raises:
            ValueError: negative or shrinking ``num_total_tokens``; ``computed_block_ids`` for
                an existing sequence, or ones that are not cached blocks, are repeated, or
                cover more than ``num_total_tokens``.
        """
        pool = self._pool
        bs = self.block_size
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if computed_block_ids:
                raise ValueError(f"{seq_id!r} exists; computed blocks only on the first call")
            prev = seq.num_tokens
            if num_total_tokens <= prev:
                if num_total_tokens < prev:
                    raise ValueError(f"{seq_id!r}: cannot shrink from {prev} to {num_total_tokens}")
                return AllocationResult([], [], False, len(seq.blocks))
            blocks = seq.blocks
            start = len(blocks)
            num_new = -(-num_total_tokens // bs) - start
            if prev % bs == 0 or blocks[-1].ref_count <= 1:  # no copy-on-write
                if num_new == 0:  # the common decode step: room left in the last block
                    seq.num_tokens = num_total_tokens
                    return AllocationResult([], [], False, start)
                if num_new > len(pool.free_queue):
                    return None
                seq.num_tokens = num_total_tokens
                new = pool.allocate(num_new)
                blocks.extend(new)
                return AllocationResult([b.block_id for b in new], [], False, start)
            if num_new + 1 > len(pool.free_queue):
                return None
            seq.num_tokens = num_total_tokens
            old = blocks[-1]
            new = pool.allocate(num_new + 1)
            pool.release(old)  # ref_count > 1: stays referenced by the other holders
            blocks[-1] = new[0]
            blocks.extend(new[1:])
            return AllocationResult(
                [b.block_id for b in new],
                [(old.block_id, new[0].block_id)],
                True,
                len(blocks) - len(new),
            )
        return self._allocate_new(seq_id, num_total_tokens, computed_block_ids)

    def _allocate_new(
        self, seq_id: str, num_total_tokens: int, computed_block_ids: Sequence[int]
    ) -> AllocationResult | None:
        pool = self._pool
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        if len(computed_block_ids) * self.block_size > num_total_tokens:
            raise ValueError("computed blocks cover more than num_total_tokens")
        if len(set(computed_block_ids)) != len(computed_block_ids):
            raise ValueError(f"repeated computed block ids {list(computed_block_ids)}")
        computed: list[Block] = []
        for i in computed_block_ids:
            if not 0 <= i < self.num_blocks or pool.blocks[i].block_hash is None:
                raise ValueError(f"computed block {i} is not a cached block (stale lookup?)")
            computed.append(pool.blocks[i])
        num_new = _cdiv(num_total_tokens, self.block_size) - len(computed)
        revive = sum(1 for b in computed if b.ref_count == 0)
        if num_new + revive > pool.num_free_blocks:
            return None
        for b in computed:
            pool.touch(b)  # before allocate(): popping the queue must not evict a hit
        blocks = computed + pool.allocate(num_new)
        hashes = [b.block_hash for b in computed if b.block_hash is not None]
        self._seqs[seq_id] = _SeqState(blocks, num_total_tokens, hashes)
        return AllocationResult([b.block_id for b in blocks], [], False, 0)

    def rollback(self, seq_id: str, num_tokens: int) -> list[int]:
        """Shrink the sequence's reservation to ``num_tokens`` slots (speculative decoding:
        the slots of rejected proposals); blocks left holding none go back to the pool.

        The freed blocks were allocated for the rejected slots (the step reserved them
        past every slot computed before), so each is held by this table alone and holds
        no hash (:meth:`cache_blocks` only hashes computed blocks).

        Args:
            seq_id: the sequence.
            num_tokens: slots it keeps (>= 1 and <= the slots reserved).

        Returns:
            The freed block ids, in table order.

        Raises:
            KeyError: unknown sequence.
            ValueError: ``num_tokens`` outside ``[1, reserved]``.
            IntegrityError: a block to free is shared or cached.
        """
        seq = self._seqs[seq_id]
        if not 1 <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"{seq_id!r}: cannot roll back to {num_tokens} of {seq.num_tokens} slots"
            )
        keep = _cdiv(num_tokens, self.block_size)
        tail = seq.blocks[keep:]
        for b in tail:
            if b.ref_count != 1 or b.block_hash is not None:
                raise IntegrityError(f"{seq_id!r}: rolled-back {b!r} is shared or cached")
        del seq.blocks[keep:]
        del seq.block_hashes[keep:]
        seq.num_tokens = num_tokens
        release = self._pool.release
        for b in reversed(tail):
            release(b)
        return [b.block_id for b in tail]

    def fork(self, parent_seq_id: str, child_seq_id: str, num_tokens: int | None = None) -> None:
        """Give ``child_seq_id`` the head of the parent's block table (``ref_count + 1`` each).

        Used for parallel sampling (n > 1) and beam search (paper section 4.3); the first write
        of either into a shared partial block triggers copy-on-write.

        Args:
            parent_seq_id: the sequence to share from.
            child_seq_id: the new sequence.
            num_tokens: token slots the child gets (default: all the parent's). With fewer,
                the child shares only the blocks covering ``[0, num_tokens)``; a child that
                recomputes the parent's last token (n > 1 forks at ``prompt_len - 1``) then
                copies the block it writes instead of writing into the shared one.

        Raises:
            KeyError: unknown parent.
            ValueError: the child already exists, or ``num_tokens`` is outside
                ``[1, parent's reserved slots]``.
        """
        parent = self._seqs[parent_seq_id]
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id!r} already exists")
        n = parent.num_tokens if num_tokens is None else num_tokens
        if not 1 <= n <= parent.num_tokens:
            raise ValueError(
                f"num_tokens must be in [1, {parent.num_tokens}] to fork {parent_seq_id!r}, "
                f"got {num_tokens}"
            )
        shared = parent.blocks[: _cdiv(n, self.block_size)]
        touch = self._pool.touch
        for b in shared:
            touch(b)
        self._seqs[child_seq_id] = _SeqState(
            list(shared), n, list(parent.block_hashes[: n // self.block_size])
        )

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks (finish, abort or recompute preemption).

        Each block's ``ref_count`` drops by one; blocks reaching 0 join the free queue: cached
        ones at the tail, last block first, so the sequence's prefix outlives its suffix under
        LRU eviction; uncached ones at the head (reused first).

        Raises:
            KeyError: unknown sequence (including a second free of the same sequence).
            IntegrityError: a block's ``ref_count`` would go negative.
        """
        seq = self._seqs.pop(seq_id)
        release = self._pool.release
        for b in reversed(seq.blocks):
            release(b)

    # ---------------------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """Verify all bookkeeping. O(pool size + total table length); for tests and debugging.

        Checks: each block's ``ref_count`` equals the number of block tables holding it; no
        block is both free and referenced; free + in use == pool size; each table has
        ``ceil(num_tokens / block_size)`` distinct blocks; each known hash of a sequence
        matches its block's hash when that block is cached; every index entry's stored
        tokens re-hash to its key.

        Raises:
            IntegrityError: naming the first inconsistency.
        """
        refs = [0] * self.num_blocks
        bs = self.block_size
        for seq_id, seq in self._seqs.items():
            if len(seq.blocks) != _cdiv(seq.num_tokens, bs):
                raise IntegrityError(
                    f"{seq_id!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens"
                )
            if len({b.block_id for b in seq.blocks}) != len(seq.blocks):
                raise IntegrityError(f"{seq_id!r}: a block appears twice in its table")
            if len(seq.block_hashes) > len(seq.blocks):
                raise IntegrityError(f"{seq_id!r}: more hashes than blocks")
            for b, h in zip(seq.blocks, seq.block_hashes):
                if b.block_hash is not None and b.block_hash != h:
                    raise IntegrityError(f"{seq_id!r}: {b!r} cached under another hash")
            for b in seq.blocks:
                if self._pool.blocks[b.block_id] is not b:
                    raise IntegrityError(f"{seq_id!r}: foreign block object {b!r}")
                refs[b.block_id] += 1
        if not self.enable_prefix_caching and self._pool.num_cached_blocks:
            raise IntegrityError("prefix caching is disabled but blocks are cached")
        self._pool.check_integrity(refs)
