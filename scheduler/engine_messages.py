"""The frontend <-> scheduler contract: what a frontend sends the engine core, what comes back.

Two messages cross the edge, as in vLLM v1 (``vllm/v1/engine/__init__.py``:
``EngineCoreRequest`` in, ``EngineCoreOutputs`` out):

* :class:`EngineRequest`, one per client request, frontend -> scheduler: a validated,
  tokenized request (the frontend's :mod:`pagedserve.cluster.pipeline` builds it; tests and
  offline callers build it directly). ``SchedulerActor.add_request`` and
  ``Scheduler.add_request`` take it and nothing else.
* :class:`SequenceOutput`, per step and choice, scheduler -> frontend: the tokens one choice
  gained in one step. The actor sends each step's outputs for all of one frontend's requests
  as one item of that frontend's stream (``SchedulerActor.subscribe``), each tagged with the
  :attr:`EngineRequest.tag` it was added with.

Both cross a process boundary (Ray pickles them), so they hold plain values only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.outputs import SampleLogprobs
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request, frontend -> scheduler (vLLM v1 ``EngineCoreRequest``).

    Scheduling priority and the prefix-cache salt are sampling fields
    (``sampling.priority``, ``sampling.cache_salt``): they travel in :attr:`sampling` and
    nowhere else.

    Attributes:
        request_id: the client request id (non-empty); unique among requests in flight.
        prompt_token_ids: the prompt, token ids (non-empty; a list is stored as a tuple).
            Ids are checked against the vocabulary by the frontend, not here.
        sampling: how to sample and when to stop; ``sampling.n`` choices.
        eos_token_ids: ids that end a choice unless ``sampling.ignore_eos`` (a list is
            stored as a tuple).
        arrival_s: arrival time, seconds on the scheduler's ``time.monotonic`` clock;
            ``None`` (what the frontend sends): stamped by ``Scheduler.add_request`` when the
            request reaches it. FCFS order, queue time and TTFT count from it.
        subscriber: the output stream that gets this request's outputs (a name given to
            ``SchedulerActor.subscribe``); unused by the :class:`Scheduler` itself.
        tag: the number the request's outputs carry on that stream (chosen by the
            subscriber, so late outputs of a finished request never reach a newer request
            that reuses its id).

    Raises:
        InvalidRequest: an empty ``request_id`` or an empty prompt.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_s: float | None = None
    subscriber: str = ""
    tag: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest("request_id must be a non-empty string", "request_id")
        if not self.prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        # NOTE: frozen, so the normalization goes through object.__setattr__.
        if type(self.prompt_token_ids) is not tuple:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if type(self.eos_token_ids) is not tuple:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


@dataclass(slots=True)
class SequenceOutput:
    """A delta pushed to the frontend after a step (vLLM v1 ``EngineCoreOutput``).

    Built for every sequence at every step, so not frozen (a frozen dataclass's
    ``__init__`` costs ~4x a plain one's); treat it as immutable.

    Attributes:
        request_id: the client request.
        choice_index: which choice.
        new_token_ids: tokens appended since the last delta.
        finish_reason: set on the last delta of the choice.
        num_prompt_tokens: prompt length (tokens).
        num_output_tokens: output tokens so far.
        num_cached_tokens: prompt tokens served from the prefix cache.
        logprobs: log probabilities of ``new_token_ids`` (when the request asks).
        cumulative_logprob: sum of the choice's token logprobs so far (when it asks).
        stop_reason: on the last delta: the stop token id that ended the choice.
        score: beam search: the beam's length-penalized score (on its only delta).
        num_preemptions: how often the choice was preempted so far (0 for beam search).
    """

    request_id: str
    choice_index: int
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: tuple[SampleLogprobs, ...] = ()
    cumulative_logprob: float | None = None
    stop_reason: int | None = None
    score: float | None = None
    num_preemptions: int = 0


__all__ = ["EngineRequest", "SequenceOutput"]
