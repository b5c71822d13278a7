"""Beam search requests: the fork manager's state and decisions.

:class:`ForkManager` owns the state of every beam-search request (its running beams,
the candidates reported this round, the search itself; the rule is in
:mod:`pagedserve.scheduler.beam_search`) and returns decisions; the
:class:`pagedserve.scheduler.scheduler.Scheduler` applies them to sequences, queues and
block pools (the scheduler's module docstring describes both parallel sampling and beam
search). Forked beams share blocks on the worker that holds their parent, so a beam whose
request still runs elsewhere is never stolen (:meth:`ForkManager.pinned`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.beam_search import BeamInput, BeamSearch
from pagedserve.scheduler.engine_messages import SequenceOutput
from pagedserve.scheduler.request import FinishReason, Sequence, SequenceStatus


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


@dataclass(frozen=True, slots=True)
class BeamContinuation:
    """One beam of the next round: ``parent`` itself (``child`` None) or a new beam
    forked from it (``child``, not yet placed), extended by ``token_id``."""

    parent: Sequence
    child: Sequence | None
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True, slots=True)
class BeamStep:
    """A beam step's decision, for the scheduler to apply in this order: place every
    ``child`` of ``continuations`` (before any parent appends its token), free
    ``dropped``, append each continuation's token, then :meth:`ForkManager.set_beams`.
    When ``done`` the search ended: finish the request (:meth:`ForkManager.finish`)."""

    done: bool
    continuations: list[BeamContinuation] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)


class ForkManager:
    """The beam-search requests in flight (see the module docstring)."""

    def __init__(self) -> None:
        self.beam_requests: dict[str, BeamRequest] = {}

    def add(self, request_id: str, seq: Sequence) -> None:
        """Start a beam search whose first beam is ``seq`` (queued by the caller)."""
        sampling = seq.sampling
        live_eos = frozenset() if sampling.ignore_eos else seq.eos_token_ids
        search = BeamSearch(
            sampling.beam_width,
            sampling.max_tokens,
            sampling.length_penalty,
            live_eos | frozenset(sampling.stop_token_ids),
            len(live_eos),
        )
        self.beam_requests[request_id] = BeamRequest(search, [seq])

    def is_beam_request(self, request_id: str) -> bool:
        return request_id in self.beam_requests

    def pinned(self, seq: Sequence) -> bool:
        """A queued beam whose request has a beam running: it stays on its queue's worker
        (its siblings' blocks and the beam step are there)."""
        br = self.beam_requests.get(seq.request_id)
        return br is not None and any(b.status is SequenceStatus.RUNNING for b in br.beams)

    def awaits_step(self, seq: Sequence) -> bool:
        """Whether ``seq`` reported its candidates and waits for its sibling beams."""
        br = self.beam_requests.get(seq.request_id)
        return br is not None and seq.seq_id in br.pending

    def report(self, seq: Sequence, candidates: tuple[tuple[int, float], ...]) -> BeamStep | None:
        """Store one beam's candidates; once every beam reported, run the beam step and
        return its decision (None while beams are still to report)."""
        br = self.beam_requests[seq.request_id]
        if seq.num_preemptions == 0 and seq is br.beams[0] and not seq.output_token_ids:
            br.num_cached_tokens = seq.num_cached_tokens
        br.pending[seq.seq_id] = candidates
        if any(b.seq_id not in br.pending for b in br.beams):
            return None
        inputs = [
            BeamInput(b.output_token_ids, b.cumulative_logprob, br.pending[b.seq_id])
            for b in br.beams
        ]
        br.pending.clear()
        conts = br.search.step(inputs)
        if br.search.done:
            return BeamStep(done=True)
        claimed: set[int] = set()
        plan: list[BeamContinuation] = []
        for c in conts:
            parent = br.beams[c.parent]
            child = None
            if c.parent in claimed:
                child = self._new_beam(br, parent)
            else:
                claimed.add(c.parent)
            plan.append(BeamContinuation(parent, child, c.token_id, c.cumulative_logprob))
        dropped = [beam for pos, beam in enumerate(br.beams) if pos not in claimed]
        return BeamStep(False, plan, dropped)

    def set_beams(self, request_id: str, beams: list[Sequence]) -> None:
        """The request's running beams after a beam step, in running order."""
        self.beam_requests[request_id].beams = beams

    @staticmethod
    def _new_beam(br: BeamRequest, parent: Sequence) -> Sequence:
        """A new beam with the parent's tokens (waiting, nowhere yet)."""
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
        return child

    def finish(self, request_id: str, first: Sequence) -> list[SequenceOutput]:
        """Forget a search that ended; its n best finished beams as final deltas, best
        first (``first``: the request's first beam, for its prompt and sampling)."""
        br = self.beam_requests.pop(request_id)
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

    def abort(self, request_id: str, first: Sequence, reason: FinishReason) -> list[SequenceOutput]:
        """Forget a search ended early: one empty final delta per choice."""
        br = self.beam_requests.pop(request_id)
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
