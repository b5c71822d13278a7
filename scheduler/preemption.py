"""Victim choice for preemption by recompute: the sequence whose loss wastes least.

When a running sequence cannot grow, some running sequence gives its blocks up and is
recomputed later. vLLM (v0 and v1) takes the last one in the batch (the latest arrival);
what that throws away is whatever it had computed, which under pressure is often a long
prompt just prefilled. Here the victim is the one whose preemption discards the fewest
computed tokens, among the sequences allowed to lose:

- only sequences ranked after the one that needs the block (less urgent, or as urgent and
  younger): the oldest running sequence's blocks are never taken by a younger one, so the
  oldest always progresses and two sequences never preempt each other in turn;
- among those, only the least urgent priority class (``priority`` policy);
- a sequence whose blocks are all shared (its preemption would free nothing) is taken
  only when no other frees anything.

Waste = computed tokens minus those in blocks other sequences still hold (those stay
cached and are found again by the prefix cache at re-admission). Ties go to the latest in
rank (vLLM's choice). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Sequence


def recompute_cost(seq: Sequence, kv: KVCacheManager) -> tuple[int, int]:
    """``(tokens whose K/V preempting ``seq`` discards, blocks it frees)``.

    Blocks other sequences also hold (``ref_count > 1``) are neither freed nor lost.
    """
    if not kv.has_seq(seq.seq_id):
        return 0, 0
    bs = kv.block_size
    shared = freed = 0
    for block_id in kv.get_block_ids(seq.seq_id):
        if kv.get_ref_count(block_id) > 1:
            shared += 1
        else:
            freed += 1
    return max(0, seq.num_computed_tokens - shared * bs), freed


def choose_victim(
    needy: Sequence,
    later: Seq[Sequence],
    kv: KVCacheManager,
    priority_of: Callable[[Sequence], int],
) -> Sequence:
    """The running sequence to preempt so that ``needy`` can grow.

    Args:
        needy: the sequence that cannot get its blocks.
        later: the running sequences ranked after it, in rank order (not yet scheduled
            in this step); empty when ``needy`` is the last.
        kv: the worker's block manager.
        priority_of: a sequence's priority class (larger = less urgent).

    Returns:
        One of ``later``, or ``needy`` itself when ``later`` is empty.
    """
    if not later:
        return needy
    least_urgent = max(priority_of(s) for s in later)
    best: Sequence | None = None
    best_key: tuple[int, int] | None = None
    for pos, seq in enumerate(later):
        if priority_of(seq) != least_urgent:
            continue
        waste, freed = recompute_cost(seq, kv)
        if freed == 0:
            continue
        key = (waste, -pos)  # least waste; then the latest in rank
        if best_key is None or key < best_key:
            best, best_key = seq, key
    return best if best is not None else later[-1]
