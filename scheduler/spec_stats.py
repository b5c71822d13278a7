"""Speculative decoding counters, as vLLM names them (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``), and the rates derived from them.

:class:`SpecDecodeCounters` is fed by the scheduler as it applies each speculative step;
:class:`SpecDecodeStats` is the snapshot GetStats, ``pagedserve stats`` and ``/metrics``
report.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding since start (all zero when it is off).

    Attributes:
        num_drafts: sequence-steps that verified at least one proposed token.
        num_draft_tokens: proposed tokens verified.
        num_accepted_tokens: of those, tokens accepted (the token sampled after them,
            produced by every speculative step, is not counted).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens, in [0, 1] (0.0 before any proposal)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculative step produces on average: 1 + accepted / drafts (vLLM's
        "mean acceptance length"; 0.0 before any draft)."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


class SpecDecodeCounters:
    """The mutable counters behind :class:`SpecDecodeStats`."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def on_step(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One sequence's speculative step verified ``num_draft_tokens`` proposals and
        accepted ``num_accepted_tokens`` of them (a step without proposals counts nothing)."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)
