"""The host tier of the prefix cache: full blocks evicted from a worker's pool, kept in
its node's host block store by block hash (vLLM's OffloadingConnector, LMCache, SGLang's
HiCache).

Pure Python, metadata only: a :class:`HostPrefixCache` per store maps a block hash (which
covers the whole prefix, the ``cache_salt`` and the KV dtype:
:mod:`pagedserve.scheduler.block_hash`) to the host block holding that block's K/V, with
its own LRU and its own capacity (a share of the store's host blocks).
:class:`HostPrefixTier` holds every store's cache, the spills and loads in flight and the
counters; the swap manager (:mod:`pagedserve.scheduler.swapping`) shares each store's
``HostBlockPool`` with it, decides (cost model, backoff), numbers the transfers and
routes their answers here.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import EvictedBlock
from pagedserve.scheduler.errors import IntegrityError

if TYPE_CHECKING:  # swap.py imports HostPrefixStats from here
    from pagedserve.scheduler.swap import HostBlockPool


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
        num_spills, spill_bytes, spill_seconds: blocks copied out to the tier, their
            bytes and the workers' time spent in those transfers.
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
    spill_seconds: float = 0.0
    num_loads: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    num_failures: int = 0


@dataclass
class _Load:
    """A load in flight: its pinned entries (in block order), their tokens, its sequence."""

    entries: list[HostEntry]
    num_tokens: int
    seq_ids: list[str] = field(default_factory=list)


Key = tuple[BlockHash, BlockHash | None, tuple[int, ...], tuple[str, ...]]


class SpillHitRate:
    """Blocks loaded from the host tier per block spilled to it, over about the last
    ``window`` spilled blocks: both counts decay by ``1 - 1 / window`` per block spilled,
    so the rate follows the workload (a chat phase after a phase of unique prompts). It
    starts at ``prior`` hits in ``prior`` spills (rate 1: spill until the spills show that
    nothing comes back). A load counts its blocks as hits whenever the spills were.

    One rate serves every store of the tier (a load from another store's tier counts too),
    and it survives :meth:`HostPrefixTier.clear`: it measures the workload, not the
    entries.

    Args:
        window: spilled blocks the rate covers (the decay's time constant), >= 1.
        prior: the optimistic start, hits and spills alike, >= 0.

    Raises:
        ValueError: ``window`` below 1 or a negative ``prior``.
    """

    def __init__(self, window: float = 256.0, prior: float = 8.0) -> None:
        if not window >= 1 or prior < 0:
            raise ValueError(
                f"SpillHitRate: window must be >= 1 and prior >= 0, got {window}, {prior}"
            )
        self._keep = 1.0 - 1.0 / window
        self.hits = prior
        self.spilled = prior

    def on_spill(self, num_blocks: int) -> None:
        """``num_blocks`` more were spilled (their spill answered ok)."""
        decay = self._keep**num_blocks
        self.hits *= decay
        self.spilled = self.spilled * decay + num_blocks

    def on_hit(self, num_blocks: int) -> None:
        """A load brought ``num_blocks`` back (answered ok)."""
        self.hits += num_blocks

    @property
    def rate(self) -> float:
        """Hits per spilled block (1.0 before any spill with ``prior`` 0)."""
        return self.hits / self.spilled if self.spilled > 0 else 1.0


class HostPrefixTier:
    """The host tier of every store: entries, the spills and loads in flight, counters.

    The swap manager plans the transfers (host ids never reused while one may touch
    them, see the module docstring) and resolves them here; host ids come from and return
    to the store's :class:`~pagedserve.scheduler.swap.HostBlockPool`.

    Args:
        pools: store_id -> that store's host block pool (shared with swap preemption).
        fraction: in (0, 1]: the share of each pool the tier may hold.
        enabled: False: no store runs a tier (every query answers nothing).
    """

    def __init__(self, pools: Mapping[str, HostBlockPool], fraction: float, enabled: bool):
        self.pools = pools
        self.caches: dict[str, HostPrefixCache] = (
            {store: HostPrefixCache(int(p.num_blocks * fraction)) for store, p in pools.items()}
            if enabled
            else {}
        )
        self._spills: dict[str, tuple[str, list[HostEntry]]] = {}  # transfer -> store, new
        self._loads: dict[str, _Load] = {}  # transfer_id -> its pinned entries
        keys = ("hit_blocks", "hit_tokens", "spills", "spill_bytes", "loads", "load_bytes")
        self._counts = dict.fromkeys(keys, 0)
        self._failures = 0
        self._seconds = {"spill": 0.0, "load": 0.0}
        self.hit_rate = SpillHitRate()

    def reclaim(self, store: str, n: int) -> None:
        """Return up to ``n`` of the tier's least recently used blocks of ``store`` to its
        pool (swap preemption needs them)."""
        cache = self.caches.get(store)
        free: list[int] = []
        while cache is not None and len(free) < n:
            hid = cache.evict_lru()
            if hid is None:
                break
            free.append(hid)
        self.pools[store].free(free)

    def spill(
        self, store: str, evicted: list[EvictedBlock], transfer_id: str, limit: int | None = None
    ) -> tuple[list[int], list[int]] | None:
        """Add entries for the blocks ``evicted`` from a device pool (eviction order) that
        the tier of ``store`` lacks, at most ``limit`` (None: all); ``(device block ids,
        host block ids)`` for the spill ``transfer_id``, None when nothing is spilled.
        Newest first: a prompt's head block is freed last (evicted last), so when the tier
        is short, or the limit cuts, the most recently used blocks and the heads of chains
        win. A host id comes from the pool while the tier is under its capacity, else from
        the tier's LRU entry; with every entry busy the block is not kept."""
        cache, pool = self.caches[store], self.pools[store]
        block_ids: list[int] = []
        entries: list[HostEntry] = []
        for ev in reversed(evicted):
            if limit is not None and len(entries) >= limit:
                break
            if ev.block_hash in cache:
                cache.touch(ev.block_hash)
                continue
            ids = pool.allocate(1) if len(cache) < cache.capacity else None
            hid = ids[0] if ids else cache.evict_lru()
            if hid is None:
                continue
            e = HostEntry(ev.block_hash, hid, ev.parent_hash, ev.token_ids, ev.extra_keys)
            cache.add(e)
            block_ids.append(ev.block_id)
            entries.append(e)
        if not entries:
            return None
        for e in reversed(entries):  # the tier's LRU order: as they were evicted
            cache.touch(e.block_hash)
        self._spills[transfer_id] = store, entries
        return block_ids, [e.host_id for e in entries]

    def chain(self, store: str, keys: Iterator[Key], seen: list[Key]) -> list[HostEntry]:
        """The ready entries of ``store``'s tier holding the next blocks of a prompt, in
        order, up to the first miss; ``keys`` yields the blocks' content keys lazily and
        ``seen`` keeps those already drawn (shared by the walks of several stores)."""
        cache = self.caches[store]
        found: list[HostEntry] = []
        while True:
            if len(found) == len(seen):
                nxt = next(keys, None)
                if nxt is None:
                    return found
                seen.append(nxt)
            e = cache.lookup(*seen[len(found)])
            if e is None:
                return found
            found.append(e)

    def pin(
        self, store: str, entries: list[HostEntry], transfer_id: str, seq_id: str, bs: int
    ) -> list[int]:
        """A load ``transfer_id`` of ``entries`` for ``seq_id`` starts: pin them; their
        host ids."""
        cache = self.caches[store]
        for e in entries:
            e.pins += 1
            cache.touch(e.block_hash)
        self._loads[transfer_id] = _Load(entries, len(entries) * bs, [seq_id])
        return [e.host_id for e in entries]

    def resolve(
        self, store: str, kind: str, transfer_id: str, ok: bool, nbytes: int, seconds: float
    ) -> list[str]:
        """Apply the answer of spill or load ``transfer_id`` (on ``store``); the sequences
        a failed load sends back to recompute. A failure drops the transfer's entries."""
        pool, cache, c = self.pools[store], self.caches[store], self._counts
        self._failures += not ok
        if kind == "spill":
            _, entries = self._spills.pop(transfer_id)
            for e in entries:
                if ok and not e.dropped:
                    e.ready = True
                else:
                    cache.discard(e)
                    pool.free([e.host_id])
            if ok:
                c["spills"] += len(entries)
                c["spill_bytes"] += nbytes
                self._seconds["spill"] += seconds
                self.hit_rate.on_spill(len(entries))
            return []
        load = self._loads.pop(transfer_id)
        for e in load.entries:
            if e.pins <= 0:
                raise IntegrityError(f"host entry {e.block_hash.hex()[:8]} unpinned twice")
            e.pins -= 1
            if not ok and cache.discard(e):  # NOTE: the store may be dead or the bytes bad
                e.dropped = True
        pool.free([e.host_id for e in load.entries if e.dropped and e.pins == 0])
        if not ok:
            return load.seq_ids
        c["loads"] += 1
        c["load_bytes"] += nbytes
        c["hit_blocks"] += len(load.entries)
        c["hit_tokens"] += load.num_tokens
        self.hit_rate.on_hit(len(load.entries))
        self._seconds["load"] += seconds
        return []

    def clear(self) -> None:
        """Forget every entry (new weights); blocks a transfer holds return to the pool
        when it answers."""
        for store, cache in self.caches.items():
            self.pools[store].free(cache.clear())

    def held(self, store: str) -> set[int]:
        """The host ids of ``store``'s tier (for the pool's integrity check).

        Raises:
            IntegrityError: the tier holds more than its capacity.
        """
        cache = self.caches.get(store)
        if cache is None:
            return set()
        if len(cache) > cache.capacity:
            raise IntegrityError(
                f"host tier of store {store!r}: {len(cache)} blocks > capacity {cache.capacity}"
            )
        return cache.host_ids()

    def stats(self) -> HostPrefixStats:
        """The counters and occupancy, summed over the stores."""
        c = self._counts
        caches = self.caches.values()
        return HostPrefixStats(
            enabled=bool(self.caches),
            capacity_blocks=sum(x.capacity for x in caches),
            num_blocks=sum(len(x) for x in caches),
            num_hit_blocks=c["hit_blocks"],
            num_hit_tokens=c["hit_tokens"],
            num_spills=c["spills"],
            spill_bytes=c["spill_bytes"],
            spill_seconds=self._seconds["spill"],
            num_loads=c["loads"],
            load_bytes=c["load_bytes"],
            load_seconds=self._seconds["load"],
            num_failures=self._failures,
        )
