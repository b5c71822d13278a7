"""The host tier of the prefix cache: full blocks evicted from a worker's pool, kept in
its node's host block store by block hash (vLLM's OffloadingConnector, LMCache, SGLang's
HiCache).

Pure Python, metadata only: a :class:`HostPrefixCache` per store maps a block hash (which
covers the whole prefix, the ``cache_salt`` and the KV dtype:
:mod:`pagedserve.scheduler.block_hash`) to the host block holding that block's K/V, with
its own LRU and its own capacity (a share of the store's host blocks). The swap manager
(:mod:`pagedserve.scheduler.swapping`) shares the store's :class:`HostBlockPool` with it,
plans the transfers and resolves them; this module only keeps the entries and counters.

Entry life: a spill (the device pool evicted a cached block at ref count 0; the worker
copies it out at the start of the next step, before anything writes it) adds an entry
that is not ``ready`` until the spill's answer; a lookup sees ready entries only. A load
(admission hit: a swap-in into fresh device blocks) pins its entries until its answer.
Only ready, unpinned entries are evicted (the tier's LRU under its capacity, or for swap
preemption when the pool is short), so a host id is never reused while a transfer may
still read or write it. A failed spill or load drops its entries (the store may be dead
or the bytes bad): their tokens are recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.errors import IntegrityError


@dataclass(slots=True)
class HostEntry:
    """One block of the host tier.

    Attributes:
        block_hash: its prefix-cache hash (the key).
        host_id: the host block holding its K/V.
        parent_hash, token_ids, extra_keys: its content key, compared on every hit (a
            hash collision costs a miss, never wrong KV).
        ready: its spill answered ok (only then may it be loaded).
        pins: loads in flight reading it.
        dropped: forgotten while a transfer held it; its host id returns to the pool when
            that transfer answers.
    """

    block_hash: BlockHash
    host_id: int
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]
    ready: bool = False
    pins: int = 0
    dropped: bool = False

    def matches(
        self, parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...]
    ) -> bool:
        return (
            self.token_ids == token_ids
            and self.parent_hash == parent_hash
            and self.extra_keys == extra_keys
        )


class HostPrefixCache:
    """One store's host-tier entries, least recently used first.

    Args:
        capacity: most host blocks the tier holds in this store (>= 0).

    Raises:
        ValueError: ``capacity`` < 0.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, HostEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def host_ids(self) -> set[int]:
        """The host blocks of every entry."""
        return {e.host_id for e in self._entries.values()}

    def lookup(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        extra_keys: tuple[str, ...],
    ) -> HostEntry | None:
        """The ready entry with this hash and exactly this content, else None (no side
        effects)."""
        e = self._entries.get(block_hash)
        if e is None or not e.ready or not e.matches(parent_hash, token_ids, extra_keys):
            return None
        return e

    def touch(self, block_hash: BlockHash) -> None:
        """Make the entry the most recently used (no-op when absent)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def add(self, entry: HostEntry) -> None:
        """Add a spill's (not yet ready) entry as the most recently used.

        Raises:
            IntegrityError: the hash is already present.
        """
        if entry.block_hash in self._entries:
            raise IntegrityError(f"host tier already holds {entry.block_hash.hex()[:8]}")
        self._entries[entry.block_hash] = entry

    def evict_lru(self) -> int | None:
        """Drop the least recently used ready, unpinned entry; its host id (free to reuse
        now: no transfer touches it), or None when every entry is busy."""
        for h, e in self._entries.items():
            if e.ready and e.pins == 0:
                del self._entries[h]
                return e.host_id
        return None

    def discard(self, entry: HostEntry) -> bool:
        """Forget ``entry`` (a failed transfer); whether it was still present."""
        if self._entries.get(entry.block_hash) is entry:
            del self._entries[entry.block_hash]
            return True
        return False

    def clear(self) -> list[int]:
        """Forget every entry (new weights: the KV is stale). Returns the host ids free to
        reuse now; entries a transfer holds are marked ``dropped`` and freed by it."""
        free: list[int] = []
        for e in self._entries.values():
            if e.ready and e.pins == 0:
                free.append(e.host_id)
            else:
                e.dropped = True
        self._entries.clear()
        return free


@dataclass(frozen=True)
class HostPrefixStats:
    """Host-tier counters since start, summed over the stores (``GetStats``,
    ``pagedserve stats``, metrics).

    Attributes:
        enabled: the tier runs (a host store and ``host_prefix_cache``).
        capacity_blocks: host blocks the tier may hold (sum over stores).
        num_blocks: host blocks it holds now.
        num_hit_blocks, num_hit_tokens: blocks (tokens) admission loaded from the tier
            instead of recomputing them (successful loads only).
        num_spills, spill_bytes: blocks copied out to the tier, and their bytes.
        num_loads, load_bytes, load_seconds: finished loads (transfers), their bytes and
            the worker's time spent in them.
        num_failures: spills or loads that failed (their tokens are recomputed).
    """

    enabled: bool = False
    capacity_blocks: int = 0
    num_blocks: int = 0
    num_hit_blocks: int = 0
    num_hit_tokens: int = 0
    num_spills: int = 0
    spill_bytes: int = 0
    num_loads: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    num_failures: int = 0


@dataclass
class HostLoad:
    """A load in flight: its pinned entries (in block order) and the tokens they hold."""

    store_id: str
    entries: list[HostEntry]
    num_tokens: int
    seq_ids: list[str] = field(default_factory=list)


def unpin(entries: Iterable[HostEntry]) -> None:
    """Release one pin of each entry (a load answered)."""
    for e in entries:
        if e.pins <= 0:
            raise IntegrityError(f"host entry {e.block_hash.hex()[:8]} unpinned twice")
        e.pins -= 1
