"""The scheduler's view of one worker (pool, batch, waiting queue) and the stats snapshots.

Each worker has its own block pool (a :class:`KVCacheManager`, metadata only), its own
running batch and its own waiting queue: the router (:mod:`pagedserve.scheduler.routing`)
assigns every new request to one worker's queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Sequence
from pagedserve.scheduler.swap import SwapStats


@dataclass(frozen=True)
class WorkerSpec:
    """What the scheduler needs to know about one worker's KV pool.

    Attributes:
        worker_id: the worker's index.
        num_blocks: physical KV blocks in its pool.
        block_size: tokens per block.
    """

    worker_id: int
    num_blocks: int
    block_size: int


@dataclass
class WorkerState:
    """The scheduler's view of one worker.

    ``waiting`` holds the sequences routed to this worker and not admitted yet (new or
    preempted), in admission order. ``resident`` holds the ids of the sequences whose
    state the worker keeps (sent once as :class:`NewSequenceData`, until they appear in
    ``finished_seq_ids``).
    """

    spec: WorkerSpec
    kv: KVCacheManager
    running: list[Sequence] = field(default_factory=list)
    waiting: deque[Sequence] = field(default_factory=deque)
    resident: set[str] = field(default_factory=set)
    pending_finished: list[str] = field(default_factory=list)
    next_step_id: int = 0
    alive: bool = True
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    # When the worker's last step ended (its clock) if work remained; None when idle.
    last_step_end_s: float | None = None

    @property
    def load(self) -> int:
        """The routing load: sequences running or queued here, counting the choices that
        will fork from them (each becomes a sequence of this worker)."""
        seqs = len(self.running) + len(self.waiting)
        forks = sum(len(s.fork_children) for s in self.running)
        return seqs + forks + sum(len(s.fork_children) for s in self.waiting)

    @property
    def num_seats(self) -> int:
        """Seats of the running batch taken (running sequences and their pending forks)."""
        return len(self.running) + sum(len(s.fork_children) for s in self.running)


@dataclass(frozen=True)
class WorkerStats:
    """A snapshot of one worker's pool, batch and queue.

    Attributes:
        worker_id: the worker's index.
        num_blocks: physical KV blocks in its pool.
        num_free_blocks: blocks not held by any sequence (cached-evictable included).
        num_used_blocks: blocks held by at least one block table (``num_blocks -
            num_free_blocks``; a block shared by n sequences counts once).
        block_size: tokens per block.
        num_running: sequences in its running batch.
        alive: False once the worker was taken out of service.
        num_waiting: sequences in its waiting queue, plus choices waiting to fork from its
            queued or running sequences.
        prefix_cache_hit_rate: prompt tokens found in its prefix cache / tokens looked up
            there, since start (0.0 before the first lookup).
        num_preemptions: running sequences preempted on this worker, since start.
        num_recomputed_tokens: tokens this worker computed again after a preemption had
            discarded their K/V (prefix-cache hits are not recomputed), since start.
    """

    worker_id: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    block_size: int
    num_running: int
    alive: bool
    num_waiting: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler (counts; prefix-cache figures in tokens).

    Attributes:
        num_running: running sequences, all workers.
        num_waiting: sequences in the waiting queues (new or preempted), plus choices
            waiting for their request's prompt to fork from.
        num_preemptions: preemptions since start.
        workers: one :class:`WorkerStats` per worker, by worker id.
        prefix_cache_queries: prompt tokens looked up in the prefix cache.
        prefix_cache_hits: of those, tokens found cached.
        swap: swap preemption counters and host pool occupancy.
        num_recomputed_tokens: tokens computed again after a preemption, all workers.
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    workers: tuple[WorkerStats, ...]
    prefix_cache_queries: int
    prefix_cache_hits: int
    swap: SwapStats = field(default_factory=SwapStats)
    num_recomputed_tokens: int = 0


def worker_stats(ws: WorkerState) -> WorkerStats:
    """The stats snapshot of one worker."""
    return WorkerStats(
        worker_id=ws.spec.worker_id,
        num_blocks=ws.spec.num_blocks,
        num_free_blocks=ws.kv.num_free_blocks,
        num_used_blocks=ws.spec.num_blocks - ws.kv.num_free_blocks,
        block_size=ws.spec.block_size,
        num_running=len(ws.running),
        alive=ws.alive,
        num_waiting=ws.load - len(ws.running),
        prefix_cache_hit_rate=ws.kv.prefix_cache_stats.hit_rate,
        num_preemptions=ws.num_preemptions,
        num_recomputed_tokens=ws.num_recomputed_tokens,
    )
