"""What :meth:`pagedserve.LLM.generate` returns: one :class:`RequestOutput` per prompt.

The shape of vLLM's ``vllm.outputs.RequestOutput`` / ``CompletionOutput``; log
probabilities are pagedserve's :class:`~pagedserve.scheduler.outputs.SampleLogprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.outputs import SampleLogprobs


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a request.

    Attributes:
        index: the choice's index among the request's ``n``.
        text: the generated text (stop strings cut, special tokens skipped).
        token_ids: the generated token ids (a stop token id that ended the choice is
            kept; the token that completed a stop string is kept too).
        cumulative_logprob: sum of the tokens' log probabilities, when the request asked
            for ``logprobs``; beam search: the beam's cumulative logprob.
        logprobs: per generated token, its log probability and the ``logprobs`` most
            likely alternatives (None unless the request asked).
        finish_reason: ``"stop"`` (EOS, a stop token id or stop string), ``"length"``
            (max_tokens or max_model_len) or ``"abort"`` (a failed step, shutdown).
        stop_reason: the stop string or stop token id that ended the choice, else None.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[SampleLogprobs, ...] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result.

    Attributes:
        request_id: the id the engine ran it under.
        prompt: the prompt text (None for a prompt given as token ids).
        prompt_token_ids: the prompt as the model saw it.
        outputs: its choices, by index.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finished: always True (generate returns finished requests).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens over all choices."""
        return sum(len(c.token_ids) for c in self.outputs)
