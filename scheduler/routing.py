"""Routing: which worker's waiting queue a new request joins, and work stealing.

The scheduler sees every worker's prefix cache (the block hashes of its pool), which a load
balancer in front of separate engines does not. A new request joins the queue of:

- ``prefix`` (default): the live worker whose prefix cache holds the longest prefix of its
  prompt (full blocks, the same hashes admission looks up; ties: lower load, then lower
  worker id; a block it would load from the host tier of the prefix cache, in its node's
  store or pulled from another's, counts half a block on its device), unless that worker's load exceeds the least-loaded live worker's by more
  than ``routing_load_threshold``; then, or when no worker holds any of its prefix, the
  least-loaded live worker.
- ``least-loaded``: the least-loaded live worker (ties: lower worker id).
- ``round-robin``: live workers in turn.

The load of a worker is a count of sequences: running, queued, and choices that will fork
from them (:attr:`WorkerState.load`). Sequences, not tokens: a decode costs the same step
whatever its length, and a cached prompt costs little to prefill, so a token count would
push shared-prefix requests off the worker that caches their prefix.

Work stealing keeps a worker from idling while another's queue waits: a worker whose own
queue is empty takes a sequence queued for another, busy worker when that worker could not
admit it now (its pool or batch is full, or its admission rule refuses it: waiting there
costs more than recomputing the prefix), or when the sequence has no cached prefix there
and the move evens the loads (the thief's load plus the sequence's width stays at most the
victim's load minus it; :meth:`Router.find_stealable`). Beams
of a beam search whose request still runs elsewhere stay where their siblings are.

The prefix lookups use :meth:`KVCacheManager.get_computed_blocks` with ``count=False``: it
takes no references and touches neither the LRU order nor the prefix-cache stats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.request import Sequence
from pagedserve.scheduler.worker_state import WorkerState

# Sequences of one victim queue looked at per steal attempt: bounds the hashing a thief
# does per step (queues longer than this are usually blocked at their head anyway).
_STEAL_SCAN = 16


def cached_prefix_tokens(ws: WorkerState, seq: Sequence) -> int:
    """Tokens of ``seq`` found in ``ws``'s prefix cache (full blocks; no side effects)."""
    _, num = ws.kv.get_computed_blocks(seq.all_token_ids, seq.sampling.cache_salt, count=False)
    return num


class Router:
    """Assigns new sequences to workers and finds sequences an idle worker may steal.

    Args:
        config: ``routing`` (policy) and ``routing_load_threshold`` (sequences);
            ``max_num_seqs`` bounds a victim's batch when judging what it can admit.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.policy = config.routing
        self.threshold = config.routing_load_threshold
        self.max_num_seqs = config.max_num_seqs
        self._next = 0

    def route(
        self,
        seq: Sequence,
        workers: Mapping[int, WorkerState],
        host_tokens: Callable[[WorkerState, Sequence], int] | None = None,
    ) -> WorkerState:
        """The live worker whose queue ``seq`` joins (see the module docstring).

        ``host_tokens(ws, seq)``: tokens ``ws`` would load from a host tier of the prefix
        cache beyond its device hit; such a token scores half a device hit.

        Raises:
            ValueError: no worker is alive (callers check first).
        """
        live = [ws for _, ws in sorted(workers.items()) if ws.alive]
        if not live:
            raise ValueError("no live worker to route to")
        if self.policy == "round-robin":
            ws = live[self._next % len(live)]
            self._next += 1
            return ws
        loads = {ws.spec.worker_id: ws.load for ws in live}
        least = min(live, key=lambda w: loads[w.spec.worker_id])
        if self.policy == "least-loaded":
            return least
        best, best_hit = least, 0
        for ws in live:
            # NOTE: a device hit costs nothing; a host hit costs a load: scored below it.
            hit = 2 * cached_prefix_tokens(ws, seq)
            if host_tokens is not None:
                hit += host_tokens(ws, seq)
            if hit > best_hit or (
                hit == best_hit
                and hit > 0
                and loads[ws.spec.worker_id] < loads[best.spec.worker_id]
            ):
                best, best_hit = ws, hit
        if loads[best.spec.worker_id] - loads[least.spec.worker_id] > self.threshold:
            return least  # too busy to wait for: recomputing the prefix is cheaper
        return best

    def find_stealable(
        self,
        thief: WorkerState,
        workers: Mapping[int, WorkerState],
        pinned: Callable[[Sequence], bool],
        admits: Callable[[WorkerState, Sequence], bool] | None = None,
    ) -> tuple[WorkerState, Sequence] | None:
        """A sequence queued for another live worker that ``thief`` may take, with its
        queue's worker; None when there is none.

        Victims are the busy workers (running something), most loaded first: a worker
        with an empty batch admits its own queue at its next step. Walking a victim's
        queue in order, a sequence is stealable when the victim could not admit it now
        (blocks, seats, or ``admits(victim, seq)``, the victim's own admission rule such
        as projected growth, refuses it), or when it hits nothing in the victim's prefix
        cache and the move evens the loads (the thief's load plus the sequence's width
        stays at most the victim's load minus it). The victim keeps the others (their
        blocks and seats are set aside in turn), so a burst that routing split stays
        split: without the load rule, whichever worker stepped first took every uncached
        request queued on the other. ``pinned`` sequences (beams whose siblings run) are
        never taken.
        """
        victims = [
            ws
            for ws in workers.values()
            if ws is not thief and ws.alive and ws.waiting and ws.running
        ]
        victims.sort(key=lambda w: (-w.load, w.spec.worker_id))
        thief_load = thief.load
        for victim in victims:
            victim_load = victim.load  # neither changes during the scan
            kv = victim.kv
            free = kv.num_free_blocks
            seats = self.max_num_seqs - victim.num_seats
            revived: set[int] = set()  # cached free blocks an earlier kept sequence takes
            for seq in list(victim.waiting)[:_STEAL_SCAN]:
                if pinned(seq):
                    continue
                width = 1 + len(seq.fork_children)
                computed, hit = kv.get_computed_blocks(
                    seq.all_token_ids, seq.sampling.cache_salt, count=False
                )
                if hit == 0 and thief_load + width <= victim_load - width:
                    return victim, seq
                fresh = [b for b in computed if b not in revived and kv.get_ref_count(b) == 0]
                need = -(-seq.num_tokens // kv.block_size) - len(computed) + len(fresh)
                if need > free or width > seats:
                    return victim, seq
                if admits is not None and not admits(victim, seq):
                    return victim, seq
                revived.update(fresh)
                free -= need
                seats -= width
        return None
