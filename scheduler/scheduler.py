"""Continuous-batching scheduler: admission, token budget, chunked prefill, preemption.

Pure Python and synchronous: the Ray actor in :mod:`pagedserve.scheduler.actor` drives it.
Each worker has its own block pool (a :class:`KVCacheManager`, metadata only), its own
running list and its own waiting queue (:mod:`pagedserve.scheduler.worker_state`). The
router (:mod:`pagedserve.scheduler.routing`) puts a new request on the queue of the worker
caching the longest prefix of its prompt (or the least loaded); a worker whose queue is
empty steals from the others' queues so that no worker idles while work waits.

One step for one worker (vLLM v1 ``Scheduler.schedule`` shape, Orca iteration-level batching):

1. Running sequences first, in rank order (priority under the ``priority`` policy, then
   arrival): each asks for the tokens it still has to compute (1 for a decode, the rest of
   its prompt for a prefill), capped by the token budget. When the block pool cannot grow
   the sequence, a sequence ranked after it is preempted (the one whose loss wastes least:
   :func:`~pagedserve.scheduler.preemption.choose_victim`), by swap when the swap manager
   plans it, else by recompute (its blocks are freed and it returns to the front of its
   worker's waiting queue; vLLM paper §4.5), until the allocation fits.
2. Then, if nothing was preempted this step, the worker's waiting sequences are admitted
   in rank order while the budget, ``max_num_seqs``, the pool and the admission rule
   (:mod:`~pagedserve.scheduler.admission_policy`) allow; when its queue is empty, it
   steals from other workers' queues (:meth:`Router.find_stealable`). A new sequence first
   looks up the prefix cache (full blocks only) and computes only the rest of its prompt.

After the worker answers, :meth:`Scheduler.update` appends sampled tokens, checks stop
conditions, registers newly full blocks in the prefix cache, frees finished sequences and
returns the deltas for the frontend.

Composition (mini-sglang's managers): the swap manager (:mod:`.swapping`: host pool,
swapped groups, transfers in flight) and the fork manager (:mod:`.forking`: beam-search
requests) own their state and return decisions (a planned swap-out, a swap-in plan, a
beam step, the sequences a failed transfer sends back to recompute); admission rules
(:mod:`.admission_policy`), routing and victim choice are pure policy. The scheduler
applies every change to sequences, queues and block pools itself. A step's staging (the
tokens scheduled, the swap transfers) lives in :meth:`Scheduler.schedule`'s locals, and
whether idle workers should look again is returned (``StepPlan.wake_others``,
``StepUpdate.wake_others``), never left on the object.

Prefill/decode disaggregation (``disagg``, :mod:`.disagg`): long prompts are routed to
prefill workers; at a prefill worker's step, before its batch, the requests whose prefill
finished are swapped out for a decode worker (:meth:`Scheduler._hand_off`), which admits
them with a swap-in like any swapped group.

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

Speculative decoding (``SchedulerConfig.speculative_config``): a decode of a sequence the
worker holds also carries up to K proposed tokens (:mod:`pagedserve.scheduler.proposer`,
``CachedSequenceData.spec_token_ids``; with a draft model, their number,
``num_draft_tokens``, and the worker proposes), counted in the budget and given slots like
the sequence's own token; the answer (``RunnerOutput.spec_token_ids``) moves the computed length
to the accepted tokens, rolls the rest back (:meth:`KVCacheManager.rollback`) and appends the
tokens one at a time with the stop checks. Such steps are not planned past
(:meth:`Scheduler.can_plan_past`).

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
import logging
import operator
import sys
import time
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.scheduler.admission import Footprint, GrowthProjection
from pagedserve.scheduler.admission_policy import AdmissionPolicy
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.disagg import DisaggConfig, DisaggManager, DisaggStats
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.errors import DuplicateRequest, IntegrityError
from pagedserve.scheduler.forking import BeamStep, ForkManager
from pagedserve.scheduler.intake import check_request, check_speculative, new_sequences
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.metrics import MetricsSnapshot, SchedulerMetrics
from pagedserve.scheduler.outputs import (
    CachedSequenceData,
    NewSequenceData,
    RunnerOutput,
    SampleLogprobs,
    SchedulerOutput,
    SwapPlan,
    SwapTransfer,
)
from pagedserve.scheduler.preemption import choose_victim
from pagedserve.scheduler.proposer import Proposer, make_proposer
from pagedserve.scheduler.request import FinishReason, Sequence, SequenceStatus
from pagedserve.scheduler.routing import Router
from pagedserve.scheduler.spec_stats import SpecDecodeCounters
from pagedserve.scheduler.swap import SwapSpec, SwapStats
from pagedserve.scheduler.swapping import SwapManager, SwapResolution
from pagedserve.scheduler.worker_state import (
    SchedulerStats,
    WorkerSpec,
    WorkerState,
    worker_stats,
)

_log = logging.getLogger(__name__)


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


class Scheduler:
    """Owns every sequence and every worker's block metadata; decides what runs each step.

    Args:
        config: token budget, batch limits, prefix caching and ``max_model_len`` (which
            must be set).
        workers: one spec per worker (the size of its KV pool).
        swap: the host block stores (size, measured costs) for ``preemption_mode`` swap
            or auto: one :class:`SwapSpec` shared by every worker, or one per worker that
            may swap (:func:`~pagedserve.scheduler.swap.swap_specs`; workers left out
            preempt by recompute); None preempts by recompute only.
        disagg: prefill/decode disaggregation (:mod:`pagedserve.scheduler.disagg`): the
            prefill workers and the long-prompt threshold; None: every worker prefills
            and decodes what it is routed.

    Raises:
        ValueError: when no workers are given, ``config.max_model_len`` is unset, the
            swap specs are inconsistent, or ``disagg`` names no decode worker or an
            unknown one.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        workers: Iterable[WorkerSpec],
        swap: SwapSpec | Mapping[int, SwapSpec] | None = None,
        disagg: DisaggConfig | None = None,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be set for a Scheduler")
        if config.max_num_batched_tokens is None:
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be set for a Scheduler "
                "(default_max_num_batched_tokens gives a device's default)"
            )
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.workers: dict[int, WorkerState] = {
            w.worker_id: WorkerState(
                spec=w,
                kv=KVCacheManager(
                    w.num_blocks,
                    w.block_size,
                    config.enable_prefix_caching,
                    w.kv_cache_dtype,
                    track_evictions=config.host_prefix_cache and swap is not None,
                ),
            )
            for w in workers
        }
        if not self.workers:
            raise ValueError("at least one worker is required")
        self._router = Router(config)
        self._admission = AdmissionPolicy(config, self.max_model_len)
        self._swaps = SwapManager(config, swap, self.workers)
        self._forks = ForkManager()
        self._disagg = None if disagg is None else DisaggManager(disagg, self.workers)
        self.sequences: dict[str, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.metrics = SchedulerMetrics(self.max_model_len)
        self.spec_decode = SpecDecodeCounters()
        fcfs = config.scheduling_policy == "fcfs"
        # The batch's sort key: arrival alone under fcfs (same order as _rank, cheaper).
        self._sort_key: Callable[[Sequence], Any] = (
            operator.attrgetter("arrival_s") if fcfs else self._rank
        )
        self._queue_rank = None if fcfs else self._rank  # queues in rank order (priority)
        spec = config.speculative_config
        self._speculative = spec is not None
        # None with a draft model: its worker proposes (CachedSequenceData.num_draft_tokens)
        self._proposer: Proposer | None = None if spec is None else make_proposer(spec)
        self._num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens
        limit = None if spec is None else spec.disable_by_batch_size
        self._spec_max_batch = limit if limit is not None else sys.maxsize

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
        if self._speculative:
            check_speculative(sampling)
        max_total = check_request(
            prompt_token_ids, sampling, self.workers.values(), self.max_model_len
        )
        arrival = time.monotonic() if request.arrival_s is None else request.arrival_s
        seqs = new_sequences(
            request_id,
            prompt_token_ids,
            sampling,
            frozenset(request.eos_token_ids),
            max_total,
            arrival,
        )
        if sampling.use_beam_search:
            self._forks.add(request_id, seqs[0])
        self.requests[request_id] = seqs
        for seq in seqs:
            self.sequences[seq.seq_id] = seq
        if self._disagg is not None:
            self._disagg.on_add(seqs[0])
        self._enqueue(self._route(seqs[0]), seqs[0])
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
        if self._forks.is_beam_request(request_id):
            return self._end_beam_request(request_id, reason)
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
        if ws.running or ws.pending_finished or ws.waiting or self._swaps.has_frees(worker_id):
            return True
        return any(w.waiting for w in self.workers.values() if w.alive)

    def schedule(self, worker_id: int) -> StepPlan:
        """Decide one step for ``worker_id`` (see the module docstring)."""
        ws = self.workers[worker_id]
        kv = ws.kv
        budget = self.config.max_num_batched_tokens
        assert budget is not None  # checked in __init__
        num_scheduled: dict[str, int] = {}
        # The step's transfers to and from the host store (SchedulerOutput.swap_plan).
        swap_outs: list[SwapTransfer] = []
        swap_ins: list[SwapTransfer] = []
        handed_off = False
        if self._disagg is not None:
            self._expire_kv_waits()
            if self._disagg.is_prefill_worker(worker_id):
                handed_off = self._hand_off(ws, swap_outs)
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

        speculate = self._speculative and len(running) < self._spec_max_batch
        proposer = self._proposer
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
            if num_new <= 0 and (inflight or self._forks.awaits_step(seq)):
                idx += 1  # reported its candidates (or will): waits for its sibling beams
                continue
            if num_new <= 0:
                # A running sequence always has its sampled token left to compute: update()
                # appends a token whenever the prompt is done, and finishes it otherwise.
                raise IntegrityError(
                    f"running sequence {seq_id!r} has nothing to compute "
                    f"({seq.num_computed_tokens} of {seq.num_tokens} tokens computed)"
                )
            drafts = empty
            num_draft = 0
            if speculate and num_new == 1 and not inflight and seq_id in resident:
                room = self._spec_room(seq, budget - 1)
                if proposer is None:
                    num_draft = room  # the worker's draft model proposes
                elif room > 0:
                    drafts = proposer.propose(seq.all_token_ids, room)
                num_new += len(drafts) + num_draft
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
                    self._preempt(ws, victim, num_scheduled, swap_outs)
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
            if total >= known and seq.sampling.beam_width <= 1:
                seq.num_pending_tokens = pending + 1  # the worker samples a token for it
            unsent = seq.unsent_token_ids
            if unsent:
                seq.unsent_token_ids = []  # the message keeps the list it was given
            else:
                unsent = empty
            cached.append(
                CachedSequenceData(
                    seq_id, start, new_block_ids, computed, unsent, drafts, num_draft
                )
            )
        num_from_running = len(num_scheduled)

        # Freed blocks and requeued sequences (preemption): other workers may take them.
        wake = preempted
        if not preempted:
            budget = self._admit(ws, budget, num_scheduled, swap_ins)
            # NOTE: an empty queue steals one sequence at a time, each admitted at once;
            # one that does not fit stays queued here (this worker is then not idle).
            while not ws.waiting and budget > 0:
                found = self._router.find_stealable(
                    ws,
                    self.workers,
                    lambda s: self._pinned(s, ws),
                    self._admission.projection_admits,
                )
                if found is None:
                    break
                owner, seq = found
                owner.waiting.remove(seq)
                self._enqueue(ws, seq)
                budget = self._admit(ws, budget, num_scheduled, swap_ins)
            # What this busy worker cannot admit now may be stolen by an idle one.
            wake = bool(ws.waiting and num_scheduled)

        not_resident.extend(itertools.islice(num_scheduled, num_from_running, None))
        spill = self._swaps.plan_spills(ws, kv.take_evicted())
        if spill is not None:
            swap_outs.append(spill)
        swap = SwapPlan(swap_outs, swap_ins) if swap_outs or swap_ins else None
        out = self._build_output(ws, num_scheduled, not_resident, cached, blocks_to_copy, swap)
        return StepPlan(out, wake or handed_off)

    def _admit(
        self,
        ws: WorkerState,
        budget: int,
        num_scheduled: dict[str, int],
        swap_ins: list[SwapTransfer],
    ) -> int:
        if not ws.waiting:
            return budget  # NOTE: every step of a busy worker: skip the O(batch) seat count
        kv = ws.kv
        max_seqs = self.config.max_num_seqs
        # Choices still to fork from running sequences hold their seats in the batch.
        seats = ws.num_seats
        projection: GrowthProjection | None = None
        reserve = self.config.admission_reserve  # a reservation mode needs no projection
        tier = self._swaps.tier_on(ws.spec.worker_id)
        while ws.waiting and budget > 0 and seats < max_seqs:
            seq = ws.waiting[0]
            if self._swaps.is_swapped(seq):  # resumes with its KV from the host store
                admitted = self._swap_in(ws, seq, budget, seats, num_scheduled, swap_ins)
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
            # The next full blocks may be in a host tier: loaded instead of recomputed.
            found = self._swaps.find_host_prefix(ws, seq, computed_blocks) if tier else None
            num_loaded = len(found[1]) * kv.block_size if found else 0
            num_new = len(tokens) - num_computed - num_loaded
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if reserve != "none" and not self._admission.reservation_fits(ws, seq):
                break
            footprints: list[Footprint] = []
            if self.config.admission == "projected" and reserve == "none" and ws.running:
                if projection is None:
                    projection = self._admission.projection(ws)
                footprints = self._admission.candidate_footprints(ws, seq, computed_blocks)
                if not projection.fits(footprints):
                    break
            result = kv.allocate_slots(
                seq.seq_id, num_computed + num_loaded + num_new, computed_blocks
            )
            if result is None:
                break
            if found:
                start = len(computed_blocks)
                dest = result.new_block_ids[start : start + len(found[1])]
                swap_ins.append(self._swaps.commit_load(ws, seq, found, dest))
            ws.waiting.popleft()
            seq.queued_on = None
            if projection is not None:
                projection.add(footprints)
            kv.record_prefix_query(len(tokens), num_computed)
            seq.status = SequenceStatus.RUNNING
            seq.worker_id = ws.spec.worker_id
            seq.num_computed_tokens = num_computed + num_loaded
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed + num_loaded
            ws.running.append(seq)
            self.metrics.on_scheduled(seq)
            num_scheduled[seq.seq_id] = num_new
            budget -= num_new
            seats += width
        return budget

    def _choose_victim(self, ws: WorkerState, idx: int) -> Sequence:
        """The sequence to preempt so that ``ws.running[idx]`` can grow (rank order kept:
        only it or sequences ranked after it)."""
        if self.config.preemption_victim == "latest":
            return ws.running[-1]
        return choose_victim(
            ws.running[idx], ws.running[idx + 1 :], ws.kv, lambda s: self._rank(s)[0]
        )

    def _build_output(
        self,
        ws: WorkerState,
        num_scheduled: dict[str, int],
        not_resident: list[str],
        cached: list[CachedSequenceData],
        blocks_to_copy: list[tuple[int, int]],
        swap: SwapPlan | None,
    ) -> SchedulerOutput:
        """The step's message: ``cached`` (the deltas of the scheduled sequences the
        worker holds, built by :meth:`schedule`) and the others of ``num_scheduled``,
        ``not_resident`` (in batch order), sent in full; ``swap``: the step's transfers,
        to which the host blocks waiting to be freed are added."""
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
        free, free_tid = self._swaps.host_frees(ws)
        if free:
            outs, ins = (swap.blocks_to_swap_out, swap.blocks_to_swap_in) if swap else ([], [])
            swap = SwapPlan(outs, ins, free, free_tid)
        out = SchedulerOutput(
            step_id=ws.next_step_id,
            new_seqs=new_seqs,
            cached_seqs=cached,
            num_scheduled_tokens=num_scheduled,
            finished_seq_ids=ws.pending_finished,
            blocks_to_copy=blocks_to_copy,
            swap_plan=swap,
        )
        ws.pending_finished = []
        ws.next_step_id += 1
        return out

    def update(
        self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> StepUpdate:
        """Apply a worker's answer: advance computed tokens, append samples, stop, free.

        Returns the deltas to stream (one per sequence that got a token or finished) and
        whether idle workers should be woken (a finish, a beam step, a failed transfer).
        Sequences aborted while the step ran are skipped.
        """
        ws = self.workers[worker_id]
        outputs: list[SequenceOutput] = []
        finished_requests: set[str] = set()
        resolution = self._swaps.apply_results(worker_id, sched_out, runner_out)
        wake = self._apply_resolution(worker_id, resolution)
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
        failed = runner_out.failed_seq_ids
        spec = runner_out.spec_token_ids
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
                if seq is not None and self._swaps.is_swapped(seq):  # swapped out after it
                    late = self._late_answer(ws, seq, step_id, num_new, runner_out)
                    if late is not None:
                        outputs.append(late)
                        if late.finish_reason is not None:
                            finished_requests.add(seq.request_id)
                continue  # aborted, preempted or moved while the step ran
            if spec and seq_id in spec:
                outputs.append(
                    self._apply_spec(
                        ws, seq, num_new, spec[seq_id], runner_out.spec_logprobs.get(seq_id), now
                    )
                )
                if seq.status is SequenceStatus.FINISHED:
                    finished_requests.add(seq.request_id)
                continue
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
                    beam_step = self._forks.report(seq, candidates)
                    if beam_step is not None:
                        # NOTE: beams may live on other workers' running lists or queues.
                        wake = True
                        outputs.extend(self._apply_beam_step(seq.request_id, beam_step))
                continue
            token = sampled.get(seq_id)
            all_tokens = seq.all_token_ids
            if token is None:
                if failed and seq_id in failed:
                    outputs.append(self._fail_grammar(seq, failed[seq_id]))
                    finished_requests.add(seq.request_id)
                    continue
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
                ws.start_forks(seq)
            reason = seq.check_stop()
            if reason is not None:
                self._finish(seq, reason)
                finished_requests.add(seq.request_id)
            outputs.append(delta(seq, (token,)))
        for request_id in finished_requests:
            self._forget_if_done(request_id)
        if not ws.running:
            ws.last_step_end_s = None  # the worker may idle for want of work: no gap
        return StepUpdate(outputs, wake or bool(finished_requests))

    def _spec_room(self, seq: Sequence, room: int) -> int:
        """How many tokens ``seq``'s decode may propose (>= 0): at most K, ``room`` (the
        budget left after its own token) and what its ``max_tokens`` and
        ``max_total_tokens`` leave after the token sampled behind them, so an accepted
        run never overshoots."""
        if not seq.output_token_ids or seq.sampling.beam_width > 1:
            return 0  # n > 1 choices fork at the first output token: none before it
        k = min(
            self._num_spec_tokens,
            room,
            seq.sampling.max_tokens - len(seq.output_token_ids) - 1,
            seq.max_total_tokens - len(seq.all_token_ids) - 1,
        )
        return max(k, 0)

    def _apply_spec(
        self,
        ws: WorkerState,
        seq: Sequence,
        num_new: int,
        tokens: list[int],
        logprobs: list[SampleLogprobs] | None,
        now: float,
    ) -> SequenceOutput:
        """Apply a speculative step's answer for ``seq`` (scheduled ``num_new`` = 1 +
        proposals): the KV is kept for its last token and the accepted proposals, the
        slots of the rejected ones are rolled back (blocks left empty return to the
        pool) and the tokens are appended one at a time, stopping at the first that ends
        the sequence (the rest are dropped). Returns its delta."""
        accepted = len(tokens) - 1
        if not 0 <= accepted < num_new:
            raise IntegrityError(
                f"{seq.seq_id!r}: {len(tokens)} tokens answer a step of {num_new} slots"
            )
        self.spec_decode.on_step(num_new - 1, accepted)
        seq.num_inflight_tokens -= num_new
        if seq.num_pending_tokens:
            seq.num_pending_tokens -= 1
        self._count_computed(ws, seq, accepted + 1)
        ws.kv.rollback(seq.seq_id, seq.num_computed_tokens)
        appended: list[int] = []
        reason = None
        for i, token in enumerate(tokens):
            seq.append_token(token)
            appended.append(token)
            self.metrics.on_token(seq, now)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
                seq.cumulative_logprob += logprobs[i].logprob
            reason = seq.check_stop()
            if reason is not None:
                break
        sampling = seq.sampling
        ws.kv.cache_blocks(
            seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, sampling.cache_salt
        )
        if reason is not None:
            self._finish(seq, reason)
        return self._delta(seq, tuple(appended))

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

    def _route(self, seq: Sequence) -> WorkerState:
        """The worker whose queue ``seq`` joins (:meth:`Router.route`, scoring host-tier
        hits when the tier runs; with disaggregation among the workers of its kind,
        :meth:`DisaggManager.routes`)."""
        tier = self._swaps.host_prefix_tokens if self._swaps.tier.caches else None
        workers = self.workers if self._disagg is None else self._disagg.routes(seq, self.workers)
        return self._router.route(seq, workers, tier)

    def _enqueue(self, ws: WorkerState, seq: Sequence, front: bool = False) -> None:
        """Put a waiting sequence on ``ws``'s queue (see :meth:`WorkerState.enqueue`)."""
        ws.enqueue(seq, front, self._queue_rank)

    def _queue_of(self, seq: Sequence) -> WorkerState:
        """The worker whose waiting queue holds ``seq``."""
        if seq.queued_on is None:
            raise IntegrityError(f"waiting sequence {seq.seq_id!r} is in no queue")
        return self.workers[seq.queued_on]

    def _pinned(self, seq: Sequence, thief: WorkerState) -> bool:
        """A queued sequence ``thief`` may not steal: its swap-out is in flight, its KV is
        in a store ``thief`` does not use, or it is a beam whose request has a beam
        running."""
        if self._disagg is not None and not self._disagg.may_steal(seq, thief):
            return True
        return self._swaps.pinned(seq, thief) or self._forks.pinned(seq)

    # ------------------------------------------------------------------ disaggregation
    def _hand_off(self, ws: WorkerState, swap_outs: list[SwapTransfer]) -> bool:
        """Swap the requests whose prefill ``ws`` (a prefill worker) finished out of it and
        queue them on a decode worker, waiting for their KV there
        (:mod:`pagedserve.scheduler.disagg`); a request whose swap-out declines keeps
        decoding here. Returns whether any was handed off (decode workers to wake)."""
        disagg = self._disagg
        if disagg is None:
            return False
        handed = False
        wid = ws.spec.worker_id
        for seq in disagg.ready(ws):
            decoders = disagg.decode_workers(self.workers)
            planned = None
            if decoders:
                tier = self._swaps.host_prefix_tokens if self._swaps.tier.caches else None
                target = self._router.route(seq, decoders, tier)
                planned = self._swaps.plan_swap_out(ws, seq, (), handoff=target)
            if planned is None:
                disagg.fell_back(seq.request_id)
                continue
            group, transfer = planned
            swap_outs.append(transfer)
            block_bytes = self._swaps.specs[wid].block_bytes
            disagg.handed_off(
                group, wid, target.spec.worker_id, len(transfer.block_ids), block_bytes
            )
            for s in reversed(group):  # front-inserted: the group keeps its order
                ws.release(s)
                s.status = SequenceStatus.WAITING
                s.worker_id = None  # NOTE: num_computed_tokens is kept: the KV moves
                # NOTE: at the front: its prefill is paid for and its host blocks held.
                self._enqueue(target, s, front=True)
            handed = True
        return handed

    def _expire_kv_waits(self) -> None:
        """Recompute the handed-off groups whose wait for remote KV passed its deadline:
        their stored KV is given up (host blocks freed)."""
        disagg = self._disagg
        if disagg is None or not disagg.waits:
            return
        for sid in disagg.expired(time.monotonic()):
            seq = self.sequences.get(sid)
            if seq is None or not self._swaps.is_swapped(seq):
                disagg.forget(sid)
                continue
            res = self._swaps.dissolve(seq)
            if res is None:
                continue  # its swap-out is in flight: its answer decides
            disagg.timed_out()
            ws = self._queue_of(seq)
            self._apply_resolution(ws.spec.worker_id, res)

    def disagg_stats(self) -> DisaggStats | None:
        """Disaggregation counters (None: not disaggregated)."""
        return None if self._disagg is None else self._disagg.stats()

    def _preempt(
        self,
        ws: WorkerState,
        seq: Sequence,
        scheduled: Container[str] = (),
        swap_outs: list[SwapTransfer] | None = None,
    ) -> None:
        """Preempt by swap when the swap policy takes the victim (:mod:`.swapping`; only
        in a step, whose ``swap_outs`` get the transfer), else by recompute: free the
        blocks, drop worker state, requeue at the front."""
        planned = None if swap_outs is None else self._swaps.plan_swap_out(ws, seq, scheduled)
        if swap_outs is not None and planned is not None:
            group, transfer = planned
            swap_outs.append(transfer)
            for s in reversed(group):  # front-inserted: the group keeps its order
                ws.release(s)
                s.status = SequenceStatus.WAITING
                s.worker_id = None
                s.num_preemptions += 1  # NOTE: num_computed_tokens is kept: the KV is saved
                self.num_preemptions += 1
                ws.num_preemptions += 1
                self.metrics.on_preempted("swap")
                self._enqueue(ws, s, front=True)
            return
        ws.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.worker_id = None
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        ws.num_preemptions += 1
        self.metrics.on_preempted("recompute")
        self._enqueue(ws, seq, front=True)

    def _swap_in(
        self,
        ws: WorkerState,
        seq: Sequence,
        budget: int,
        seats: int,
        num_scheduled: dict[str, int],
        swap_ins: list[SwapTransfer],
    ) -> tuple[int, int] | None:
        """Admit ``seq``'s whole swapped group on ``ws`` with a swap-in (its transfer goes
        to ``swap_ins``); returns the budget and seats left, or None (nothing admitted)
        when it does not fit now."""
        members = [self.sequences[sid] for sid in self._swaps.members_of(seq)]
        plan = self._swaps.plan_swap_in(ws, seq, members, budget, seats)
        if isinstance(plan, SwapResolution):  # dissolved: recomputed instead
            self._apply_resolution(ws.spec.worker_id, plan)
            return None
        if plan is None:
            return None
        kv = ws.kv
        bs = ws.spec.block_size
        dev: list[int] = []
        host: list[int] = []
        for r in plan.members:
            sid, shared = r.seq.seq_id, r.num_shared_blocks
            if r.parent is not None:
                kv.fork(r.parent, sid, shared * bs)
            if r.num_tokens > shared * bs and kv.allocate_slots(sid, r.num_tokens) is None:
                raise IntegrityError(f"swap-in of {sid!r}: counted blocks are missing")
            if r.num_tokens:
                ids = kv.get_block_ids(sid)
                dev.extend(ids[shared:])
                host.extend(r.host_table[shared : len(ids)])  # a late step that never answered
        for r in plan.members:
            m, n = r.seq, r.num_new
            if n > 0:
                res = kv.allocate_slots(m.seq_id, m.num_computed_tokens + n)
                if res is None or res.blocks_to_copy:
                    raise IntegrityError(f"swap-in of {m.seq_id!r}: step allocation failed")
            self._queue_of(m).waiting.remove(m)
            m.queued_on = None
            m.status = SequenceStatus.RUNNING
            m.worker_id = ws.spec.worker_id
            ws.running.append(m)
            self.metrics.on_scheduled(m)
            if n > 0:
                num_scheduled[m.seq_id] = n
            budget -= n
        swap_ins.append(self._swaps.commit_swap_in(ws, plan, dev, host))
        if self._disagg is not None:
            self._disagg.resumed(r.seq.seq_id for r in plan.members)
        return budget, seats + plan.width

    def _apply_resolution(self, worker_id: int, res: SwapResolution) -> bool:
        """Apply what resolving transfers of ``worker_id``'s steps decided; returns
        whether other workers should be woken."""
        for sid in res.recompute:
            seq = self.sequences.get(sid)
            if seq is not None:
                seq.num_computed_tokens = 0
            if self._disagg is not None:
                self._disagg.forget(sid)
        ws = self.workers[worker_id]
        for sid in res.requeue:
            seq = self.sequences.get(sid)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.worker_id != worker_id:
                continue
            ws.release(seq)
            seq.status = SequenceStatus.WAITING
            seq.worker_id = None
            seq.num_computed_tokens = 0
            self._enqueue(ws, seq, front=True)
        return res.wake

    def _late_answer(
        self, ws: WorkerState, seq: Sequence, step_id: int, num_new: int, runner_out: RunnerOutput
    ) -> SequenceOutput | None:
        """Apply step ``step_id``'s answer for ``seq``, swapped out by the step after it
        (``SwapGroup.late``); returns its delta, or None (nothing applies, or nothing
        was sampled). Call from update for a sequence that is no longer running."""
        if seq.seq_id in runner_out.spec_token_ids:
            # can_plan_past never lets a step swap out a sequence whose speculative step
            # is in flight: its accepted length would be unknown to the swap-out.
            raise IntegrityError(f"late answer of a speculative step for {seq.seq_id!r}")
        computed = seq.num_computed_tokens
        if not self._swaps.take_late(seq.seq_id, step_id, num_new, computed + num_new):
            return None
        if seq.max_computed_tokens > computed:  # recomputing
            self._count_computed(ws, seq, num_new)
        else:
            seq.num_computed_tokens = seq.max_computed_tokens = computed + num_new
        token = runner_out.sampled_token_ids.get(seq.seq_id)
        if token is None:
            error = runner_out.failed_seq_ids.get(seq.seq_id)
            return None if error is None else self._fail_grammar(seq, error)
        seq.append_token(token)
        self.metrics.on_token(seq)
        lp = runner_out.logprobs.get(seq.seq_id)
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        reason = seq.check_stop()
        if reason is not None:
            self._finish(seq, reason)  # frees its host blocks with the swap-out's result
        return self._delta(seq, (token,))

    def _fail_grammar(self, seq: Sequence, error: str) -> SequenceOutput:
        """End ``seq`` as aborted: its structured-output grammar failed on the worker
        (:attr:`RunnerOutput.failed_seq_ids`); the other sequences go on."""
        _log.warning("sequence %s aborted: %s", seq.seq_id, error)
        self._finish(seq, FinishReason.ABORT)
        return self._delta(seq, ())

    # ------------------------------------------------------------------ beam search
    def _apply_beam_step(self, request_id: str, step: BeamStep) -> list[SequenceOutput]:
        """Apply a beam step (see :class:`BeamStep` for the order); returns the request's
        final deltas when the search ended, else nothing."""
        if step.done:
            return self._end_beam_request(request_id, None)
        for c in step.continuations:
            if c.child is not None:  # NOTE: forked before the parent appends its token
                self._place_beam(c.parent, c.child)
        for beam in step.dropped:  # freed at once, forgotten (not a finished choice)
            self._finish(beam, FinishReason.ABORT, record=False)
            self.requests[request_id].remove(beam)
            self.sequences.pop(beam.seq_id, None)
        beams = []
        for c in step.continuations:
            beam = c.parent if c.child is None else c.child
            beam.append_token(c.token_id)
            beam.unsent_token_ids.append(c.token_id)
            beam.cumulative_logprob = c.cumulative_logprob
            beams.append(beam)
        self._forks.set_beams(request_id, beams)
        return []

    def _place_beam(self, parent: Sequence, child: Sequence) -> None:
        """Register a new beam beside its parent: sharing its blocks when it runs, else
        queued in front of it (recomputing its tokens)."""
        if parent.status is SequenceStatus.RUNNING and parent.worker_id is not None:
            ws = self.workers[parent.worker_id]
            ws.kv.fork(parent.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            child.worker_id = parent.worker_id
            child.num_computed_tokens = parent.num_computed_tokens
            ws.running.append(child)
        else:
            self._enqueue(self._queue_of(parent), child, front=True)
        self.sequences[child.seq_id] = child
        self.requests[parent.request_id].append(child)

    def _end_beam_request(
        self, request_id: str, reason: FinishReason | None
    ) -> list[SequenceOutput]:
        """Free every beam of a request; its final deltas: the n best finished beams when
        the search ended (``reason`` None), else one empty delta per choice."""
        seqs = self.requests.pop(request_id)
        for beam in seqs:
            if beam.status is not SequenceStatus.FINISHED:
                self._finish(beam, FinishReason.LENGTH if reason is None else reason, record=False)
            self.sequences.pop(beam.seq_id, None)
        first = seqs[0]
        if reason is None:
            outputs = self._forks.finish(request_id, first)
        else:
            outputs = self._forks.abort(request_id, first, reason)
        self.metrics.on_beam_request_finished(
            first, [(o.finish_reason, o.num_output_tokens) for o in outputs if o.finish_reason]
        )
        return outputs

    # ------------------------------------------------------------------ lifecycle
    def _finish(self, seq: Sequence, reason: FinishReason, record: bool = True) -> None:
        """End ``seq`` and free what it holds; ``record``: count it as a finished sequence
        in the metrics (False for beams, which their request records as its choices)."""
        self._swaps.forget(seq)
        if self._disagg is not None:
            self._disagg.forget(seq.seq_id)
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
            self.workers[seq.worker_id].release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._queue_of(seq).waiting.remove(seq)
            seq.queued_on = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.worker_id = None
        if record:
            self.metrics.on_finished(seq, reason)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs and all(s.status is SequenceStatus.FINISHED for s in seqs):
            if self._disagg is not None:
                self._disagg.forget_request(request_id)
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
        if not all([kv.reset_prefix_cache() for kv in pools]):
            return False
        self._swaps.tier.clear()
        return True

    def stats(self) -> SchedulerStats:
        """Counts for GetStats and metrics."""
        workers = tuple(
            worker_stats(ws, self._swaps.worker_stats(wid))
            for wid, ws in sorted(self.workers.items())
        )
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
            spec_decode=self.spec_decode.snapshot(),
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
        self._apply_resolution(worker_id, self._swaps.step_failed(worker_id))  # recompute
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
            self._enqueue(self._route(seq), seq, front=True)
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
            ws.spec.num_blocks,
            ws.spec.block_size,
            self.config.enable_prefix_caching,
            ws.spec.kv_cache_dtype,
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
        # A later step's transfers stay in flight.
        self._apply_resolution(worker_id, self._swaps.step_failed(worker_id, sched_out.step_id))
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

    def can_plan_past(self, sched_out: SchedulerOutput) -> bool:
        """Whether the worker's next step may be planned while ``sched_out`` is in flight
        (overlapped scheduling): False when it swaps a group in, whose failure makes the
        worker drop the group (see :mod:`.swapping`), and with speculative decoding for a
        step of resident sequences (unless its batch switches proposals off)."""
        swap = sched_out.swap_plan
        if (
            self._speculative
            and sched_out.cached_seqs
            and len(sched_out.num_scheduled_tokens) < self._spec_max_batch
        ):
            # NOTE: a proposal needs the sequence's last token, which the scheduler does
            # not have while the step that samples it runs, and a speculative step's
            # answer decides how many slots and positions the next one starts from: with
            # speculation, steps of sequences the worker holds are not planned past,
            # unless their batch is large enough to switch proposals off.
            return False
        return swap is None or not swap.blocks_to_swap_in

    def swap_spec(self, worker_id: int) -> SwapSpec | None:
        """``worker_id``'s host block store and start-up costs; None: it preempts by
        recompute only."""
        return self._swaps.specs.get(worker_id)

    def swap_stats(self) -> SwapStats:
        """Swap counters and host pool occupancy (see :class:`SwapStats`)."""
        return self._swaps.stats(dict(self.metrics.num_preemptions))

    def check_integrity(self) -> None:
        """Check every worker's block pool and queues (:meth:`WorkerState.check_integrity`)
        and the host pool (:meth:`SwapManager.check_integrity`).

        Raises:
            IntegrityError: on the first violation.
        """
        self._swaps.check_integrity(self.sequences)
        if self._disagg is not None:
            self._disagg.check_integrity(self.sequences, set(self._swaps.groups))
        for ws in self.workers.values():
            ws.check_integrity()
