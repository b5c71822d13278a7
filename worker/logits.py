"""Logits processing around the sampler: penalties, ``min_tokens`` masking, logprobs.

Applied to the rows of one step's logits before :class:`~pagedserve.worker.sampler.Sampler`
draws (order as vLLM: ``min_tokens`` masking, then penalties, then the sampler's
temperature / top-k / top-p); logprobs are taken from the raw logits (vLLM's default).

* repetition penalty (Keskar et al., 2019, CTRL sec. 4.1; HF transformers
  ``RepetitionPenaltyLogitsProcessor``): for every token id that occurs in the prompt or the
  output, ``logit / p`` when the logit is positive, ``logit * p`` otherwise;
* presence and frequency penalties (OpenAI API semantics, vLLM ``apply_penalties``):
  ``logit -= presence * (count > 0) + frequency * count`` with ``count`` the occurrences in
  the output so far;
* ``min_tokens``: EOS and ``stop_token_ids`` get ``-inf`` while fewer outputs exist.

The worker knows which tokens are outputs from each sequence's ``num_prompt_tokens``
(``NewSequenceData`` carries it, so the penalties are the same after a recompute
preemption).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.scheduler.outputs import SampleLogprobs
from pagedserve.scheduler.sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[list[int]],
    num_prompt_tokens: Sequence[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """Apply ``min_tokens`` masks and penalties to the rows that ask for them.

    Args:
        logits: float ``[N, V]`` raw logits of the rows to sample.
        params: each row's sampling parameters.
        token_ids: each row's known tokens (prompt then outputs).
        num_prompt_tokens: each row's prompt length.
        eos_token_ids: the model's EOS ids (masked under ``min_tokens``).

    Returns:
        ``logits`` itself when no row needs processing, else a float32 copy with the
        processed rows changed.
    """
    rows = [
        i
        for i, p in enumerate(params)
        if p.penalized or len(token_ids[i]) - num_prompt_tokens[i] < p.min_tokens
    ]
    if not rows:
        return logits
    out = logits.float().clone()
    vocab = out.shape[1]
    for i in rows:
        p, toks, n_prompt = params[i], token_ids[i], num_prompt_tokens[i]
        row = out[i]
        num_out = len(toks) - n_prompt
        if num_out < p.min_tokens:
            banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(toks)), dtype=torch.int64, device=row.device)
            vals = row[seen]
            pen = p.repetition_penalty
            row[seen] = torch.where(vals < 0, vals * pen, vals / pen)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and num_out > 0:
            outs = torch.tensor(toks[n_prompt:], dtype=torch.int64, device=row.device)
            counts = torch.bincount(outs, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def compute_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], num_top: Sequence[int]
) -> list[SampleLogprobs]:
    """Log probabilities of the chosen tokens and the top candidates of some rows.

    Args:
        logits: float ``[N, V]`` raw logits.
        rows: row indices to report.
        tokens: the token chosen in each of those rows.
        num_top: how many top ``(token, logprob)`` pairs each reports (0..V).

    Returns:
        One :class:`SampleLogprobs` per row, from ``log_softmax`` in float32.
    """
    if not rows:
        return []
    idx = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), device=lp.device).unsqueeze(1))
    k = max(num_top)
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    chosen_l = chosen.squeeze(1).tolist()
    vals_l, ids_l = top_vals.tolist(), top_ids.tolist()
    return [
        SampleLogprobs(
            token_id=int(tok),
            logprob=chosen_l[j],
            top=tuple(zip(ids_l[j][: num_top[j]], vals_l[j][: num_top[j]])),
        )
        for j, tok in enumerate(tokens)
    ]
