"""The physical block pool: reference counts, the free-block queue and the prefix-cache index.

Metadata only; the KV tensors live on the workers. Follows the PagedAttention paper's block
allocator (Kwon et al., SOSP 2023, sections 4.2-4.3: fixed-size blocks, reference counts,
copy-on-write) and vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue`` design for prefix
caching (section 4.4; vLLM docs "Automatic Prefix Caching"):

* Every block with ``ref_count == 0`` sits in one free queue. Some of them still hold the KV
  of a cached full block (they have a ``block_hash``): they are *evictable*, and a new request
  that hits them revives them out of the middle of the queue in O(1).
* Allocation pops the queue head (least recently freed). Popping a cached block evicts it:
  its hash leaves the index.
* Freed cached blocks go to the queue tail (they should live long); freed uncached blocks go
  to the head (their content is worthless, so they are reused first and the cached blocks
  survive longer). vLLM puts both at the tail.

All operations are O(1) per block; :meth:`BlockPool.check_integrity` is O(pool size).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagedserve.scheduler import block_hash as _bh
from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.errors import IntegrityError


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A cached block that allocation evicted: its physical id and its content key (the
    hash and what :meth:`Block.matches` compares)."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


class Block:
    """Metadata of one physical KV-cache block.

    Attributes:
        block_id: physical block id, ``0 <= block_id < num_blocks``.
        ref_count: number of block tables holding this block.
        block_hash: chained hash when the block is a cached full block, else ``None``.
        parent_hash: the hash chained into ``block_hash`` (``None`` for a sequence's block 0).
        token_ids: the block's token ids when cached (compared on every hit).
        extra_keys: the extra keys hashed into the block when cached.
    """

    __slots__ = ("block_hash", "block_id", "extra_keys", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()
        self.extra_keys: tuple[str, ...] = ()

    def matches(
        self, parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...]
    ) -> bool:
        """Whether this cached block holds exactly this content (guards against collisions)."""
        return (
            self.token_ids == token_ids
            and self.parent_hash == parent_hash
            and self.extra_keys == extra_keys
        )

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={cached})"


class FreeBlockQueue:
    """Blocks with ``ref_count == 0``, oldest first; O(1) popleft, append, appendleft, remove.

    Backed by an ``OrderedDict`` (a C-implemented doubly linked list plus index), keyed by
    block id.
    """

    __slots__ = ("_q",)

    def __init__(self, blocks: Sequence[Block] = ()) -> None:
        self._q: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._q

    def __iter__(self) -> Iterator[Block]:
        return iter(self._q.values())

    def popleft(self) -> Block:
        """Remove and return the head. Raises ``IndexError`` when empty."""
        if not self._q:
            raise IndexError("free block queue is empty")
        return self._q.popitem(last=False)[1]

    def take(self, n: int) -> list[Block]:
        """Remove and return the ``n`` head blocks, head first (``n`` :meth:`popleft`
        calls in one). Raises ``IndexError``, with nothing removed, when fewer are queued."""
        if n > len(self._q):
            raise IndexError(f"free block queue holds {len(self._q)} blocks, not {n}")
        popitem = self._q.popitem
        return [popitem(False)[1] for _ in range(n)]

    def append(self, block: Block) -> None:
        """Insert at the tail (evicted last). Raises ``IntegrityError`` if already queued."""
        if block.block_id in self._q:
            raise IntegrityError(f"block {block.block_id} is already in the free queue")
        self._q[block.block_id] = block

    def appendleft(self, block: Block) -> None:
        """Insert at the head (reused first). Raises ``IntegrityError`` if already queued."""
        self.append(block)
        self._q.move_to_end(block.block_id, last=False)

    def remove(self, block: Block) -> None:
        """Take a block out of the middle. Raises ``IntegrityError`` if not queued."""
        if self._q.pop(block.block_id, None) is None:
            raise IntegrityError(f"block {block.block_id} is not in the free queue")


class BlockPool:
    """``num_blocks`` physical blocks with reference counts, a free queue and a hash index.

    Args:
        num_blocks: pool size (>= 1).
        block_size: tokens per block (>= 1).
        track_evictions: keep each block that allocation evicts (its id and content key)
            until :meth:`take_evicted` (the host tier of the prefix cache spills them).

    Raises:
        ValueError: a size is not a positive int.
    """

    def __init__(self, num_blocks: int, block_size: int, track_evictions: bool = False) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self._evicted: list[EvictedBlock] | None = [] if track_evictions else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-evictable (``ref_count == 0``)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the hash index (in use or evictable)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the queue head (LRU), evict their hashes, set ``ref_count=1``.

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check first; nothing changes).
        """
        if n > len(self.free_queue):
            raise ValueError(f"need {n} blocks, only {len(self.free_queue)} free")
        out = self.free_queue.take(n)
        evicted = self._evicted
        for block in out:
            if block.block_hash is not None:
                if evicted is not None:
                    evicted.append(
                        EvictedBlock(
                            block.block_id,
                            block.block_hash,
                            block.parent_hash,
                            block.token_ids,
                            block.extra_keys,
                        )
                    )
                self._evict(block)
            block.ref_count = 1
        return out

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks allocation evicted since the last call, in eviction order
        (empty unless ``track_evictions``). Their ids now belong to new owners, whose
        writes come in a step after this call, so a step that copies them out first
        still reads the evicted content."""
        out = self._evicted
        if not out:
            return []
        self._evicted = []
        return out

    def touch(self, block: Block) -> None:
        """Take one more reference; a block at ``ref_count == 0`` leaves the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop one reference; at zero the block is queued (cached: tail, uncached: head).

        Raises:
            IntegrityError: the block had no reference (double free).
        """
        if block.ref_count <= 0:
            raise IntegrityError(f"double free of block {block.block_id} (ref_count 0)")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self.free_queue.append(block)
            else:
                self.free_queue.appendleft(block)

    def lookup(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        extra_keys: tuple[str, ...],
    ) -> Block | None:
        """The cached block with this hash *and* exactly this content, else ``None``."""
        block = self._cached.get(block_hash)
        if block is None or not block.matches(parent_hash, token_ids, extra_keys):
            return None
        return block

    def cache_block(
        self,
        block: Block,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        extra_keys: tuple[str, ...],
    ) -> bool:
        """Register a full block under ``block_hash``.

        Returns:
            True if the block is now (or already was) the index entry for this hash; False if
            it already carries another hash or another block holds this hash (a duplicate of
            the same content computed separately; it stays uncached).
        """
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        block.extra_keys = extra_keys
        self._cached[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        block.extra_keys = ()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use.

        Returns:
            True on success, False (nothing changed) when some block has ``ref_count > 0``.
        """
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        if self._evicted:
            self._evicted = []  # NOTE: stale content (new weights): never spilled
        return True

    def check_integrity(self, expected_refs: Sequence[int]) -> None:
        """Check the pool against reference counts recomputed from the block tables. O(n).

        Args:
            expected_refs: for each block id, the number of block tables holding it.

        Raises:
            IntegrityError: with a message naming the first inconsistency found.
        """
        if len(expected_refs) != self.num_blocks:
            raise IntegrityError("expected_refs has the wrong length")
        in_use = 0
        for block, expected in zip(self.blocks, expected_refs):
            if block.ref_count != expected:
                raise IntegrityError(
                    f"block {block.block_id}: ref_count {block.ref_count} but held by "
                    f"{expected} block tables"
                )
            queued = block.block_id in self.free_queue
            if block.ref_count > 0:
                in_use += 1
                if queued:
                    raise IntegrityError(f"block {block.block_id} is referenced and free")
            elif not queued:
                raise IntegrityError(f"block {block.block_id} has ref_count 0 but is not free")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise IntegrityError(f"block {block.block_id} has a hash missing from the index")
        if in_use + len(self.free_queue) != self.num_blocks:
            raise IntegrityError(
                f"in use {in_use} + free {len(self.free_queue)} != pool size {self.num_blocks}"
            )
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise IntegrityError(f"index entry {h.hex()[:8]} points at {block!r}")
            if len(block.token_ids) != self.block_size:
                raise IntegrityError(f"cached {block!r} holds {len(block.token_ids)} tokens")
            if _bh.hash_block_tokens(block.parent_hash, block.token_ids, block.extra_keys) != h:
                raise IntegrityError(f"cached {block!r}: stored tokens do not match its hash")
