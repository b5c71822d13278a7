"""Verification of speculative tokens on the worker.

A speculative decode of a sequence with known tokens ``x[0:L]`` and proposals
``d[0:s]`` runs ``x[L-1], d[0], ..., d[s-1]`` as one chunk (the chunked-prefill path of
the kernels, with the sequence's cached context), whose ``s + 1`` logits rows are the
target model's distributions after ``x``, after ``x + d[:1]``, ..., after ``x + d``.
Row ``j`` is processed as the plain decode at that position would be: ``min_tokens`` and
penalties see the tokens up to it (:func:`expand_rows`), and the sampler draws it with
the uniform of output position ``L - num_prompt + j``.

Acceptance (:func:`accept`): keep the proposals while each equals the token drawn at its
row; the first row whose draw differs gives that draw instead, and when every proposal is
kept the last row gives one more token. So a step yields 1 to ``s + 1`` tokens.

Why this is exact. Greedy: the draw is the argmax, so the output is the plain greedy
output token for token. Sampling: rejection sampling for a deterministic proposal
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding",
section 2.3, with ``q`` a point mass on ``d``) accepts ``d`` with probability
``p(d)``, else samples from ``p`` with ``d`` removed and renormalised. Drawing
``t ~ p`` and accepting iff ``t == d`` is that rule: ``P(t == d) = p(d)``, and given
``t != d``, ``t`` has law ``p(. | . != d)``. Using the plain decode's own uniform for the
draw (inverse transform, :class:`~pagedserve.worker.sampler.Sampler`) also makes a seeded
request's output the same with and without speculation wherever the logits are the same
bits (the fused fp32 CPU path, where a token's logits do not depend on how the step cuts
its sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.input_batch import SequenceState
from pagedserve.worker.sampler import SamplingRow


@dataclass(frozen=True)
class VerifyRows:
    """The logits rows of one step with speculative sequences, in row order.

    Attributes:
        params: each row's sampling parameters.
        token_ids: each row's known tokens (prompt, outputs, and the proposals before it).
        num_prompt_tokens: each row's prompt length.
        rows: each row's sampler spec (its output position's seed).
        starts: per sequence (the order of ``states``), its first row; ``starts[-1]`` is
            the number of rows.
    """

    params: list[SamplingParams]
    token_ids: list[list[int]]
    num_prompt_tokens: list[int]
    rows: list[SamplingRow]
    starts: list[int]


def expand_rows(states: Sequence[SequenceState]) -> VerifyRows:
    """One row per sampled position: ``1 + state.num_spec_tokens`` per sequence, whose
    ``token_ids`` end with its ``num_spec_tokens`` proposals."""
    params: list[SamplingParams] = []
    token_ids: list[list[int]] = []
    prompts: list[int] = []
    rows: list[SamplingRow] = []
    starts = [0]
    for state in states:
        s = state.num_spec_tokens
        known = len(state.token_ids) - s
        base = state.sampling_row()  # at the position after every token, proposals too
        for j in range(s + 1):
            params.append(state.sampling)
            token_ids.append(state.token_ids[: known + j] if j < s else state.token_ids)
            prompts.append(state.num_prompt_tokens)
            rows.append(replace(base, output_index=base.output_index - s + j))
        starts.append(starts[-1] + s + 1)
    return VerifyRows(params, token_ids, prompts, rows, starts)


def accept(proposals: Sequence[int], drawn: Sequence[int]) -> list[int]:
    """The tokens a speculative step yields (see the module docstring).

    Args:
        proposals: the ``s`` proposed tokens.
        drawn: the ``s + 1`` tokens drawn at the rows of the step, in order.

    Returns:
        ``proposals[:a] + [drawn[a]]``, ``a`` the number of leading proposals equal to
        their draws.

    Raises:
        ValueError: ``len(drawn) != len(proposals) + 1``.
    """
    if len(drawn) != len(proposals) + 1:
        raise ValueError(f"{len(drawn)} draws for {len(proposals)} proposals (need one more)")
    out: list[int] = []
    for d, t in zip(proposals, drawn):
        out.append(t)
        if t != d:
            return out
    out.append(drawn[-1])
    return out
