"""Results of the KV-cache block manager (see :mod:`pagedserve.scheduler.kv_cache_manager`).

Frozen, picklable dataclasses; pure Python. ``AllocationResult`` tells the worker how one
sequence's block table changed (vLLM v1 sends the same deltas in its ``SchedulerOutput``);
``PrefixCacheStats`` carries prefix-cache counters for metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AllocationResult:
    """What one :meth:`KVCacheManager.allocate_slots` call changed in a block table.

    Returned for every sequence at every step, so not frozen (a frozen dataclass's
    ``__init__`` costs ~4x a plain one's); treat it as immutable.

    Attributes:
        new_block_ids: physical block ids to write into the sequence's block table, in
            logical order, starting at logical index ``start_index``.
        blocks_to_copy: ``(src, dst)`` physical block pairs the worker must copy (all layers,
            K and V) before running the step (copy-on-write).
        replaced_last: True when copy-on-write replaced the table's previous *last* entry:
            then ``new_block_ids[0]`` overwrites that entry (it is the ``dst`` of
            ``blocks_to_copy``) and the remaining ids are appended. False: every id is
            appended.
        start_index: logical block index of ``new_block_ids[0]`` (the old table length, minus
            one when ``replaced_last``).

    The worker's update is ``table[start_index:] = new_block_ids`` (see :meth:`apply_to`).
    """

    new_block_ids: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    replaced_last: bool = False
    start_index: int = 0

    def apply_to(self, block_table: list[int]) -> None:
        """Update a copy of the sequence's block table in place (worker side).

        Raises:
            ValueError: ``block_table`` is not the table this result was computed from.
        """
        expected = self.start_index + (1 if self.replaced_last else 0)
        if len(block_table) != expected:
            raise ValueError(f"block table has {len(block_table)} entries, expected {expected}")
        block_table[self.start_index :] = self.new_block_ids


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last reset, in tokens.

    Attributes:
        queries_tokens: prompt tokens looked up by :meth:`KVCacheManager.get_computed_blocks`.
        hits_tokens: of those, tokens found in cached blocks.
    """

    queries_tokens: int = 0
    hits_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits_tokens / queries_tokens`` (0.0 when nothing was queried)."""
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0
