"""Shared pieces of the tests that compare a pagedserve worker with HF transformers run in
the same dtype on the same prompt ids (``test_generic_path_vs_hf.py``: the generic layers;
``test_cpu_bf16_vs_hf.py``: the CPU fast path in bf16).

A fake scheduler drives the worker over a mixed batch with greedy sampling and
``logprobs=2`` (:func:`run_ours`); HF runs each prompt alone and records its logits at every
step (:func:`hf_reference`). In bf16 each prompt is compared up to its first difference
(:func:`compare`): the agreement rate is the share of generated tokens before it; at a first
difference HF's top-1/top-2 margin must be at most :data:`TIE_ULPS` bf16 ulps of the top
logit, and until it every logprob within :data:`LOGPROB_ULPS` ulps of HF's
(:func:`check_bf16`; test_generic_path_vs_hf.py's docstring gives the reasoning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from helpers import FakeScheduler

from pagedserve.scheduler.outputs import SampleLogprobs
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.worker import Worker

TIE_ULPS = 8  # a first difference may only come at an HF margin of at most this many ulps
LOGPROB_ULPS = 6  # bf16 logprobs within this many ulps of the top logit of HF's

CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
]
RAW = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]


def smol_prompt_ids(model_dir: Path) -> list[list[int]]:
    """:data:`CHATS` through the model's chat template, then :data:`RAW` as plain text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": c}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for c in CHATS
    ]
    return [list(p) for p in (*chats, *(tok(r).input_ids for r in RAW))]


@dataclass(frozen=True)
class Reference:
    """HF's greedy continuation of one prompt and its fp32 log-softmax at each step."""

    tokens: list[int]
    logprobs: list[torch.Tensor]  # fp32 [vocab] per generated token

    def margin(self, step: int) -> float:
        """HF's top-1 minus top-2 logit (= logprob) at ``step``."""
        top = self.logprobs[step].topk(2).values
        return float(top[0] - top[1])


@dataclass(frozen=True)
class Comparison:
    """Ours vs HF for one prompt, up to the first difference.

    Attributes:
        agreed: generated tokens equal before the first difference.
        first_diff: index of the first differing token, ``None`` when all agree.
        hf_margin: HF's top-1/top-2 logit margin at ``first_diff`` (``nan`` when none).
        our_margin: ours at ``first_diff`` (from our top-2 logprobs).
        max_logprob_err: largest |ours - HF| logprob of our token, over the steps up to and
            including ``first_diff`` (those share the prefix).
        ulp: the bf16 ulp of HF's largest |logit| over those steps.
    """

    agreed: int
    first_diff: int | None
    hf_margin: float
    our_margin: float
    max_logprob_err: float
    ulp: float


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at magnitude ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def hf_reference(hf: object, prompt: list[int], max_new: int) -> tuple[Reference, float]:
    """HF ``generate`` greedy (batch 1, no EOS stop) with its logits; also the largest
    |logit| seen (for the ulp scale)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(  # type: ignore[attr-defined]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    raw = [x[0].float() for x in out.logits]
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, [torch.log_softmax(r, -1) for r in raw]), max(
        float(r.abs().max()) for r in raw
    )


def load_hf(model_dir: Path, dtype: torch.dtype) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=dtype
    ).eval()


def run_ours(
    worker: Worker,
    prompts: list[list[int]],
    max_new: int,
    block_size: int,
    num_blocks: int,
    token_budget: int,
    max_num_seqs: int,
) -> tuple[list[list[int]], list[list[SampleLogprobs]]]:
    """Greedy outputs and per-token logprobs (top 2) of ``prompts`` through ``worker``."""
    sched = FakeScheduler(worker, block_size, num_blocks, token_budget, max_num_seqs)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=2)
    tokens = sched.generate(prompts, max_new, sampling)
    lps = [
        [o.logprobs[f"req-{i}"] for o in sched.outputs if f"req-{i}" in o.logprobs]
        for i in range(len(prompts))
    ]
    assert any(
        len(so.num_scheduled_tokens) > 1 and max(so.num_scheduled_tokens.values()) > 1
        for so in sched.history
    ), "expected a step mixing a prefill chunk with other sequences"
    return tokens, lps


def compare(
    ours: list[int], lps: list[SampleLogprobs], ref: Reference, top_abs_logit: float
) -> Comparison:
    """See :class:`Comparison`."""
    assert len(ours) == len(lps) == len(ref.tokens)
    first = next((i for i, (a, b) in enumerate(zip(ours, ref.tokens)) if a != b), None)
    shared = len(ours) if first is None else first + 1
    err = max(
        abs(lp.logprob - float(ref.logprobs[i][lp.token_id])) for i, lp in enumerate(lps[:shared])
    )
    for lp in lps[:shared]:
        assert math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top)
    hf_margin = our_margin = math.nan
    if first is not None:
        hf_margin = ref.margin(first)
        top = lps[first].top
        our_margin = top[0][1] - top[1][1]
    return Comparison(
        len(ours) if first is None else first,
        first,
        hf_margin,
        our_margin,
        err,
        bf16_ulp(top_abs_logit),
    )


def report(label: str, comparisons: list[Comparison], max_new: int) -> float:
    """Print each prompt's comparison and return the agreement rate."""
    rate = sum(c.agreed for c in comparisons) / (max_new * len(comparisons))
    print(f"\n{label}: greedy agreement {rate:.3f} ({sum(c.agreed for c in comparisons)}"
          f"/{max_new * len(comparisons)} tokens before the first difference), "
          f"{sum(c.first_diff is None for c in comparisons)}/{len(comparisons)} prompts equal")  # fmt: skip
    for i, c in enumerate(comparisons):
        at = (
            "equal"
            if c.first_diff is None
            else f"first diff at {c.first_diff}: HF margin {c.hf_margin:.4f} "
            f"({c.hf_margin / c.ulp:.1f} ulp), ours {c.our_margin:.4f}"
        )
        print(f"  prompt {i}: {at}; max logprob err {c.max_logprob_err:.4f} "
              f"({c.max_logprob_err / c.ulp:.1f} ulp of {c.ulp})")  # fmt: skip
    return rate


def check_bf16(comparisons: list[Comparison]) -> None:
    """Differences only near ties; logprobs within a few ulps (module docstring)."""
    for i, c in enumerate(comparisons):
        if c.first_diff is not None:
            assert c.hf_margin <= TIE_ULPS * c.ulp, (
                f"prompt {i} differs at {c.first_diff} where HF's margin is {c.hf_margin:.4f} "
                f"> {TIE_ULPS} ulps ({TIE_ULPS * c.ulp})"
            )
        assert c.max_logprob_err <= LOGPROB_ULPS * c.ulp, (i, c)


# ------------------------------------------------------------------------ tiny model
