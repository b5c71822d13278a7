"""Parallel sampling (n > 1) and beam search: the scheduler's fork bookkeeping.

A mixin of :class:`pagedserve.scheduler.scheduler.Scheduler` (it works on the scheduler's
workers, sequences and queues; the scheduler's module docstring describes both
mechanisms). Forked sequences share blocks on the worker that holds their parent, so they
start on that worker; a beam whose request still runs elsewhere is never stolen
(:meth:`ForkingMixin._pinned`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.beam_search import BeamInput, BeamSearch
from pagedserve.scheduler.engine_messages import SequenceOutput
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.request import FinishReason, Sequence, SequenceStatus
from pagedserve.scheduler.routing import Router
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.worker_state import WorkerState


@dataclass
class BeamRequest:
    """Scheduler-side state of one beam-search request.

    ``beams`` are its running beams in running order (best first); ``pending`` holds the
    candidates of the beams that reported this round.
    """

    search: BeamSearch
    beams: list[Sequence]
    pending: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    next_id: int = 1
    num_cached_tokens: int = 0


class ForkingMixin:
    """Fork and beam-search bookkeeping of the :class:`Scheduler` (see the module docstring)."""

    workers: dict[int, WorkerState]
    sequences: dict[str, Sequence]
    requests: dict[str, list[Sequence]]
    beam_requests: dict[str, BeamRequest]
    metrics: SchedulerMetrics
    _router: Router
    _wake_others: bool

    # Provided by the Scheduler.
    def _enqueue(self, ws: WorkerState, seq: Sequence, front: bool = False) -> None:
        raise NotImplementedError

    def _queue_of(self, seq: Sequence) -> WorkerState:
        raise NotImplementedError

    def _finish(self, seq: Sequence, reason: FinishReason, record: bool = True) -> None:
        raise NotImplementedError

    def _pinned(self, seq: Sequence) -> bool:
        """A queued beam whose request has a beam running: it stays on its queue's worker
        (its siblings' blocks and the beam step are there)."""
        br = self.beam_requests.get(seq.request_id)
        return br is not None and any(b.status is SequenceStatus.RUNNING for b in br.beams)

    def _fork_children(self, ws: WorkerState, parent: Sequence) -> None:
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
        prompt_token_ids: tuple[int, ...],
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
        self.beam_requests[request_id] = BeamRequest(search, [seq])
        self.requests[request_id] = [seq]
        self.sequences[seq.seq_id] = seq
        self._enqueue(self._router.route(seq, self.workers), seq)
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

    def _fork_beam(self, br: BeamRequest, parent: Sequence) -> Sequence:
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
            self._enqueue(self._queue_of(parent), child, front=True)
        self.sequences[child.seq_id] = child
        self.requests[parent.request_id].append(child)
        return child

    def _drop_beam(self, beam: Sequence) -> None:
        """Free a pruned beam's blocks at once and forget it."""
        self._finish(beam, FinishReason.ABORT, record=False)  # not a finished choice
        self.requests[beam.request_id].remove(beam)
        self.sequences.pop(beam.seq_id, None)

    def _finish_beam_request(self, request_id: str) -> list[SequenceOutput]:
        """Free every beam and emit the n best finished beams, best first."""
        br = self.beam_requests.pop(request_id)
        seqs = self.requests.pop(request_id)
        for beam in seqs:
            if beam.status is not SequenceStatus.FINISHED:
                self._finish(beam, FinishReason.LENGTH, record=False)
            self.sequences.pop(beam.seq_id, None)
        first = seqs[0]
        eos = first.eos_token_ids
        outputs = []
        best = br.search.best(first.sampling.n)
        self.metrics.on_beam_request_finished(
            first,
            [(FinishReason.STOP if h.stopped else FinishReason.LENGTH, len(h.token_ids))
             for h in best],
        )  # fmt: skip
        for i, hyp in enumerate(best):
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
                self._finish(beam, reason, record=False)
            self.sequences.pop(beam.seq_id, None)
        first = seqs[0]
        self.metrics.on_beam_request_finished(first, [(reason, 0)] * first.sampling.n)
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
