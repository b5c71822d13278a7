"""Memory back ends of the allocator simulator: the paged block manager and the contiguous
baseline behind one small interface (admit / grow / release / measure / snapshot).

Both model the same KV memory of ``num_slots`` token slots. Timing convention (shared with
:mod:`pagedserve.sim.simulator`): a request in flight has generated ``g`` tokens per
sample and holds KV for ``w = prompt_len + g - 1`` tokens per sample (the newest token's KV
is written by the next step). Admission prefills ``L = prompt_len + g``
tokens (``g = 0`` fresh, ``g > 0`` when resuming after recompute preemption, vLLM paper §4.5:
the outputs so far are recomputed together with the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.sim.contiguous import ContiguousAllocator
from pagedserve.sim.workload import WorkloadRequest

FREE = -1
"""Snapshot value of a free slot."""
RESERVED = -2
"""Snapshot value of a slot held by a request but not (yet) written."""

_POS_BITS = 24  # token position field of the synthetic token ids
MAX_SAMPLES = 1023


@dataclass(eq=False)
class Group:
    """One request in flight (all ``n`` samples; they advance in lockstep).

    Attributes:
        index: position of the request in the workload (its id is ``f"r{index}"``).
        req: the workload record.
        generated: tokens generated per sample so far (kept across preemption).
        tokens: per-sample token ids (prompt + outputs); filled only by the paged back end.
        forked_now: True during the step in which a fresh n > 1 request was forked (its
            samples still share the partially written last prompt block).
    """

    index: int
    req: WorkloadRequest
    generated: int = 0
    tokens: list[list[int]] = field(default_factory=list)
    forked_now: bool = False

    def seq_id(self, k: int) -> str:
        """Sequence id of sample ``k``."""
        return f"r{self.index}.{k}"

    @property
    def written(self) -> int:
        """KV tokens written per sample (``prompt_len + generated - 1``; 0 before admission)."""
        return self.req.prompt_len + self.generated - 1 if self.generated else 0


def prompt_token_ids(index: int, req: WorkloadRequest) -> list[int]:
    """Synthetic prompt token ids: the first ``prefix_len`` depend only on ``prefix_id`` (so
    requests sharing it hit the prefix cache); the rest are unique to the request."""
    pre = [-(((req.prefix_id or 0) + 1) << _POS_BITS | i) for i in range(req.prefix_len)]
    base = (index * (MAX_SAMPLES + 1)) << _POS_BITS
    return pre + [base | i for i in range(req.prefix_len, req.prompt_len)]


def output_token_id(index: int, sample: int, position: int) -> int:
    """Synthetic id of sample ``sample``'s token at ``position``, unique per sample."""
    return ((index * (MAX_SAMPLES + 1) + 1 + sample) << _POS_BITS) | position


class PagedBackend:
    """The paged KV cache: ``num_slots // block_size`` blocks of a :class:`KVCacheManager`.

    Admission of a fresh request prefills sample 0 (prefix-cache hits first), then forks the
    other samples (they share every prompt block; copy-on-write on the first decode). It
    admits only when the prompt's blocks plus the blocks of every sample's first output
    token are free (``num_blocks_needed`` + n - 1 copy-on-write blocks, + n when the prompt
    ends on a block boundary). A resumed request re-prefills each sample separately (they
    share full prompt blocks through the prefix cache when it is on).
    """

    kind = "paged"

    def __init__(self, num_slots: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1 or num_slots < block_size:
            raise ValueError(f"need 1 <= block_size <= num_slots, got {block_size}, {num_slots}")
        self.block_size = block_size
        self.num_slots = (num_slots // block_size) * block_size
        self.kv = KVCacheManager(num_slots // block_size, block_size, enable_prefix_caching)
        self.caching = enable_prefix_caching
        self.prefix_hit_tokens = 0

    def try_admit(self, g: Group) -> bool:
        """Prefill ``g`` if it fits (see class doc); False with nothing allocated otherwise."""
        kv, bs, n = self.kv, self.block_size, g.req.n
        if not g.tokens:
            prompt = prompt_token_ids(g.index, g.req)
            g.tokens = [list(prompt) for _ in range(n)]
        length = g.req.prompt_len + g.generated
        boundary = length % bs == 0
        if g.generated == 0:
            hits, _ = kv.get_computed_blocks(g.tokens[0][:length])
            need = kv.num_blocks_needed(None, length, hits) + (n - 1) + boundary
            if need > kv.num_free_blocks or kv.allocate_slots(g.seq_id(0), length, hits) is None:
                return False
            self._cache(g, 0, length)
            for k in range(1, n):
                kv.fork(g.seq_id(0), g.seq_id(k))
            self.prefix_hit_tokens += len(hits) * bs
            g.forked_now = n > 1
            return True
        # Resume: conservative check (ignores sharing created inside the group), then roll
        # back if a later sample does not fit after all.
        need = n * boundary
        for k in range(n):
            hits, _ = kv.get_computed_blocks(g.tokens[k][:length])
            need += kv.num_blocks_needed(None, length, hits)
        if need > kv.num_free_blocks:
            return False
        for k in range(n):
            hits, _ = kv.get_computed_blocks(g.tokens[k][:length])
            if kv.allocate_slots(g.seq_id(k), length, hits) is None:
                for j in range(k):
                    kv.free(g.seq_id(j))
                return False
            self._cache(g, k, length)
            self.prefix_hit_tokens += len(hits) * bs
        return True

    def grow(self, g: Group, k: int) -> bool:
        """Give sample ``k`` a slot for the KV of its newest token; False when the pool is dry."""
        w = g.req.prompt_len + g.generated
        if self.kv.allocate_slots(g.seq_id(k), w) is None:
            return False
        if w % self.block_size == 0:
            self._cache(g, k, w)
        return True

    def append_token(self, g: Group, k: int) -> None:
        """Record sample ``k``'s newly generated token id (for prefix-cache hashing)."""
        g.tokens[k].append(output_token_id(g.index, k, g.req.prompt_len + g.generated))

    def release(self, g: Group) -> None:
        """Free every sample of ``g`` (finish or recompute preemption)."""
        for k in range(g.req.n):
            self.kv.free(g.seq_id(k))

    def _cache(self, g: Group, k: int, num_tokens: int) -> None:
        if self.caching:
            self.kv.cache_blocks(g.seq_id(k), g.tokens[k], num_tokens)

    def held_slots(self) -> int:
        """Slots of blocks with ``ref_count > 0`` (shared blocks counted once)."""
        return (self.kv.num_blocks - self.kv.num_free_blocks) * self.block_size

    def unwritten_slots(self, running: list[Group]) -> int:
        """Held but unwritten slots: the unwritten tail of each sample's last block (a
        fresh fork's samples still share one tail). Every other held block is full."""
        bs = self.block_size
        total = 0
        for g in running:
            tail = -g.written % bs
            total += tail if g.forked_now else tail * g.req.n
        return total

    def snapshot(self, running: list[Group]) -> list[int]:
        """Slot map: owner request index for written slots, RESERVED, or FREE."""
        bs = self.block_size
        out = [FREE] * self.num_slots
        for g in running:
            w = g.written
            for k in range(g.req.n):
                for j, b in enumerate(self.kv.get_block_ids(g.seq_id(k))):
                    fill = min(bs, w - j * bs)
                    base = b * bs
                    for s in range(base, base + bs):
                        if s < base + fill:
                            out[s] = g.index
                        elif out[s] == FREE:
                            out[s] = RESERVED
        return out

    def check(self, final: bool = False) -> None:
        """Run the manager's integrity check; at the end also require every block free."""
        self.kv.check_integrity()
        if final and self.kv.num_free_blocks != self.kv.num_blocks:
            raise AssertionError(
                f"{self.kv.num_blocks - self.kv.num_free_blocks} blocks still held at the end"
            )


class ContiguousBackend:
    """The contiguous baseline: each sample reserves one first-fit run at admission (n runs
    for n samples, all or nothing), so it never grows and is never preempted."""

    kind = "contiguous"

    def __init__(self, num_slots: int, max_model_len: int, reserve: str = "max_model_len"):
        self.alloc = ContiguousAllocator(num_slots, max_model_len, reserve)
        self.num_slots = num_slots
        self.prefix_hit_tokens = 0

    def reservation(self, g: Group) -> int:
        """Slots one sample of ``g`` reserves."""
        return self.alloc.reservation_size(g.req.prompt_len, g.req.max_tokens)

    def try_admit(self, g: Group) -> bool:
        """Reserve n runs and write the prefill; False with nothing reserved otherwise."""
        size = self.reservation(g)
        length = g.req.prompt_len + g.generated
        for k in range(g.req.n):
            if self.alloc.allocate(g.seq_id(k), size) is None:
                for j in range(k):  # freeing restores the exact free-run layout
                    self.alloc.free(g.seq_id(j))
                return False
            self.alloc.append_slots(g.seq_id(k), length)
        return True

    def grow(self, g: Group, k: int) -> bool:
        """Write the newest token's KV inside the reservation (always fits)."""
        self.alloc.append_slots(g.seq_id(k), g.req.prompt_len + g.generated)
        return True

    def append_token(self, g: Group, k: int) -> None:
        """No token ids needed (no sharing)."""

    def release(self, g: Group) -> None:
        """Free every sample's run."""
        for k in range(g.req.n):
            self.alloc.free(g.seq_id(k))

    def held_slots(self) -> int:
        """Reserved slots."""
        return self.alloc.num_reserved_slots

    def unwritten_slots(self, running: list[Group]) -> int:
        """Reserved but unwritten slots."""
        return self.alloc.num_reserved_slots - self.alloc.num_live_tokens

    def snapshot(self, running: list[Group]) -> list[int]:
        """Slot map: owner request index for written slots, RESERVED, or FREE."""
        out = [FREE] * self.num_slots
        for g in running:
            for k in range(g.req.n):
                run = self.alloc.get_run(g.seq_id(k))
                out[run.start : run.start + run.num_tokens] = [g.index] * run.num_tokens
                out[run.start + run.num_tokens : run.end] = [RESERVED] * (
                    run.length - run.num_tokens
                )
        return out

    def check(self, final: bool = False) -> None:
        """Run the allocator's integrity check; at the end also require every slot free."""
        self.alloc.check_integrity()
        if final and self.alloc.num_free_slots != self.num_slots:
            raise AssertionError(f"{self.alloc.num_reserved_slots} slots still reserved at end")
