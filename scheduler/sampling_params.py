"""Sampling parameters of one request (pure Python, shared by scheduler, worker and frontend)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.scheduler.structured_outputs import StructuredOutputs

DEFAULT_MAX_TOKENS = 64
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = 16
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token, and when to stop.

    Attributes:
        max_tokens: most new tokens per choice (>= 1).
        temperature: softmax temperature; 0 means greedy (argmax). Range [0, 2].
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 (or -1) disables it.
        seed: per-request seed; ``None`` draws one at random. With a seed, the token at
            output position i is drawn from a generator seeded by (seed, choice index, i),
            so the draw itself does not depend on batching or preemption. The logits it
            is applied to are bitwise batch-independent only in batch-invariant mode
            (``pagedserve serve --batch-invariant``); otherwise they move in the last bits
            with the batch (library GEMM blocking depends on the row count), which can
            flip a near-tied draw. Same request, same batch history: same output.
        n: number of choices (with beam search: the best n of ``beam_width`` beams; default
            ``beam_width``).
        stop: stop strings; the output text is cut before the first match (after it with
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end a choice (the id is kept in the output ids; its
            text is left out of the output text unless ``include_stop_str_in_output``).
        ignore_eos: keep generating past the tokenizer's EOS.
        logprobs: ``None`` = none; ``k`` in [0, 20] = per generated token its log
            probability and the ``k`` most likely (token, logprob), from the fp32
            log-softmax of the raw logits (before penalties and temperature).
        repetition_penalty: > 0; 1 disables. HF transformers semantics over prompt and
            output tokens: a seen token's logit is divided by it when positive, multiplied
            when negative.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that
            occurs in the output so far (OpenAI semantics).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per occurrence
            in the output so far (OpenAI semantics).
        min_tokens: EOS and ``stop_token_ids`` cannot be generated before this many output
            tokens (<= ``max_tokens``).
        include_stop_str_in_output: keep a matched stop string (or a stop token's text) in
            the output text.
        cache_salt: prefix-cache isolation: requests share cached blocks only when their
            salts are equal (``None`` = no salt); non-empty, at most 1024 characters.
        beam_width: > 1 turns beam search on (deterministic; ``temperature``, ``top_p``,
            ``top_k`` and ``seed`` are ignored); at most 16.
        length_penalty: beam search score = cumulative logprob / (generated length **
            length_penalty); finite.
        priority: scheduling priority under the ``priority`` scheduling policy: lower is
            more urgent (admitted first, preempted last); int32 range. Ignored under
            ``fcfs``.
        structured_outputs: a constraint on the generated text (JSON schema, any JSON
            object, regex, choice, EBNF grammar); ``None`` = unconstrained. Not with beam
            search or ``ignore_eos``.

    Raises:
        ValueError: on out-of-range values, with a message naming the field.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    priority: int = 0
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 2.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        self._check_extensions()

    def _check_extensions(self) -> None:
        """Validate logprobs, penalties, min_tokens, cache_salt and beam search fields."""
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                "characters"
            )
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}"
            )
        if not isinstance(self.priority, int) or not -(2**31) <= self.priority < 2**31:
            raise ValueError(f"priority must be an int32, got {self.priority!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")
        if self.beam_width > 1:
            if self.n > self.beam_width:
                raise ValueError(
                    f"n ({self.n}) must be <= beam_width ({self.beam_width}) with beam search"
                )
            if self.stop:
                raise ValueError("stop strings are not supported with beam search (beam_width)")
            if self.penalized or self.min_tokens:
                raise ValueError(
                    "repetition/presence/frequency penalties and min_tokens are not supported "
                    "with beam search (beam_width)"
                )
            if self.logprobs is not None:
                raise ValueError(
                    "logprobs is not supported with beam search (beam_width); each choice "
                    "carries cumulative_logprob and score"
                )
            if self.structured_outputs is not None:
                raise ValueError(
                    "structured_outputs is not supported with beam search (beam_width)"
                )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputs, got "
                    f"{type(self.structured_outputs).__name__}"
                )
            if self.ignore_eos:
                raise ValueError(
                    "structured_outputs cannot be combined with ignore_eos: the output "
                    "ends where the grammar ends, on an EOS token"
                )

    @property
    def penalized(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def use_beam_search(self) -> bool:
        """True when ``beam_width > 1``."""
        return self.beam_width > 1

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5, as in vLLM: dividing
        logits by a tinier temperature overflows, and the distribution is one-hot anyway)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
