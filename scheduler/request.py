"""Scheduler-side state of one sequence (one choice of a client request)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.scheduler.outputs import SampleLogprobs
from pagedserve.scheduler.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (recompute) and re-queued
    # A choice of an n > 1 request waiting for choice 0's prefill: it is forked from it
    # (sharing the prompt's blocks) when that prefill completes; it is in no queue.
    PENDING_FORK = "pending_fork"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence ended; values match ``pagedserve.v1.FinishReason``."""

    STOP = 1  # EOS, a stop token id, or (detected by the frontend) a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # client abort, disconnect, or server shutdown


@dataclass(eq=False)
class Sequence:
    """Mutable state of one sequence, owned by the scheduler.

    Compared by identity (``eq=False``): the batch and the queues find a sequence with
    ``list.remove`` / ``in``, which with field-wise equality would build two tuples of
    every field per element passed over.

    Attributes:
        seq_id: unique id (``f"{request_id}/{choice_index}"``).
        request_id: the client request this sequence belongs to.
        choice_index: index among the request's n choices.
        prompt_token_ids: the prompt.
        sampling: sampling parameters.
        eos_token_ids: ids that end the sequence unless ``sampling.ignore_eos``.
        max_total_tokens: prompt + output tokens allowed (min of prompt + max_tokens and
            max_model_len).
        arrival_s: arrival time (seconds, monotonic clock), FCFS priority.
        output_token_ids: sampled tokens so far.
        num_computed_tokens: tokens whose K/V are in the cache.
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        worker_id: the worker holding the sequence's KV blocks (None while waiting).
        num_preemptions: how often this sequence was preempted.
        logprobs: per output token, its log probabilities (when the request asks).
        cumulative_logprob: sum of the output tokens' logprobs (when known).
        stop_reason: the stop token id that ended the sequence (not set for EOS).
        unsent_token_ids: tokens appended by the scheduler (beam search) that the worker
            holding the sequence has not been told yet.
        fork_children: the request's other choices (status ``PENDING_FORK``) that fork
            from this sequence once its prompt is computed (n > 1 parallel sampling).
        queued_on: while waiting, the worker whose waiting queue holds it (None otherwise).
        max_computed_tokens: the most tokens whose K/V this sequence ever had computed (a
            high-water mark over its preemptions): a token computed below it is recomputed.
        num_inflight_tokens: overlapped scheduling: tokens scheduled in steps whose answer
            has not been applied yet (counted as computed when the next step is planned).
        num_pending_tokens: overlapped scheduling: tokens those steps will sample (known
            to the worker, not yet to the scheduler); each is a placeholder for planning.
        resident_since_step: the step that sent the sequence to its worker in full; an
            answer to an earlier step (from before a preemption, or for a finished
            sequence whose id was reused) is not applied to it.
        all_token_ids: the prompt followed by the outputs (a plain attribute, read on
            every step; do not mutate: :meth:`append_token` keeps it in step).
    """

    seq_id: str
    request_id: str
    choice_index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int
    arrival_s: float
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: int | None = None
    num_preemptions: int = 0
    logprobs: list[SampleLogprobs] = field(default_factory=list, repr=False)
    cumulative_logprob: float = 0.0
    stop_reason: int | None = None
    unsent_token_ids: list[int] = field(default_factory=list, repr=False)
    fork_children: list[Sequence] = field(default_factory=list, repr=False)
    queued_on: int | None = None
    max_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    num_pending_tokens: int = 0
    resident_since_step: int = 0
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Stop condition after the latest appended token (EOS, stop ids, length).

        EOS and stop token ids count only from ``sampling.min_tokens`` outputs on; a stop
        token id sets :attr:`stop_reason`.
        """
        # NOTE: called for every sequence at every step: locals, no property calls.
        out = self.output_token_ids
        num_out = len(out)
        sampling = self.sampling
        if num_out >= sampling.min_tokens:
            last = out[-1]
            if not sampling.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if sampling.stop_token_ids and last in sampling.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if num_out >= sampling.max_tokens or len(self.all_token_ids) >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None
