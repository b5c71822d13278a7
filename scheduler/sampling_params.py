"""Sampling parameters of one request (pure Python, shared by scheduler, worker and frontend)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 64
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax


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
            so results are reproducible and unaffected by batching or preemption.
        n: number of independent choices.
        stop: stop strings; the output text is cut before the first match.
        stop_token_ids: token ids that end a choice (the id is kept in the output ids).
        ignore_eos: keep generating past the tokenizer's EOS.

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

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5, as in vLLM: dividing
        logits by a tinier temperature overflows, and the distribution is one-hot anyway)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
