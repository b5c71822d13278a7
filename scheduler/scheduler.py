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

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.scheduler.beam_search import BeamInput, BeamSearch
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    IntegrityError,
    InvalidRequest,
    RequestRejected,
)
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.metrics import MetricsSnapshot, SchedulerMetrics
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
        num_used_blocks: blocks held by at least one block table (``num_blocks -
            num_free_blocks``; a block shared by n sequences counts once).
        block_size: tokens per block.
        num_running: sequences in its running batch.
        alive: False once the worker was taken out of service.
    """

    worker_id: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    block_size: int
    num_running: int
    alive: bool


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler (counts; prefix-cache figures in tokens).

    Attributes:
        num_running: running sequences, all workers.
        num_waiting: sequences in the waiting queue (new or preempted), plus choices
            waiting for their request's prompt to fork from.
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


@dataclass
class _BeamRequest:
    """Scheduler-side state of one beam-search request.

    ``beams`` are its running beams in running order (best first); ``pending`` holds the
    candidates of the beams that reported this round.
    """

    search: BeamSearch
    beams: list[Sequence]
    pending: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    next_id: int = 1
    num_cached_tokens: int = 0


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
        self.beam_requests: dict[str, _BeamRequest] = {}
        self.num_preemptions = 0
        self.metrics = SchedulerMetrics(self.max_model_len)
        self._wake_others = False

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_s: float | None = None,
    ) -> list[Sequence]:
        """Queue a request: one sequence per choice (``sampling.n``); choice 0 is queued,
        the others wait to fork from it (see the module docstring).

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
        # Each choice must fit alone (after the fork, preemption lets them take turns), so
        # the bound is per sequence, not n times it.
        capacity = max(w.spec.num_blocks * w.spec.block_size for w in live)
        if max_total > capacity:
            raise RequestRejected(
                f"a sequence of this request needs up to {max_total} KV slots but a worker "
                f"holds only {capacity}"
            )
        arrival = time.monotonic() if arrival_s is None else arrival_s
        eos = frozenset(eos_token_ids)
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
        self.waiting.append(seqs[0])
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
            if num_new <= 0 and self._awaits_beam_step(seq):
                idx += 1  # reported its candidates; waits for its sibling beams
                continue
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
        max_seqs = self.config.max_num_seqs
        # Choices still to fork from running sequences hold their seats in the batch.
        seats = len(ws.running) + sum(len(s.fork_children) for s in ws.running)
        while self.waiting and budget > 0 and seats < max_seqs:
            seq = self.waiting[0]
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
            self.metrics.on_scheduled(seq)
            num_scheduled[seq.seq_id] = num_new
            budget -= num_new
            seats += width
        return budget

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
                        new_token_ids=seq.unsent_token_ids,
                    )
                )
            seq.unsent_token_ids = []  # new_seqs carry every token
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
        self.metrics.on_step(sum(sched_out.num_scheduled_tokens.values()))
        for seq_id, num_new in sched_out.num_scheduled_tokens.items():
            seq = self.sequences.get(seq_id)
            if (
                seq is None
                or seq.status is not SequenceStatus.RUNNING
                or seq.worker_id != worker_id
            ):
                continue  # aborted, preempted or moved while the step ran
            seq.num_computed_tokens += num_new
            salt = seq.sampling.cache_salt
            if seq.sampling.use_beam_search:
                ws.kv.cache_blocks(seq_id, seq.all_token_ids, seq.num_computed_tokens, salt)
                candidates = runner_out.beam_candidates.get(seq_id)
                if candidates is not None:
                    outputs.extend(self._beam_report(seq, candidates))
                continue
            token = runner_out.sampled_token_ids.get(seq_id)
            if token is None:
                ws.kv.cache_blocks(seq_id, seq.all_token_ids, seq.num_computed_tokens, salt)
                continue
            seq.append_token(token)
            self.metrics.on_token(seq)
            lp = runner_out.logprobs.get(seq_id)
            if lp is not None:
                seq.logprobs.append(lp)
                seq.cumulative_logprob += lp.logprob
            ws.kv.cache_blocks(seq_id, seq.all_token_ids, seq.num_computed_tokens, salt)
            if seq.fork_children:
                self._fork_children(ws, seq)
            reason = seq.check_stop()
            if reason is not None:
                self._finish(seq, reason)
                finished_requests.add(seq.request_id)
            outputs.append(self._delta(seq, (token,)))
        for request_id in finished_requests:
            self._forget_if_done(request_id)
        return outputs

    # ------------------------------------------------------------------ internals
    def _fork_children(self, ws: _WorkerState, parent: Sequence) -> None:
        """Start the pending choices of ``parent``'s request, which just computed its prompt.

        Each child shares the blocks of the prompt's first ``prompt_len - 1`` tokens and
        recomputes the last prompt token (so it samples its own first token from its own
        logits); it joins the running batch after its parent.
        """
        num_shared = parent.num_prompt_tokens - 1
        for child in parent.fork_children:
            if num_shared > 0:
                ws.kv.fork(parent.seq_id, child.seq_id, num_shared)
            # NOTE: with a 1-token prompt nothing is shared; the child's first step
            # allocates its table like a new sequence (allocate_slots on an unknown id).
            child.status = SequenceStatus.RUNNING
            child.worker_id = ws.spec.worker_id
            child.num_computed_tokens = num_shared
            child.num_cached_tokens = parent.num_cached_tokens
            ws.running.append(child)
        parent.fork_children = []

    # ------------------------------------------------------------------ beam search
    def _add_beam_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos: frozenset[int],
        max_total: int,
        arrival: float,
    ) -> list[Sequence]:
        seq = Sequence(
            seq_id=f"{request_id}/0",
            request_id=request_id,
            choice_index=0,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=eos,
            max_total_tokens=max_total,
            arrival_s=arrival,
        )
        live_eos = frozenset() if sampling.ignore_eos else eos
        search = BeamSearch(
            sampling.beam_width,
            sampling.max_tokens,
            sampling.length_penalty,
            live_eos | frozenset(sampling.stop_token_ids),
            len(live_eos),
        )
        self.beam_requests[request_id] = _BeamRequest(search, [seq])
        self.requests[request_id] = [seq]
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)
        return [seq]

    def _awaits_beam_step(self, seq: Sequence) -> bool:
        br = self.beam_requests.get(seq.request_id)
        return br is not None and seq.seq_id in br.pending

    def _beam_report(
        self, seq: Sequence, candidates: tuple[tuple[int, float], ...]
    ) -> list[SequenceOutput]:
        """Store one beam's candidates; run the beam step once every beam reported."""
        br = self.beam_requests[seq.request_id]
        if seq.num_preemptions == 0 and seq is br.beams[0] and not seq.output_token_ids:
            br.num_cached_tokens = seq.num_cached_tokens
        br.pending[seq.seq_id] = candidates
        if any(b.seq_id not in br.pending for b in br.beams):
            return []
        inputs = [
            BeamInput(b.output_token_ids, b.cumulative_logprob, br.pending[b.seq_id])
            for b in br.beams
        ]
        br.pending.clear()
        conts = br.search.step(inputs)
        if br.search.done:
            return self._finish_beam_request(seq.request_id)
        self._wake_others = True  # beams may live on other workers' running lists
        claimed: set[int] = set()
        plan: list[tuple[Sequence, int, float]] = []
        for c in conts:
            parent = br.beams[c.parent]
            if c.parent in claimed:
                # NOTE: fork before the parent appends its own token below: the child
                # shares the parent's table as computed so far.
                plan.append((self._fork_beam(br, parent), c.token_id, c.cumulative_logprob))
            else:
                claimed.add(c.parent)
                plan.append((parent, c.token_id, c.cumulative_logprob))
        for pos, beam in enumerate(br.beams):
            if pos not in claimed:
                self._drop_beam(beam)
        for beam, token, cum in plan:
            beam.append_token(token)
            beam.unsent_token_ids.append(token)
            beam.cumulative_logprob = cum
        br.beams = [beam for beam, _, _ in plan]
        return []

    def _fork_beam(self, br: _BeamRequest, parent: Sequence) -> Sequence:
        """A new beam with the parent's tokens, sharing its blocks when it is running."""
        child = Sequence(
            seq_id=f"{parent.request_id}/{br.next_id}",
            request_id=parent.request_id,
            choice_index=0,
            prompt_token_ids=parent.prompt_token_ids,
            sampling=parent.sampling,
            eos_token_ids=parent.eos_token_ids,
            max_total_tokens=parent.max_total_tokens,
            arrival_s=parent.arrival_s,
        )
        br.next_id += 1
        for token in parent.output_token_ids:
            child.append_token(token)
        if parent.status is SequenceStatus.RUNNING and parent.worker_id is not None:
            ws = self.workers[parent.worker_id]
            ws.kv.fork(parent.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            child.worker_id = parent.worker_id
            child.num_computed_tokens = parent.num_computed_tokens
            ws.running.append(child)
        else:  # the parent waits (preempted): so does the child, recomputing its tokens
            self.waiting.appendleft(child)
        self.sequences[child.seq_id] = child
        self.requests[parent.request_id].append(child)
        return child

    def _drop_beam(self, beam: Sequence) -> None:
        """Free a pruned beam's blocks at once and forget it."""
        self._finish(beam, FinishReason.ABORT)
        self.requests[beam.request_id].remove(beam)
        self.sequences.pop(beam.seq_id, None)

    def _finish_beam_request(self, request_id: str) -> list[SequenceOutput]:
        """Free every beam and emit the n best finished beams, best first."""
        br = self.beam_requests.pop(request_id)
        seqs = self.requests.pop(request_id)
        for beam in seqs:
            if beam.status is not SequenceStatus.FINISHED:
                self._finish(beam, FinishReason.LENGTH)
            self.sequences.pop(beam.seq_id, None)
        first = seqs[0]
        eos = first.eos_token_ids
        outputs = []
        for i, hyp in enumerate(br.search.best(first.sampling.n)):
            last = hyp.token_ids[-1]
            stop_id = last if hyp.stopped and last in first.sampling.stop_token_ids else None
            if stop_id is not None and last in eos and not first.sampling.ignore_eos:
                stop_id = None  # EOS is not a stop reason
            outputs.append(
                SequenceOutput(
                    request_id=request_id,
                    choice_index=i,
                    new_token_ids=hyp.token_ids,
                    finish_reason=FinishReason.STOP if hyp.stopped else FinishReason.LENGTH,
                    num_prompt_tokens=first.num_prompt_tokens,
                    num_output_tokens=len(hyp.token_ids),
                    num_cached_tokens=br.num_cached_tokens,
                    cumulative_logprob=hyp.cumulative_logprob,
                    stop_reason=stop_id,
                    score=hyp.score,
                )
            )
        return outputs

    def _abort_beam_request(self, request_id: str, reason: FinishReason) -> list[SequenceOutput]:
        """End a beam request early: every beam freed, one empty final delta per choice."""
        br = self.beam_requests.pop(request_id)
        seqs = self.requests.pop(request_id)
        for beam in seqs:
            if beam.status is not SequenceStatus.FINISHED:
                self._finish(beam, reason)
            self.sequences.pop(beam.seq_id, None)
        first = seqs[0]
        return [
            SequenceOutput(
                request_id=request_id,
                choice_index=i,
                new_token_ids=(),
                finish_reason=reason,
                num_prompt_tokens=first.num_prompt_tokens,
                num_output_tokens=0,
                num_cached_tokens=br.num_cached_tokens,
            )
            for i in range(first.sampling.n)
        ]

    def drain_wakeups(self) -> bool:
        """True once after a beam step changed sequences that may run on other workers."""
        wake, self._wake_others = self._wake_others, False
        return wake

    # ------------------------------------------------------------------ internals
    def _preempt(self, ws: _WorkerState, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, drop worker state, requeue at the front."""
        self._release(ws, seq)
        seq.status = SequenceStatus.WAITING
        seq.worker_id = None
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.metrics.on_preempted("recompute")
        self.waiting.appendleft(seq)

    @staticmethod
    def _release(ws: _WorkerState, seq: Sequence) -> None:
        """Take a running sequence off its worker: batch, blocks, and worker state."""
        ws.running.remove(seq)
        seq.unsent_token_ids = []  # a resumed sequence is sent in full
        if ws.kv.has_seq(seq.seq_id):  # a forked 1-token-prompt choice may hold none yet
            ws.kv.free(seq.seq_id)
        if seq.seq_id in ws.resident:
            ws.resident.discard(seq.seq_id)
            ws.pending_finished.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.fork_children:
            # Ends before its prompt was computed (abort): the next choice takes over as
            # the one that prefills, in this sequence's place in the queue.
            heir, *rest = seq.fork_children
            seq.fork_children = []
            heir.fork_children = rest
            heir.status = SequenceStatus.WAITING
            if seq.status is SequenceStatus.WAITING:
                self.waiting.insert(self.waiting.index(seq), heir)
            else:
                self.waiting.appendleft(heir)
        if seq.status is SequenceStatus.PENDING_FORK:
            for other in self.requests.get(seq.request_id, []):
                if seq in other.fork_children:
                    other.fork_children.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            if seq.worker_id is None:
                raise IntegrityError(f"running sequence {seq.seq_id!r} has no worker")
            self._release(self.workers[seq.worker_id], seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.worker_id = None
        self.metrics.on_finished(seq, reason)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs and all(s.status is SequenceStatus.FINISHED for s in seqs):
            del self.requests[request_id]
            for s in seqs:
                self.sequences.pop(s.seq_id, None)

    @staticmethod
    def _delta(seq: Sequence, new_tokens: tuple[int, ...]) -> SequenceOutput:
        want_lp = seq.sampling.logprobs is not None
        return SequenceOutput(
            request_id=seq.request_id,
            choice_index=seq.choice_index,
            new_token_ids=new_tokens,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=tuple(seq.logprobs[-len(new_tokens) :]) if want_lp and new_tokens else (),
            cumulative_logprob=seq.cumulative_logprob if want_lp else None,
            stop_reason=seq.stop_reason,
        )

    # ------------------------------------------------------------------ introspection
    def stats(self) -> SchedulerStats:
        """Counts for GetStats and metrics."""
        workers = tuple(
            WorkerStats(
                worker_id=wid,
                num_blocks=ws.spec.num_blocks,
                num_free_blocks=ws.kv.num_free_blocks,
                num_used_blocks=ws.spec.num_blocks - ws.kv.num_free_blocks,
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
            num_waiting=len(self.waiting)
            + sum(len(s.fork_children) for s in self.sequences.values()),
            num_preemptions=self.num_preemptions,
            workers=workers,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        """Gauges (:meth:`stats`) with the counters and histograms of
        :attr:`metrics`, for the Prometheus exporter."""
        return self.metrics.snapshot(self.stats(), "recompute", self.config.enable_prefix_caching)

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
