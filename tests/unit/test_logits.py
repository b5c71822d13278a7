"""Penalties, min_tokens masks and logprobs (worker/logits.py) against HF and by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.logits import compute_logprobs, process_logits

V = 12


def logits_rows(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, V, generator=g) * 3


def test_repetition_penalty_equals_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = logits_rows(2)
    toks = [[3, 5, 5, 7], [0, 11, 2]]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    ours = process_logits(logits, params, toks, [2, 1], eos_token_ids=[2])
    for i, (p, t) in enumerate(zip(params, toks)):
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([t]), logits[i : i + 1].clone()
        )
        torch.testing.assert_close(ours[i : i + 1], ref, atol=0, rtol=0)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_count_outputs_only():
    logits = logits_rows(1)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)
    # prompt [4, 4]; outputs [4, 9, 9]
    ours = process_logits(logits, [p], [[4, 4, 4, 9, 9]], [2], eos_token_ids=[])
    expected = logits.clone()
    expected[0, 4] -= 0.5 + (-0.25) * 1
    expected[0, 9] -= 0.5 + (-0.25) * 2
    torch.testing.assert_close(ours, expected)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = logits_rows(3)
    p = SamplingParams(min_tokens=2, stop_token_ids=(6,))
    toks = [[1, 8], [1, 8, 8], [1, 8, 8, 8]]  # 1, 2 and 3 outputs after a 1-token prompt
    ours = process_logits(logits, [p] * 3, toks, [1, 1, 1], eos_token_ids=[2, 3])
    assert torch.isinf(ours[0, [2, 3, 6]]).all() and (ours[0, [2, 3, 6]] < 0).all()
    torch.testing.assert_close(ours[0, [0, 1, 4, 5, 7]], logits[0, [0, 1, 4, 5, 7]])
    torch.testing.assert_close(ours[1:], logits[1:])
    plain = [SamplingParams()] * 3
    assert process_logits(logits, plain, toks, [1, 1, 1], [2]) is logits


def test_logprobs_are_log_softmax_with_top_n():
    logits = logits_rows(3)
    out = compute_logprobs(logits, rows=[0, 2], tokens=[5, 1], num_top=[3, 0])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert [o.token_id for o in out] == [5, 1]
    assert out[0].logprob == pytest.approx(ref[0, 5].item(), abs=1e-5)
    assert out[1].logprob == pytest.approx(ref[2, 1].item(), abs=1e-5)
    top_ids = ref[0].argsort(descending=True)[:3].tolist()
    assert [t for t, _ in out[0].top] == top_ids
    for t, v in out[0].top:
        assert v == pytest.approx(ref[0, t].item(), abs=1e-5)
    assert out[1].top == ()
    assert math.fsum(math.exp(v) for v in ref[0].tolist()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "x" * 1025}, "cache_salt"),
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 17}, "beam_width"),
        ({"length_penalty": float("inf")}, "length_penalty"),
        ({"beam_width": 2, "n": 3}, "beam_width"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
