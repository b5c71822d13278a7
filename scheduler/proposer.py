"""Proposers of speculative tokens: what a decode step verifies besides its last token.

A proposer sees a sequence's known tokens (prompt then outputs) and returns up to ``k``
tokens it guesses come next. The scheduler calls it when it plans a decode, so the step's
token budget and block allocation count the proposals exactly; the worker verifies them
(:mod:`pagedserve.worker.spec_decode`). A proposal only costs compute: a wrong one is
rejected and the output is the same as without speculation.

:class:`NgramProposer` is prompt lookup decoding (Saxena, 2023, "Prompt Lookup Decoding";
vLLM's ``NgramProposer``): find the last earlier occurrence of the sequence's trailing
n-gram, longest ``n`` first, and propose the tokens that followed it. It pays off where the
output copies its input (editing, summarising, code), and proposes nothing elsewhere.
A draft model proposes on the worker instead (:mod:`pagedserve.worker.draft_model`): the
scheduler only counts its proposals (``CachedSequenceData.num_draft_tokens``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from pagedserve.scheduler.config import SpeculativeConfig


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` (>= 0) proposed token ids after ``token_ids``; may be empty."""
        ...


class NgramProposer:
    """Prompt lookup over the sequence's own tokens.

    Args:
        ngram_min: shortest trailing n-gram matched (>= 1).
        ngram_max: longest (>= ngram_min), tried first.
    """

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The ``k`` tokens after the last earlier occurrence of the trailing n-gram.

        For ``n`` from ``ngram_max`` down to ``ngram_min``: the last ``n`` tokens are the
        pattern; the latest start ``i < len - n`` where ``token_ids[i:i+n]`` equals it wins,
        and ``token_ids[i+n : i+n+k]`` is proposed (shorter when the match is near the end).

        NOTE: called for every decode of every sequence: the ids are packed as 4-byte
        integers once and searched with ``bytes.rfind`` (C speed, O(len) per n), a match
        at an offset that is not a multiple of 4 straddles two ids and is skipped.

        Returns:
            Up to ``k`` token ids; ``[]`` when ``k <= 0`` or no n-gram recurs.
        """
        num = len(token_ids)
        if k <= 0 or num < 2:
            return []
        toks = token_ids if isinstance(token_ids, list) else list(token_ids)
        buf = array("I", toks).tobytes()
        # a match must end before the pattern's last token: start i <= num - n - 1
        end = 4 * (num - 1)
        for n in range(min(self.ngram_max, num - 1), self.ngram_min - 1, -1):
            pattern = buf[4 * (num - n) :]
            pos = buf.rfind(pattern, 0, end)
            while pos > 0 and pos % 4:
                pos = buf.rfind(pattern, 0, pos + len(pattern) - 1)
            if pos >= 0:
                i = pos // 4 + n
                return toks[i : i + k]
        return []


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The scheduler's proposer of ``config.method``; None for ``"draft"``, whose
    proposals the worker makes.

    Raises:
        ValueError: an unknown method (the config refuses it first).
    """
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.method == "draft":
        return None
    raise ValueError(f"unknown speculative method {config.method!r}")
