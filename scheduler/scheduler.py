"""Continuous-batching scheduler: admission, token budget, chunked prefill, preemption.

Pure Python and synchronous: the Ray actor in :mod:`pagedserve.scheduler.actor` drives it.
Each worker has its own block pool (a :class:`KVCacheManager`, metadata only) and its own
running list; the waiting queue is shared, so a new sequence goes to whichever worker has
room first (FCFS).

One step for one worker (vLLM v1 ``Scheduler.schedule`` shape, Orca iteration-level batching):

1. Running sequences first, in admission order: each asks for the tokens it still has to
   compute (1 for a decode, the rest of its prompt for a prefill), capped by the token
   budget. When the block pool cannot grow the sequence, the most recently admitted
   running sequence is preempted by recompute (its blocks are freed and it returns to the
   front of the waiting queue; vLLM paper §4.5) until the allocation fits.
2. Then, if nothing was preempted this step, waiting sequences are admitted in FCFS order
   while the budget, ``max_num_seqs`` and the pool allow. A new sequence first looks up the
   prefix cache (full blocks only) and computes only the rest of its prompt.

After the worker answers, :meth:`Scheduler.update` appends sampled tokens, checks stop
conditions, registers newly full blocks in the prefix cache, frees finished sequences and
returns the deltas for the frontend.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    IntegrityError,
    InvalidRequest,
    RequestRejected,
)
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.outputs import (
    CachedSequenceData,
    NewSequenceData,
    RunnerOutput,
    SchedulerOutput,
)
from pagedserve.scheduler.request import FinishReason, Sequence, SequenceOutput, SequenceStatus
from pagedserve.scheduler.sampling_params import SamplingParams


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
class _WorkerState:
    """The scheduler's view of one worker.

    ``resident`` holds the ids of the sequences whose state the worker keeps (sent once as
    :class:`NewSequenceData`, until they appear in ``finished_seq_ids``).
    """

    spec: WorkerSpec
    kv: KVCacheManager
    running: list[Sequence] = field(default_factory=list)
    resident: set[str] = field(default_factory=set)
    pending_finished: list[str] = field(default_factory=list)
    next_step_id: int = 0
    alive: bool = True


@dataclass(frozen=True)
class WorkerStats:
    """A snapshot of one worker's pool and batch.

    Attributes:
        worker_id: the worker's index.
        num_blocks: physical KV blocks in its pool.
        num_free_blocks: blocks not held by any sequence (cached-evictable included).
        block_size: tokens per block.
        num_running: sequences in its running batch.
        alive: False once the worker was taken out of service.
    """

    worker_id: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    alive: bool


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler (counts; prefix-cache figures in tokens).

    Attributes:
        num_running: running sequences, all workers.
        num_waiting: sequences in the waiting queue (new or preempted).
        num_preemptions: preemptions since start.
        workers: one :class:`WorkerStats` per worker, by worker id.
        prefix_cache_queries: prompt tokens looked up in the prefix cache.
        prefix_cache_hits: of those, tokens found cached.
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    workers: tuple[WorkerStats, ...]
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    """Owns every sequence and every worker's block metadata; decides what runs each step.

    Args:
        config: token budget, batch limits, prefix caching and ``max_model_len`` (which
            must be set).
        workers: one spec per worker (the size of its KV pool).

    Raises:
        ValueError: when no workers are given or ``config.max_model_len`` is unset.
    """

    def __init__(self, config: SchedulerConfig, workers: Iterable[WorkerSpec]) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be set for a Scheduler")
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.workers: dict[int, _WorkerState] = {
            w.worker_id: _WorkerState(
                spec=w,
                kv=KVCacheManager(w.num_blocks, w.block_size, config.enable_prefix_caching),
            )
            for w in workers
        }
        if not self.workers:
            raise ValueError("at least one worker is required")
        self.waiting: deque[Sequence] = deque()
        self.sequences: dict[str, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_s: float | None = None,
    ) -> list[Sequence]:
        """Queue a request: one sequence per choice (``sampling.n``).

        Raises:
            DuplicateRequest: the request id is in flight.
            InvalidRequest: empty prompt, or prompt + max_tokens longer than
                ``max_model_len``.
            RequestRejected: one choice at its longest needs more slots than the largest
                live worker pool holds (it could never finish, even alone).
            ClusterUnavailable: no worker is alive.
        """
        if request_id in self.requests:
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        prompt_len = len(prompt_token_ids)
        if prompt_len + sampling.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        max_total = prompt_len + sampling.max_tokens
        live = [w for w in self.workers.values() if w.alive]
        if not live:
            raise ClusterUnavailable("no worker is alive")
        # Choices are independent sequences: each must fit alone (preemption lets them
        # take turns), so the bound is per sequence, not n times it.
        capacity = max(w.spec.num_blocks * w.spec.block_size for w in live)
        if max_total > capacity:
            raise RequestRejected(
                f"a sequence of this request needs up to {max_total} KV slots but a worker "
                f"holds only {capacity}"
            )
        arrival = time.monotonic() if arrival_s is None else arrival_s
        eos = frozenset(eos_token_ids)
        seqs = [
            Sequence(
                seq_id=f"{request_id}/{i}",
                request_id=request_id,
                choice_index=i,
                prompt_token_ids=list(prompt_token_ids),
                sampling=sampling,
                eos_token_ids=eos,
                max_total_tokens=max_total,
                arrival_s=arrival,
            )
            for i in range(sampling.n)
        ]
        self.requests[request_id] = seqs
        for seq in seqs:
            self.sequences[seq.seq_id] = seq
            self.waiting.append(seq)
        return seqs

    def abort_request(
        self,
        request_id: str,
        choice_index: int | None = None,
        reason: FinishReason = FinishReason.ABORT,
    ) -> list[SequenceOutput]:
        """End unfinished choices of a request (all, or one) and free their blocks.

        Args:
            request_id: the request.
            choice_index: only this choice (e.g. it hit a stop string); None = all.
            reason: the finish reason recorded (ABORT, or STOP for a stop string).

        Returns the final deltas; empty when nothing was in flight.
        """
        outputs = []
        for seq in self.requests.get(request_id, []):
            if choice_index is not None and seq.choice_index != choice_index:
                continue
            if seq.status is not SequenceStatus.FINISHED:
                self._finish(seq, reason)
                outputs.append(self._delta(seq, ()))
        self._forget_if_done(request_id)
        return outputs

    # ------------------------------------------------------------------ stepping
    def has_work(self, worker_id: int) -> bool:
        """True when a step on this worker would do something."""
        ws = self.workers[worker_id]
        return ws.alive and bool(ws.running or ws.pending_finished or self.waiting)

    def schedule(self, worker_id: int) -> SchedulerOutput:
        """Decide one step for ``worker_id`` (see the module docstring)."""
        ws = self.workers[worker_id]
        kv = ws.kv
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        # Per-step staging (vLLM's req_to_new_blocks): seq_id -> (new_blocks_start,
        # new_block_ids) of the block-table delta allocated in this step.
        new_blocks: dict[str, tuple[int, list[int]]] = {}
        blocks_to_copy: list[tuple[int, int]] = []
        preempted = False

        idx = 0
        while idx < len(ws.running) and budget > 0:
            seq = ws.running[idx]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                # A running sequence always has its sampled token left to compute: update()
                # appends a token whenever the prompt is done, and finishes it otherwise.
                raise IntegrityError(
                    f"running sequence {seq.seq_id!r} has nothing to compute "
                    f"({seq.num_computed_tokens} of {seq.num_tokens} tokens computed)"
                )
            while True:
                result = kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new)
                if result is not None:
                    break
                victim = ws.running[-1]
                self._preempt(ws, victim)
                preempted = True
                if victim is seq:
                    break
            if result is None:  # the sequence preempted itself
                break
            new_blocks[seq.seq_id] = (result.start_index, list(result.new_block_ids))
            blocks_to_copy.extend(result.blocks_to_copy)
            num_scheduled[seq.seq_id] = num_new
            budget -= num_new
            idx += 1

        if not preempted:
            budget = self._admit(ws, budget, num_scheduled)

        return self._build_output(ws, num_scheduled, new_blocks, blocks_to_copy)

    def _admit(self, ws: _WorkerState, budget: int, num_scheduled: dict[str, int]) -> int:
        kv = ws.kv
        while self.waiting and budget > 0 and len(ws.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.all_token_ids
            computed_blocks, num_computed = kv.get_computed_blocks(tokens, count=False)
            num_new = len(tokens) - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.config.admission_reserve != "none" and not self._reservation_fits(ws, seq):
                break
            result = kv.allocate_slots(seq.seq_id, num_computed + num_new, computed_blocks)
            if result is None:
                break
            self.waiting.popleft()
            kv.record_prefix_query(len(tokens), num_computed)
            seq.status = SequenceStatus.RUNNING
            seq.worker_id = ws.spec.worker_id
            seq.num_computed_tokens = num_computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            ws.running.append(seq)
            num_scheduled[seq.seq_id] = num_new
            budget -= num_new
        return budget

    def _reservation_fits(self, ws: _WorkerState, seq: Sequence) -> bool:
        """Whether the free pool covers ``seq``'s whole reservation (``admission_reserve``).

        NOTE: the reservation is accounted, not allocated: running sequences still take
        their blocks as they grow (block tables and copy-on-write as in paged mode), but
        blocks they reserved and have not yet taken are never lent to a new admission, so
        no running sequence is ever preempted. Prefix-cache hits are not credited.
        """
        bs = ws.spec.block_size
        cap = ws.spec.num_blocks  # a reservation beyond the pool could never be admitted

        def reserved(s: Sequence) -> int:
            tokens = s.max_total_tokens
            if self.config.admission_reserve == "max_model_len":
                tokens = self.max_model_len
            return min(-(-tokens // bs), cap)

        owed = sum(reserved(s) - len(ws.kv.get_block_ids(s.seq_id)) for s in ws.running)
        return reserved(seq) + owed <= ws.kv.num_free_blocks

    def _build_output(
        self,
        ws: _WorkerState,
        num_scheduled: dict[str, int],
        new_blocks: dict[str, tuple[int, list[int]]],
        blocks_to_copy: list[tuple[int, int]],
    ) -> SchedulerOutput:
        new_seqs: list[NewSequenceData] = []
        cached: list[CachedSequenceData] = []
        for seq_id in num_scheduled:
            seq = self.sequences[seq_id]
            if seq_id not in ws.resident:
                new_seqs.append(
                    NewSequenceData(
                        seq_id=seq.seq_id,
                        token_ids=list(seq.all_token_ids),
                        num_prompt_tokens=seq.num_prompt_tokens,
                        block_ids=list(ws.kv.get_block_ids(seq.seq_id)),
                        num_computed_tokens=seq.num_computed_tokens,
                        sampling=seq.sampling,
                        choice_index=seq.choice_index,
                    )
                )
                ws.resident.add(seq_id)
            else:
                start, block_ids = new_blocks[seq_id]
                cached.append(
                    CachedSequenceData(
                        seq_id=seq.seq_id,
                        new_blocks_start=start,
                        new_block_ids=block_ids,
                        num_computed_tokens=seq.num_computed_tokens,
                    )
                )
        out = SchedulerOutput(
            step_id=ws.next_step_id,
            new_seqs=new_seqs,
            cached_seqs=cached,
            num_scheduled_tokens=num_scheduled,
            finished_seq_ids=ws.pending_finished,
            blocks_to_copy=blocks_to_copy,
        )
        ws.pending_finished = []
        ws.next_step_id += 1
        return out

    def update(
        self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> list[SequenceOutput]:
        """Apply a worker's answer: advance computed tokens, append samples, stop, free.

        Returns the deltas to stream (one per sequence that got a token or finished).
        Sequences aborted while the step ran are skipped.
        """
        ws = self.workers[worker_id]
        outputs: list[SequenceOutput] = []
        finished_requests: set[str] = set()
        for seq_id, num_new in sched_out.num_scheduled_tokens.items():
            seq = self.sequences.get(seq_id)
            if (
                seq is None
                or seq.status is not SequenceStatus.RUNNING
                or seq.worker_id != worker_id
            ):
                continue  # aborted, preempted or moved while the step ran
            seq.num_computed_tokens += num_new
            token = runner_out.sampled_token_ids.get(seq_id)
            if token is None:
                ws.kv.cache_blocks(seq_id, seq.all_token_ids, seq.num_computed_tokens)
                continue
            seq.append_token(token)
            ws.kv.cache_blocks(seq_id, seq.all_token_ids, seq.num_computed_tokens)
            reason = seq.check_stop()
            if reason is not None:
                self._finish(seq, reason)
                finished_requests.add(seq.request_id)
            outputs.append(self._delta(seq, (token,)))
        for request_id in finished_requests:
            self._forget_if_done(request_id)
        return outputs

    # ------------------------------------------------------------------ internals
    def _preempt(self, ws: _WorkerState, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, drop worker state, requeue at the front."""
        self._release(ws, seq)
        seq.status = SequenceStatus.WAITING
        seq.worker_id = None
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    @staticmethod
    def _release(ws: _WorkerState, seq: Sequence) -> None:
        """Take a running sequence off its worker: batch, blocks, and worker state."""
        ws.running.remove(seq)
        ws.kv.free(seq.seq_id)
        if seq.seq_id in ws.resident:
            ws.resident.discard(seq.seq_id)
            ws.pending_finished.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            if seq.worker_id is None:
                raise IntegrityError(f"running sequence {seq.seq_id!r} has no worker")
            self._release(self.workers[seq.worker_id], seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.worker_id = None

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs and all(s.status is SequenceStatus.FINISHED for s in seqs):
            del self.requests[request_id]
            for s in seqs:
                self.sequences.pop(s.seq_id, None)

    @staticmethod
    def _delta(seq: Sequence, new_tokens: tuple[int, ...]) -> SequenceOutput:
        return SequenceOutput(
            request_id=seq.request_id,
            choice_index=seq.choice_index,
            new_token_ids=new_tokens,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ------------------------------------------------------------------ introspection
    def stats(self) -> SchedulerStats:
        """Counts for GetStats and metrics."""
        workers = tuple(
            WorkerStats(
                worker_id=wid,
                num_blocks=ws.spec.num_blocks,
                num_free_blocks=ws.kv.num_free_blocks,
                block_size=ws.spec.block_size,
                num_running=len(ws.running),
                alive=ws.alive,
            )
            for wid, ws in sorted(self.workers.items())
        )
        queries = hits = 0
        for ws in self.workers.values():
            st = ws.kv.prefix_cache_stats
            queries += st.queries_tokens
            hits += st.hits_tokens
        return SchedulerStats(
            num_running=sum(len(ws.running) for ws in self.workers.values()),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            workers=workers,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )

    def mark_worker_dead(self, worker_id: int) -> list[SequenceOutput]:
        """Take a dead worker out of service; nothing accepted is lost.

        Its running sequences go back to the front of the waiting queue, keeping their
        outputs, and are recomputed on a live worker (as after a recompute preemption).
        When no worker is left alive, every request is aborted instead, so no client
        waits forever. Returns the final deltas (empty unless requests were aborted).
        """
        ws = self.workers[worker_id]
        ws.alive = False
        for seq in reversed(list(ws.running)):
            self._preempt(ws, seq)
        ws.pending_finished.clear()  # nobody to tell
        ws.resident.clear()
        outputs: list[SequenceOutput] = []
        if not any(w.alive for w in self.workers.values()):
            for request_id in list(self.requests):
                outputs.extend(self.abort_request(request_id))
        return outputs

    def fail_step(self, worker_id: int, sched_out: SchedulerOutput) -> list[SequenceOutput]:
        """A live worker raised on a step: abort the requests that were in it.

        The worker drops them at its next step (``finished_seq_ids``). Returns their final
        deltas (reason ABORT).
        """
        outputs: list[SequenceOutput] = []
        for request_id in {
            self.sequences[s].request_id
            for s in sched_out.num_scheduled_tokens
            if s in self.sequences
        }:
            outputs.extend(self.abort_request(request_id))
        return outputs

    @property
    def num_live_workers(self) -> int:
        return sum(1 for w in self.workers.values() if w.alive)

    def check_integrity(self) -> None:
        """Check every worker's block pool (see KVCacheManager.check_integrity)."""
        for ws in self.workers.values():
            ws.kv.check_integrity()
