"""Continuous-batching scheduler: admission, token budget, chunked prefill, preemption.

Pure Python and synchronous: the Ray actor in :mod:`pagedserve.scheduler.actor` drives it.
Each worker has its own block pool (a :class:`KVCacheManager`, metadata only), its own
running list and its own waiting queue (:mod:`pagedserve.scheduler.worker_state`). The
router (:mod:`pagedserve.scheduler.routing`) puts a new request on the queue of the worker
caching the longest prefix of its prompt (or the least loaded); a worker whose queue is
empty steals from the others' queues so that no worker idles while work waits.

One step for one worker (vLLM v1 ``Scheduler.schedule`` shape, Orca iteration-level batching):

1. Running sequences first, in admission order: each asks for the tokens it still has to
   compute (1 for a decode, the rest of its prompt for a prefill), capped by the token
   budget. When the block pool cannot grow the sequence, the most recently admitted
   running sequence is preempted by recompute (its blocks are freed and it returns to the
   front of its worker's waiting queue; vLLM paper §4.5) until the allocation fits.
2. Then, if nothing was preempted this step, the worker's waiting sequences are admitted
   in FCFS order while the budget, ``max_num_seqs`` and the pool allow; when its queue is
   empty, it steals from other workers' queues (:meth:`Router.find_stealable`). A new sequence first looks up the
   prefix cache (full blocks only) and computes only the rest of its prompt.

After the worker answers, :meth:`Scheduler.update` appends sampled tokens, checks stop
conditions, registers newly full blocks in the prefix cache, frees finished sequences and
returns the deltas for the frontend.

Parallel sampling (n > 1) shares the prompt's KV (PagedAttention paper §4.3): a request
enters as one sequence (choice 0) that prefills the prompt; its other choices wait as
``PENDING_FORK`` and, when the prefill completes, fork from it at ``prompt_len - 1``
tokens: they share every prompt block that holds no slot they write (``ref_count`` n) and
recompute the last prompt token to sample their own first token, so each choice draws
exactly as an independent sequence would (seeded per choice and output position). The
block holding that last slot, when shared, is copied on the first write of every holder
but the last (``blocks_to_copy``). From then on each choice is a sequence of its own:
it streams, finishes, frees its own references and is preempted (recompute; its full
prompt blocks are usually still cached and held by its siblings) on its own.

Beam search (``beam_width`` K > 1; rule in :mod:`pagedserve.scheduler.beam_search`): the
request starts as one sequence. A beam whose tokens are all computed reports its top
candidates (the worker samples nothing for it); once every running beam of the request
has reported, the scheduler picks the next K beams. A parent's first continuation keeps
its sequence (the chosen token reaches the worker as ``CachedSequenceData.new_token_ids``),
each further one forks from it (shared blocks, copy-on-write of the partial last block)
and parents without continuations are freed at once. The result (the n best finished
beams) is emitted when the search ends: one final delta per choice, best first.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.scheduler.admission import Footprint, GrowthProjection
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    IntegrityError,
    InvalidRequest,
    RequestRejected,
)
from pagedserve.scheduler.forking import BeamRequest
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.metrics import MetricsSnapshot, SchedulerMetrics
from pagedserve.scheduler.outputs import (
    CachedSequenceData,
    NewSequenceData,
    RunnerOutput,
    SchedulerOutput,
)
from pagedserve.scheduler.preemption import choose_victim
from pagedserve.scheduler.request import FinishReason, Sequence, SequenceStatus
from pagedserve.scheduler.routing import Router
from pagedserve.scheduler.swap import SwapSpec
from pagedserve.scheduler.swapping import SwapMixin
from pagedserve.scheduler.worker_state import (
    SchedulerStats,
    WorkerSpec,
    WorkerState,
    worker_stats,
)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What :meth:`Scheduler.schedule` returns.

    Attributes:
        output: the step's message, what the worker runs.
        wake_others: this step preempted, left work queued or changed sequences other
            workers may take: the callers wake the idle workers' loops.
    """

    output: SchedulerOutput
    wake_others: bool


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """What :meth:`Scheduler.update` returns.

    Attributes:
        outputs: the deltas to stream (one per sequence that got a token or finished).
        wake_others: a finish freed blocks, or work moved: the callers wake the idle
            workers' loops.
    """

    outputs: list[SequenceOutput]
    wake_others: bool


class Scheduler(SwapMixin):
    """Owns every sequence and every worker's block metadata; decides what runs each step.

    Args:
        config: token budget, batch limits, prefix caching and ``max_model_len`` (which
            must be set).
        workers: one spec per worker (the size of its KV pool).
        swap: the host block store (size, measured costs) for ``preemption_mode`` swap
            or auto; None preempts by recompute only.

    Raises:
        ValueError: when no workers are given or ``config.max_model_len`` is unset.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        workers: Iterable[WorkerSpec],
        swap: SwapSpec | None = None,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be set for a Scheduler")
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.workers: dict[int, WorkerState] = {
            w.worker_id: WorkerState(
                spec=w,
                kv=KVCacheManager(w.num_blocks, w.block_size, config.enable_prefix_caching),
            )
            for w in workers
        }
        if not self.workers:
            raise ValueError("at least one worker is required")
        self._router = Router(config)
        self.sequences: dict[str, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self.beam_requests: dict[str, BeamRequest] = {}
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.metrics = SchedulerMetrics(self.max_model_len)
        self._wake_others = False
        self._init_swap(swap)
        # The batch's sort key: arrival alone under fcfs (same order as _rank, cheaper).
        self._sort_key: Callable[[Sequence], object] = (
            operator.attrgetter("arrival_s") if config.scheduling_policy == "fcfs" else self._rank
        )

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> list[Sequence]:
        """Queue a request: one sequence per choice (``request.sampling.n``); choice 0 is
        queued, the others wait to fork from it (see the module docstring). An
        ``arrival_s`` of None is stamped now (``time.monotonic``).

        Raises:
            DuplicateRequest: the request id is in flight.
            InvalidRequest: prompt + max_tokens longer than ``max_model_len`` (an empty
                prompt cannot be an :class:`EngineRequest`).
            RequestRejected: one choice at its longest needs more slots than the largest
                live worker pool holds (it could never finish, even alone).
            ClusterUnavailable: no worker is alive.
        """
        request_id = request.request_id
        prompt_token_ids = request.prompt_token_ids
        sampling = request.sampling
        if request_id in self.requests:
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight")
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
        # Each choice must fit alone (after the fork, preemption lets them take turns), so
        # the bound is per sequence, not n times it.
        capacity = max(w.spec.num_blocks * w.spec.block_size for w in live)
        if max_total > capacity:
            raise RequestRejected(
                f"a sequence of this request needs up to {max_total} KV slots but a worker "
                f"holds only {capacity}"
            )
        arrival = time.monotonic() if request.arrival_s is None else request.arrival_s
        eos = frozenset(request.eos_token_ids)
        if sampling.use_beam_search:
            # NOTE: beams step together (a beam that reported waits for its siblings while
            # holding its blocks), so all K must fit at once, not just one at a time.
            bs = max(w.spec.block_size for w in live)
            need = sampling.beam_width * -(-max_total // bs)
            if need > max(w.spec.num_blocks for w in live):
                raise RequestRejected(
                    f"beam search with beam_width {sampling.beam_width} needs up to {need} KV "
                    "blocks at once, more than a worker's pool holds"
                )
            return self._add_beam_request(
                request_id, prompt_token_ids, sampling, eos, max_total, arrival
            )
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
        for child in seqs[1:]:
            child.status = SequenceStatus.PENDING_FORK
        seqs[0].fork_children = seqs[1:]
        self._enqueue(self._router.route(seqs[0], self.workers), seqs[0])
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
        if request_id in self.beam_requests:
            return self._abort_beam_request(request_id, reason)
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
        """True when a step on this worker may do something: it has sequences running,
        queued or to tell finished, or another live worker has a queue it may steal from."""
        ws = self.workers[worker_id]
        if not ws.alive:
            return False
        if ws.running or ws.pending_finished or ws.waiting or self._host_free_queue:
            return True
        return any(w.waiting for w in self.workers.values() if w.alive)

    def schedule(self, worker_id: int) -> StepPlan:
        """Decide one step for ``worker_id`` (see the module docstring)."""
        out = self._schedule(worker_id)
        wake, self._wake_others = self._wake_others, False
        return StepPlan(out, wake)

    def _schedule(self, worker_id: int) -> SchedulerOutput:
        ws = self.workers[worker_id]
        kv = ws.kv
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        self._step_scheduled = num_scheduled  # swap declines victims already scheduled
        # The deltas of the sequences the worker holds are built as they are scheduled
        # (all of them come from the running batch); the others are sent in full by
        # _build_output once admission is done.
        cached: list[CachedSequenceData] = []
        not_resident: list[str] = []
        resident = ws.resident
        blocks_to_copy: list[tuple[int, int]] = []
        preempted = False
        # NOTE: the batch is served in rank order (most urgent, then oldest first; stable,
        # so forks stay behind their parent) and the victim is its last sequence: an
        # older sequence's blocks are never taken by a younger one, so the oldest always
        # progresses (no mutual preemption), even after it was preempted and re-admitted.
        running = ws.running
        running.sort(key=self._sort_key)
        grow_in_place = kv.grow_in_place
        # One empty list for every empty delta of this step (new blocks, new tokens): a
        # message is read, never written, so they may share it (fewer objects per step).
        empty: list[int] = []

        # NOTE: the hot path of a step (one pass per running sequence): a decode step with
        # room in its last block takes kv.grow_in_place and builds nothing but its delta.
        idx = 0
        while idx < len(running) and budget > 0:
            seq = running[idx]
            seq_id = seq.seq_id
            # Overlapped scheduling: a step in flight counts as done, each token it will
            # sample as known (a placeholder); without overlap both counts are 0 here.
            inflight = seq.num_inflight_tokens
            pending = seq.num_pending_tokens
            computed = seq.num_computed_tokens + inflight
            if pending and self._ends_with_pending(seq):
                idx += 1  # the step in flight samples its last token
                continue
            known = len(seq.all_token_ids) + pending
            num_new = known - computed
            if num_new > budget:
                num_new = budget
            if num_new <= 0 and (inflight or self._awaits_beam_step(seq)):
                idx += 1  # reported its candidates (or will): waits for its sibling beams
                continue
            if num_new <= 0:
                # A running sequence always has its sampled token left to compute: update()
                # appends a token whenever the prompt is done, and finishes it otherwise.
                raise IntegrityError(
                    f"running sequence {seq_id!r} has nothing to compute "
                    f"({seq.num_computed_tokens} of {seq.num_tokens} tokens computed)"
                )
            total = computed + num_new
            start = grow_in_place(seq_id, total)
            if start >= 0:
                new_block_ids = empty
            else:
                while True:
                    result = kv.allocate_slots(seq_id, total)
                    if result is not None:
                        break
                    victim = self._choose_victim(ws, idx)
                    self._preempt(ws, victim)
                    preempted = True
                    if seq.status is not SequenceStatus.RUNNING:  # preempted itself (or group)
                        break
                if result is None:  # the sequence preempted itself
                    break
                start = result.start_index
                new_block_ids = result.new_block_ids or empty
                if result.blocks_to_copy:
                    blocks_to_copy.extend(result.blocks_to_copy)
            num_scheduled[seq_id] = num_new
            budget -= num_new
            idx += 1
            if seq_id not in resident:
                not_resident.append(seq_id)
                continue
            seq.num_inflight_tokens = inflight + num_new
            if total == known and seq.sampling.beam_width <= 1:
                seq.num_pending_tokens = pending + 1  # the worker samples a token for it
            unsent = seq.unsent_token_ids
            if unsent:
                seq.unsent_token_ids = []  # the message keeps the list it was given
            else:
                unsent = empty
            cached.append(CachedSequenceData(seq_id, start, new_block_ids, computed, unsent))
        num_from_running = len(num_scheduled)

        if not preempted:
            budget = self._admit(ws, budget, num_scheduled)
            # NOTE: an empty queue steals one sequence at a time, each admitted at once;
            # one that does not fit stays queued here (this worker is then not idle).
            while not ws.waiting and budget > 0:
                found = self._router.find_stealable(
                    ws, self.workers, self._pinned, self._projection_admits
                )
                if found is None:
                    break
                victim, seq = found
                victim.waiting.remove(seq)
                self._enqueue(ws, seq)
                budget = self._admit(ws, budget, num_scheduled)
            if ws.waiting and num_scheduled:
                # What this busy worker cannot admit now may be stolen by an idle one.
                self._wake_others = True

        not_resident.extend(itertools.islice(num_scheduled, num_from_running, None))
        return self._build_output(ws, num_scheduled, not_resident, cached, blocks_to_copy)

    def _admit(self, ws: WorkerState, budget: int, num_scheduled: dict[str, int]) -> int:
        if not ws.waiting:
            return budget  # NOTE: every step of a busy worker: skip the O(batch) seat count
        kv = ws.kv
        max_seqs = self.config.max_num_seqs
        # Choices still to fork from running sequences hold their seats in the batch.
        seats = ws.num_seats
        projection: GrowthProjection | None = None
        reserve = self.config.admission_reserve  # a reservation mode needs no projection
        while ws.waiting and budget > 0 and seats < max_seqs:
            seq = ws.waiting[0]
            if self._is_swapped(seq):  # resumes with its KV from the host store
                admitted = self._admit_swapped(ws, seq, budget, seats, num_scheduled)
                if admitted is None:
                    break
                budget, seats = admitted
                continue
            width = 1 + len(seq.fork_children)
            if seats + width > max_seqs and seats > 0:
                break  # n > max_num_seqs still runs, alone
            tokens = seq.all_token_ids
            salt = seq.sampling.cache_salt
            computed_blocks, num_computed = kv.get_computed_blocks(tokens, salt, count=False)
            num_new = len(tokens) - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if reserve != "none" and not self._reservation_fits(ws, seq):
                break
            footprints: list[Footprint] = []
            if self.config.admission == "projected" and reserve == "none" and ws.running:
                if projection is None:
                    projection = self._projection(ws)
                footprints = self._candidate_footprints(ws, seq, computed_blocks)
                if not projection.fits(footprints):
                    break
            result = kv.allocate_slots(seq.seq_id, num_computed + num_new, computed_blocks)
            if result is None:
                break
            ws.waiting.popleft()
            seq.queued_on = None
            if projection is not None:
                projection.add(footprints)
            kv.record_prefix_query(len(tokens), num_computed)
            seq.status = SequenceStatus.RUNNING
            seq.worker_id = ws.spec.worker_id
            seq.num_computed_tokens = num_computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            ws.running.append(seq)
            self.metrics.on_scheduled(seq)
            num_scheduled[seq.seq_id] = num_new
            budget -= num_new
            seats += width
        return budget

    def _growth(self, seq: Sequence, num_tokens: int) -> int:
        """Steps a sequence with ``num_tokens`` known tokens may still grow (its last
        sampled token is never stored), scaled by ``admission_growth_ratio``.

        NOTE: with overlapped scheduling a finished sequence's blocks are freed when its
        last step's answer is applied, which is after the next step was planned: it holds
        them one step longer, counted here as one more step of growth (at most one block
        too many per sequence)."""
        lag = 1 if self.config.async_scheduling else 0
        remaining = seq.max_total_tokens - 1 - num_tokens
        if remaining <= 0:
            return lag
        return math.ceil(remaining * self.config.admission_growth_ratio) + lag

    def _projection(self, ws: WorkerState) -> GrowthProjection:
        """The projected demand of ``ws``'s running batch (:mod:`.admission`)."""
        kv = ws.kv
        bs = ws.spec.block_size
        proj = GrowthProjection(ws.spec.num_blocks, bs, ws.spec.num_blocks - kv.num_free_blocks)
        # NOTE: O(batch) on every step that a waiting sequence is refused: _growth inlined.
        get_usage = kv.get_usage
        add_running = proj.add_running
        lag = 1 if self.config.async_scheduling else 0
        ratio = self.config.admission_growth_ratio
        ceil = math.ceil
        for seq in ws.running:
            exclusive, allocated = get_usage(seq.seq_id)
            n = len(seq.all_token_ids) + seq.num_pending_tokens
            remaining = seq.max_total_tokens - 1 - n
            growth = ceil(remaining * ratio) + lag if remaining > 0 else lag
            add_running(exclusive, allocated, n, growth)
            if seq.fork_children:
                proj.add([self._child_footprint(seq, bs) for _ in seq.fork_children])
        return proj

    def _projection_admits(self, ws: WorkerState, seq: Sequence) -> bool:
        """Whether ``ws``'s projected-growth rule would admit ``seq`` now (True when that
        rule is off or nothing runs there)."""
        if (
            self.config.admission != "projected"
            or self.config.admission_reserve != "none"
            or not ws.running
        ):
            return True
        computed, _ = ws.kv.get_computed_blocks(
            seq.all_token_ids, seq.sampling.cache_salt, count=False
        )
        return self._projection(ws).fits(self._candidate_footprints(ws, seq, computed))

    def _child_footprint(self, parent: Sequence, bs: int) -> Footprint:
        """A choice still to fork from ``parent``: it will share the prompt's full blocks."""
        p = parent.num_prompt_tokens
        return Footprint(-((p - 1) // bs), p, self._growth(parent, p))

    def _candidate_footprints(
        self, ws: WorkerState, seq: Sequence, computed_blocks: list[int]
    ) -> list[Footprint]:
        """Footprints of a waiting sequence and the choices (or beams) that will fork from
        it; its prefix-cache hits on blocks others hold add nothing."""
        kv = ws.kv
        bs = ws.spec.block_size
        held = sum(1 for b in computed_blocks if kv.get_ref_count(b) > 0)
        n = seq.num_tokens
        out = [Footprint(-held, n, self._growth(seq, n))]
        forks = len(seq.fork_children)
        if seq.sampling.use_beam_search and not seq.output_token_ids:
            forks += seq.sampling.beam_width - 1  # the beams fork from it after the prompt
        out.extend(self._child_footprint(seq, bs) for _ in range(forks))
        return out

    def _choose_victim(self, ws: WorkerState, idx: int) -> Sequence:
        """The sequence to preempt so that ``ws.running[idx]`` can grow (rank order kept:
        only it or sequences ranked after it)."""
        if self.config.preemption_victim == "latest":
            return ws.running[-1]
        return choose_victim(
            ws.running[idx], ws.running[idx + 1 :], ws.kv, lambda s: self._rank(s)[0]
        )

    def _reservation_fits(self, ws: WorkerState, seq: Sequence) -> bool:
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
        ws: WorkerState,
        num_scheduled: dict[str, int],
        not_resident: list[str],
        cached: list[CachedSequenceData],
        blocks_to_copy: list[tuple[int, int]],
    ) -> SchedulerOutput:
        """The step's message: ``cached`` (the deltas of the scheduled sequences the
        worker holds, built by :meth:`schedule`) and the others of ``num_scheduled``,
        ``not_resident`` (in batch order), sent in full."""
        new_seqs: list[NewSequenceData] = []
        for seq_id in not_resident:
            num_new = num_scheduled[seq_id]
            seq = self.sequences[seq_id]
            computed = seq.num_computed_tokens + seq.num_inflight_tokens
            seq.num_inflight_tokens += num_new
            samples = computed + num_new == seq.num_tokens + seq.num_pending_tokens
            if samples and not seq.sampling.use_beam_search:
                seq.num_pending_tokens += 1  # the worker samples a token for it
            new_seqs.append(
                NewSequenceData(
                    seq_id=seq.seq_id,
                    token_ids=list(seq.all_token_ids),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    block_ids=ws.kv.get_block_ids(seq.seq_id),  # a copy
                    num_computed_tokens=seq.num_computed_tokens,
                    sampling=seq.sampling,
                    choice_index=seq.choice_index,
                )
            )
            ws.resident.add(seq_id)
            seq.resident_since_step = ws.next_step_id
            seq.unsent_token_ids = []  # new_seqs carry every token
        swap_outs, swap_ins, host_free, free_tid = self._drain_swaps(ws)
        out = SchedulerOutput(
            step_id=ws.next_step_id,
            new_seqs=new_seqs,
            cached_seqs=cached,
            num_scheduled_tokens=num_scheduled,
            finished_seq_ids=ws.pending_finished,
            blocks_to_copy=blocks_to_copy,
            blocks_to_swap_out=swap_outs,
            blocks_to_swap_in=swap_ins,
            host_blocks_to_free=host_free,
            free_transfer_id=free_tid,
        )
        ws.pending_finished = []
        ws.next_step_id += 1
        return out

    def update(
        self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> StepUpdate:
        """Apply a worker's answer: advance computed tokens, append samples, stop, free.

        Returns the deltas to stream (one per sequence that got a token or finished) and
        whether idle workers should be woken. Sequences aborted while the step ran are
        skipped.
        """
        outputs = self._update(worker_id, sched_out, runner_out)
        wake, self._wake_others = self._wake_others, False
        return StepUpdate(outputs, wake or any(o.finish_reason is not None for o in outputs))

    def _update(
        self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> list[SequenceOutput]:
        ws = self.workers[worker_id]
        outputs: list[SequenceOutput] = []
        finished_requests: set[str] = set()
        self._apply_swap_results(worker_id, sched_out, runner_out)
        self.metrics.on_step(sum(sched_out.num_scheduled_tokens.values()))
        if runner_out.started_s > 0.0:
            if ws.last_step_end_s is not None:
                self.metrics.on_step_gap(runner_out.started_s - ws.last_step_end_s)
            ws.last_step_end_s = runner_out.started_s + runner_out.execute_time_s
        # NOTE: the hot path of a step (one pass per scheduled sequence): lookups hoisted,
        # one clock read per step (every token of a step is applied at the same time).
        sequences = self.sequences
        kv = ws.kv
        cache_blocks = kv.cache_blocks
        sampled = runner_out.sampled_token_ids
        logprobs = runner_out.logprobs
        on_token = self.metrics.on_token
        now = self.metrics.clock()
        running = SequenceStatus.RUNNING
        step_id = sched_out.step_id
        delta = self._delta
        for seq_id, num_new in sched_out.num_scheduled_tokens.items():
            seq = sequences.get(seq_id)
            if (
                seq is None
                or seq.status is not running
                or seq.worker_id != worker_id
                or step_id < seq.resident_since_step
            ):
                if seq is not None and seq.seq_id in self._groups:  # swapped out after it
                    late = self._late_answer(ws, seq, step_id, num_new, runner_out)
                    if late is not None:
                        outputs.append(late)
                        if late.finish_reason is not None:
                            finished_requests.add(seq.request_id)
                continue  # aborted, preempted or moved while the step ran
            seq.num_inflight_tokens -= num_new
            computed = seq.num_computed_tokens
            if seq.max_computed_tokens > computed:  # recomputing
                self._count_computed(ws, seq, num_new)
            else:
                seq.num_computed_tokens = seq.max_computed_tokens = computed + num_new
            sampling = seq.sampling
            if sampling.beam_width > 1:  # beam search
                cache_blocks(
                    seq_id, seq.all_token_ids, seq.num_computed_tokens, sampling.cache_salt
                )
                candidates = runner_out.beam_candidates.get(seq_id)
                if candidates is not None:
                    outputs.extend(self._beam_report(seq, candidates))
                continue
            token = sampled.get(seq_id)
            all_tokens = seq.all_token_ids
            if token is None:
                cache_blocks(seq_id, all_tokens, seq.num_computed_tokens, sampling.cache_salt)
                continue
            if seq.num_pending_tokens:
                seq.num_pending_tokens -= 1
            seq.output_token_ids.append(token)  # Sequence.append_token, inlined
            all_tokens.append(token)
            on_token(seq, now)
            if logprobs:
                lp = logprobs.get(seq_id)
                if lp is not None:
                    seq.logprobs.append(lp)
                    seq.cumulative_logprob += lp.logprob
            cache_blocks(seq_id, all_tokens, seq.num_computed_tokens, sampling.cache_salt)
            if seq.fork_children:
                self._fork_children(ws, seq)
            reason = seq.check_stop()
            if reason is not None:
                self._finish(seq, reason)
                finished_requests.add(seq.request_id)
            outputs.append(delta(seq, (token,)))
        for request_id in finished_requests:
            self._forget_if_done(request_id)
        if not ws.running:
            ws.last_step_end_s = None  # the worker may idle for want of work: no gap
        return outputs

    @staticmethod
    def _ends_with_pending(seq: Sequence) -> bool:
        """Whether the tokens the steps in flight sample end ``seq`` by length."""
        pending = seq.num_pending_tokens
        return (
            len(seq.output_token_ids) + pending >= seq.sampling.max_tokens
            or seq.num_tokens + pending >= seq.max_total_tokens
        )

    def _count_computed(self, ws: WorkerState, seq: Sequence, num_new: int) -> None:
        """Advance ``seq`` by ``num_new`` computed tokens; those below its high-water mark
        (computed before a preemption discarded them) count as recomputed."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens = end = start + num_new
        if seq.max_computed_tokens > start:
            redone = min(end, seq.max_computed_tokens) - start
            ws.num_recomputed_tokens += redone
            self.num_recomputed_tokens += redone
        if end > seq.max_computed_tokens:
            seq.max_computed_tokens = end

    # ------------------------------------------------------------------ internals
    def _rank(self, seq: Sequence) -> tuple[int, float]:
        """Scheduling rank, smaller first: (priority under the ``priority`` policy, else
        0; arrival time)."""
        prio = seq.sampling.priority if self.config.scheduling_policy == "priority" else 0
        return prio, seq.arrival_s

    def _enqueue(self, ws: WorkerState, seq: Sequence, front: bool = False) -> None:
        """Put a waiting sequence on ``ws``'s queue: at the back, or at the front for one
        that ran before (preempted, or taking over from a sequence that ran). Under the
        ``priority`` policy the queue stays in rank order: ``front`` places it before the
        sequences of equal rank, otherwise after them."""
        seq.queued_on = ws.spec.worker_id
        queue = ws.waiting
        if self.config.scheduling_policy == "priority":
            rank = self._rank(seq)
            pos = 0
            for other in queue:
                r = self._rank(other)
                if r > rank or (front and r == rank):
                    break
                pos += 1
            queue.insert(pos, seq)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def _queue_of(self, seq: Sequence) -> WorkerState:
        """The worker whose waiting queue holds ``seq``."""
        if seq.queued_on is None:
            raise IntegrityError(f"waiting sequence {seq.seq_id!r} is in no queue")
        return self.workers[seq.queued_on]

    def _preempt(self, ws: WorkerState, seq: Sequence) -> None:
        """Preempt by swap when the swap policy takes the victim (:mod:`swapping`), else
        by recompute: free the blocks, drop worker state, requeue at the front."""
        if self._try_swap_out(ws, seq):
            return
        self._release(ws, seq)
        seq.status = SequenceStatus.WAITING
        seq.worker_id = None
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        ws.num_preemptions += 1
        self.metrics.on_preempted("recompute")
        self._enqueue(ws, seq, front=True)
        self._wake_others = True  # freed blocks and a requeued sequence: others may take it

    @staticmethod
    def _release(ws: WorkerState, seq: Sequence) -> None:
        """Take a running sequence off its worker: batch, blocks, and worker state."""
        ws.running.remove(seq)
        seq.unsent_token_ids = []  # a resumed sequence is sent in full
        seq.num_inflight_tokens = seq.num_pending_tokens = 0  # answers in flight are dropped
        if ws.kv.has_seq(seq.seq_id):  # a forked 1-token-prompt choice may hold none yet
            ws.kv.free(seq.seq_id)
        if seq.seq_id in ws.resident:
            ws.resident.discard(seq.seq_id)
            ws.pending_finished.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: FinishReason, record: bool = True) -> None:
        """End ``seq`` and free what it holds; ``record``: count it as a finished sequence
        in the metrics (False for beams, which their request records as its choices)."""
        self._forget_swapped(seq)
        if seq.fork_children:
            # Ends before its prompt was computed (abort): the next choice takes over as
            # the one that prefills, in this sequence's place in the queue.
            heir, *rest = seq.fork_children
            seq.fork_children = []
            heir.fork_children = rest
            heir.status = SequenceStatus.WAITING
            if seq.status is SequenceStatus.WAITING:
                queue = self._queue_of(seq).waiting
                queue.insert(queue.index(seq), heir)
                heir.queued_on = seq.queued_on
            elif seq.worker_id is not None:
                self._enqueue(self.workers[seq.worker_id], heir, front=True)
            else:
                raise IntegrityError(f"sequence {seq.seq_id!r} with choices to fork is nowhere")
        if seq.status is SequenceStatus.PENDING_FORK:
            for other in self.requests.get(seq.request_id, []):
                if seq in other.fork_children:
                    other.fork_children.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            if seq.worker_id is None:
                raise IntegrityError(f"running sequence {seq.seq_id!r} has no worker")
            self._release(self.workers[seq.worker_id], seq)
        elif seq.status is SequenceStatus.WAITING:
            self._queue_of(seq).waiting.remove(seq)
            seq.queued_on = None
            self._wake_others = True  # the queue's worker may now admit what was behind
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.worker_id = None
        if record:
            self.metrics.on_finished(seq, reason)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs and all(s.status is SequenceStatus.FINISHED for s in seqs):
            del self.requests[request_id]
            for s in seqs:
                self.sequences.pop(s.seq_id, None)

    @staticmethod
    def _delta(seq: Sequence, new_tokens: tuple[int, ...]) -> SequenceOutput:
        if seq.sampling.logprobs is None:
            # NOTE: built for every sequence at every step: positional, in field order
            # (request_id, choice_index, new_token_ids, finish_reason, num_prompt_tokens,
            # num_output_tokens, num_cached_tokens, logprobs, cumulative_logprob,
            # stop_reason, score, num_preemptions).
            return SequenceOutput(
                seq.request_id,
                seq.choice_index,
                new_tokens,
                seq.finish_reason,
                len(seq.prompt_token_ids),
                len(seq.output_token_ids),
                seq.num_cached_tokens,
                (),
                None,
                seq.stop_reason,
                None,
                seq.num_preemptions,
            )
        return SequenceOutput(
            request_id=seq.request_id,
            choice_index=seq.choice_index,
            new_token_ids=new_tokens,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=tuple(seq.logprobs[-len(new_tokens) :]) if new_tokens else (),
            cumulative_logprob=seq.cumulative_logprob,
            stop_reason=seq.stop_reason,
            num_preemptions=seq.num_preemptions,
        )

    # ------------------------------------------------------------------ introspection
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash on every worker, all or nothing (vLLM's
        ``reset_prefix_cache``): after a weight update, or between benchmark repeats so a
        repeat does not reuse the previous one's prompts. Hit/query counters are kept.

        Returns:
            True when every pool was reset; False, with nothing changed, while any worker
            still holds a block (a request is running, waiting with blocks or being freed).
        """
        pools = [ws.kv for ws in self.workers.values()]
        if any(kv.num_free_blocks != kv.num_blocks for kv in pools):
            return False
        return all([kv.reset_prefix_cache() for kv in pools])

    def stats(self) -> SchedulerStats:
        """Counts for GetStats and metrics."""
        workers = tuple(worker_stats(ws) for _, ws in sorted(self.workers.items()))
        queries = hits = 0
        for ws in self.workers.values():
            st = ws.kv.prefix_cache_stats
            queries += st.queries_tokens
            hits += st.hits_tokens
        return SchedulerStats(
            num_running=sum(len(ws.running) for ws in self.workers.values()),
            num_waiting=sum(w.num_waiting for w in workers),
            num_preemptions=self.num_preemptions,
            workers=workers,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            swap=self.swap_stats(),
            num_recomputed_tokens=self.num_recomputed_tokens,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        """Gauges (:meth:`stats`) with the counters and histograms of
        :attr:`metrics`, for the Prometheus exporter."""
        stats = self.stats()
        return self.metrics.snapshot(
            stats, stats.swap.preemption_mode, self.config.enable_prefix_caching
        )

    def mark_worker_dead(self, worker_id: int) -> list[SequenceOutput]:
        """Take a dead worker out of service; nothing accepted is lost.

        Its running sequences are preempted (keeping their outputs) and, with the
        sequences queued for it, routed again: they join the front of a live worker's
        queue and are recomputed there (as after a recompute preemption).
        When no worker is left alive, every request is aborted instead, so no client
        waits forever. Returns the final deltas (empty unless requests were aborted).
        """
        ws = self.workers[worker_id]
        ws.alive = False
        self._swap_step_failed(worker_id)  # its transfers in flight: recompute
        for seq in reversed(list(ws.running)):
            self._preempt(ws, seq)
        ws.pending_finished.clear()  # nobody to tell
        ws.resident.clear()
        outputs: list[SequenceOutput] = []
        if not any(w.alive for w in self.workers.values()):
            for request_id in list(self.requests):
                outputs.extend(self.abort_request(request_id))
            return outputs
        requeued = list(ws.waiting)
        ws.waiting.clear()
        for seq in reversed(requeued):  # front-inserted: the queue's order is kept
            self._enqueue(self._router.route(seq, self.workers), seq, front=True)
        return outputs

    def revive_worker(self, worker_id: int) -> None:
        """Put a worker taken out of service back (its actor was restarted): a fresh,
        empty block pool, nothing resident; it rejoins routing and work stealing.

        Raises:
            IntegrityError: the worker is alive, or still holds sequences.
        """
        ws = self.workers[worker_id]
        if ws.alive or ws.running or ws.waiting:
            raise IntegrityError(f"worker {worker_id} cannot be revived: it is alive or busy")
        ws.kv = KVCacheManager(
            ws.spec.num_blocks, ws.spec.block_size, self.config.enable_prefix_caching
        )
        ws.resident.clear()
        ws.pending_finished.clear()
        ws.alive = True

    def fail_step(self, worker_id: int, sched_out: SchedulerOutput) -> list[SequenceOutput]:
        """A live worker raised on a step: abort the requests that were in it.

        The worker drops them at its next step (``finished_seq_ids``). Returns their final
        deltas (reason ABORT).
        """
        outputs: list[SequenceOutput] = []
        self._swap_step_failed(worker_id, sched_out.step_id)  # a later step's stay in flight
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
        """Check every worker's block pool (see KVCacheManager.check_integrity) and that
        every queued and running sequence is where its state says.

        Raises:
            IntegrityError: on the first violation.
        """
        self.check_swap_integrity()
        for wid, ws in self.workers.items():
            ws.kv.check_integrity()
            for seq in ws.waiting:
                if seq.status is not SequenceStatus.WAITING or seq.queued_on != wid:
                    raise IntegrityError(
                        f"{seq.seq_id!r} in worker {wid}'s queue is {seq.status.value} "
                        f"(queued_on={seq.queued_on})"
                    )
            for seq in ws.running:
                if seq.status is not SequenceStatus.RUNNING or seq.worker_id != wid:
                    raise IntegrityError(
                        f"{seq.seq_id!r} in worker {wid}'s batch is {seq.status.value} "
                        f"(worker_id={seq.worker_id})"
                    )
