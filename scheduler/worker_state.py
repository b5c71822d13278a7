"""The scheduler's view of one worker (pool, batch, waiting queue) and the stats snapshots.

Each worker has its own block pool (a :class:`KVCacheManager`, metadata only), its own
running batch and its own waiting queue: the router (:mod:`pagedserve.scheduler.routing`)
assigns every new request to one worker's queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Sequence, SequenceStatus
from pagedserve.scheduler.spec_stats import SpecDecodeStats
from pagedserve.scheduler.swap import SwapStats, WorkerSwapStats


@dataclass(frozen=True)
class WorkerSpec:
    """What the scheduler needs to know about one worker's KV pool.

    Attributes:
        worker_id: the worker's index.
        num_blocks: physical KV blocks in its pool.
        block_size: tokens per block.
        dtype: the worker's model dtype name, e.g. ``"bfloat16"`` (reported in stats).
        kv_cache_dtype: its KV pool's dtype name; it enters the prefix-cache block hashes
            (:func:`~pagedserve.scheduler.block_hash.extra_keys_for_block`), so pools of
            different dtypes never share a hit. ``""``: unknown (simulated workers).
    """

    worker_id: int
    num_blocks: int
    block_size: int
    dtype: str = ""
    kv_cache_dtype: str = ""


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

    def enqueue(
        self,
        seq: Sequence,
        front: bool = False,
        rank: Callable[[Sequence], tuple[int, float]] | None = None,
    ) -> None:
        """Put a waiting sequence on this queue: at the back, or at the front for one that
        ran before (preempted, or taking over from a sequence that ran). With ``rank``
        (the ``priority`` policy) the queue stays in rank order: ``front`` places it
        before the sequences of equal rank, otherwise after them."""
        seq.queued_on = self.spec.worker_id
        queue = self.waiting
        if rank is not None:
            key = rank(seq)
            pos = 0
            for other in queue:
                r = rank(other)
                if r > key or (front and r == key):
                    break
                pos += 1
            queue.insert(pos, seq)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def release(self, seq: Sequence) -> None:
        """Take a running sequence off this worker: batch, blocks, and worker state."""
        self.running.remove(seq)
        seq.unsent_token_ids = []  # a resumed sequence is sent in full
        seq.num_inflight_tokens = seq.num_pending_tokens = 0  # answers in flight are dropped
        if self.kv.has_seq(seq.seq_id):  # a forked 1-token-prompt choice may hold none yet
            self.kv.free(seq.seq_id)
        if seq.seq_id in self.resident:
            self.resident.discard(seq.seq_id)
            self.pending_finished.append(seq.seq_id)

    def start_forks(self, parent: Sequence) -> None:
        """Start the pending choices of ``parent``'s request, which just computed its prompt.

        Each child shares the blocks of the prompt's first ``prompt_len - 1`` tokens and
        recomputes the last prompt token (so it samples its own first token from its own
        logits); it joins the running batch after its parent.
        """
        num_shared = parent.num_prompt_tokens - 1
        for child in parent.fork_children:
            if num_shared > 0:
                self.kv.fork(parent.seq_id, child.seq_id, num_shared)
            # NOTE: with a 1-token prompt nothing is shared; the child's first step
            # allocates its table like a new sequence (allocate_slots on an unknown id).
            child.status = SequenceStatus.RUNNING
            child.worker_id = self.spec.worker_id
            child.num_computed_tokens = num_shared
            child.num_cached_tokens = parent.num_cached_tokens
            self.running.append(child)
        parent.fork_children = []

    def check_integrity(self) -> None:
        """Check the block pool (see KVCacheManager.check_integrity) and that every queued
        and running sequence is where its state says.

        Raises:
            IntegrityError: on the first violation.
        """
        wid = self.spec.worker_id
        self.kv.check_integrity()
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.queued_on != wid:
                raise IntegrityError(
                    f"{seq.seq_id!r} in worker {wid}'s queue is {seq.status.value} "
                    f"(queued_on={seq.queued_on})"
                )
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING or seq.worker_id != wid:
                raise IntegrityError(
                    f"{seq.seq_id!r} in worker {wid}'s batch is {seq.status.value} "
                    f"(worker_id={seq.worker_id})"
                )


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
        dtype: the model's dtype name (:class:`WorkerSpec`).
        kv_cache_dtype: the KV pool's dtype name.
        swap: its swap counters (its own store's transfers).
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
    dtype: str = ""
    kv_cache_dtype: str = ""
    swap: WorkerSwapStats = field(default_factory=WorkerSwapStats)


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
        spec_decode: speculative decoding counters (all zero when it is off).
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    workers: tuple[WorkerStats, ...]
    prefix_cache_queries: int
    prefix_cache_hits: int
    swap: SwapStats = field(default_factory=SwapStats)
    num_recomputed_tokens: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)


def worker_stats(ws: WorkerState, swap: WorkerSwapStats | None = None) -> WorkerStats:
    """The stats snapshot of one worker (``swap``: its swap counters; None: none)."""
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
        dtype=ws.spec.dtype,
        kv_cache_dtype=ws.spec.kv_cache_dtype,
        swap=swap or WorkerSwapStats(),
    )
