"""Beam search bookkeeping of one request (pure Python; the scheduler drives it).

Semantics are those of Hugging Face transformers ``generate(num_beams=K, do_sample=False,
early_stopping=True, length_penalty=P, num_return_sequences=n)`` (``GenerationMixin.
_beam_search`` and its helpers), for one prompt:

1. Every running beam reports its ``C = max(2, 1 + num_eos) * K`` most likely next tokens
   with their log-softmax values (fp32, raw logits). A candidate's score is the beam's
   cumulative logprob plus the token's logprob; the ``C`` best over all beams are kept,
   best first (ties: lower beam position, then lower token id, as a ``topk`` over the
   beam-major flattened ``[K * V]`` scores).
2. A candidate *hits a stop* when its token is an EOS / stop token id, or when it is the
   ``max_tokens``-th output token.
3. The next running beams are the ``K`` best candidates that hit no stop.
4. Among the ``K`` best candidates (not the backups behind them), those that hit a stop
   become finished hypotheses with ``score = cumulative_logprob / (generated length **
   P)`` (the EOS counts in the length), unless ``K`` hypotheses are already finished; the
   ``K`` best hypotheses are kept.
5. The search ends when ``K`` hypotheses are finished (``early_stopping=True``) or when
   every candidate hit a stop (``max_tokens`` reached). The ``n`` best hypotheses are the
   result, best first.

HF's early-stop heuristic only matters once all ``K`` hypotheses are finished, where
``early_stopping=True`` already ends the search, so it does not appear here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam.

    Attributes:
        token_ids: its output tokens (ending with the stop token when it hit one).
        cumulative_logprob: sum of the output tokens' logprobs.
        score: ``cumulative_logprob / len(token_ids) ** length_penalty``.
        stopped: True when it ended on an EOS / stop token, False at ``max_tokens``.
    """

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    stopped: bool


@dataclass(frozen=True)
class BeamContinuation:
    """One running beam of the next step: ``parent``'s tokens plus ``token_id``.

    Attributes:
        parent: position of the parent among the beams passed to :meth:`BeamSearch.step`.
        token_id: the appended token.
        cumulative_logprob: the new beam's cumulative logprob.
    """

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class BeamInput:
    """What :meth:`BeamSearch.step` needs to know about one running beam.

    Attributes:
        output_token_ids: the beam's output tokens so far.
        cumulative_logprob: their summed logprob.
        candidates: the worker's ``(token_id, logprob)`` pairs, best first.
    """

    output_token_ids: Sequence[int]
    cumulative_logprob: float
    candidates: Sequence[tuple[int, float]]


class BeamSearch:
    """The finished hypotheses of one request and the rule that advances its beams.

    Args:
        beam_width: K (>= 2).
        max_tokens: most output tokens of a beam.
        length_penalty: P.
        stop_token_ids: token ids that finish a beam (EOS unless ignored, stop_token_ids).
        num_eos: EOS ids counted by HF for the candidate count (0 with ignore_eos).
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        length_penalty: float,
        stop_token_ids: frozenset[int],
        num_eos: int,
    ) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.stop_token_ids = stop_token_ids
        self.num_candidates = num_beam_candidates(beam_width, num_eos)
        self.finished: list[BeamHypothesis] = []
        self.done = False

    def step(self, beams: Sequence[BeamInput]) -> list[BeamContinuation]:
        """Advance the search by one token (see the module docstring).

        Args:
            beams: the running beams, in their running order (best first), all with the
                same number of output tokens.

        Returns:
            The next running beams, best first; empty once the search is done
            (:attr:`done`), when :attr:`finished` holds the result.
        """
        k = self.beam_width
        scored = [
            (b.cumulative_logprob + lp, pos, tok)
            for pos, b in enumerate(beams)
            for tok, lp in b.candidates
        ]
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = scored[: self.num_candidates]
        gen_len = len(beams[0].output_token_ids) + 1
        at_max = gen_len >= self.max_tokens
        hits = [at_max or tok in self.stop_token_ids for _, _, tok in top]
        if len(self.finished) < k:
            new = [
                BeamHypothesis(
                    (*beams[pos].output_token_ids, tok),
                    score,
                    score / (gen_len**self.length_penalty),
                    tok in self.stop_token_ids,
                )
                for (score, pos, tok), hit in zip(top[:k], hits[:k])
                if hit
            ]
            # Stable sort: an earlier hypothesis wins a tie, as HF's merge of old and new.
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:k]
        running = [
            BeamContinuation(pos, tok, score)
            for (score, pos, tok), hit in zip(top, hits)
            if not hit
        ][:k]
        if len(self.finished) >= k or all(hits) or not running:
            self.done = True
            return []
        return running

    def best(self, n: int) -> list[BeamHypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return self.finished[:n]


def num_beam_candidates(beam_width: int, num_eos: int) -> int:
    """Candidates each beam reports per step: ``max(2, 1 + num_eos) * beam_width`` (HF's
    ``beams_to_keep``: enough that K beams survive even if all EOS candidates finish)."""
    return max(2, 1 + num_eos) * beam_width
