"""Beam search through the real Scheduler and Worker (tiny random Llama) vs HF transformers
``generate(num_beams=K, early_stopping=True)``: same beams, same order, same scores; blocks
shared between beams; pruned beams free their blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_same_beams, hf_beams, run_beams

from pagedserve.scheduler.errors import RequestRejected
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 9, 100, 64, 2, 77, 31], [99, 3, 3, 3, 120, 7, 8], [12, 13]]
EOS = 2


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    ("k", "n", "max_new", "lp", "eos"),
    [(3, 3, 10, 1.0, None), (4, 2, 8, 0.5, EOS), (2, 1, 12, 2.0, None)],
)
def test_beams_equal_hf(tiny_llama_dir: Path, hf, k, n, max_new, lp, eos) -> None:
    sampling = SamplingParams(
        max_tokens=max_new, beam_width=k, n=n, length_penalty=lp, ignore_eos=eos is None
    )
    for prompt in PROMPTS[:2]:
        ref = hf_beams(hf, prompt, k, n, max_new, lp, eos)
        ours, _, _ = run_beams(tiny_llama_dir, prompt, sampling)
        assert_same_beams(ours, ref)
        for o in ours:
            assert o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            assert o.score == pytest.approx(o.cumulative_logprob / len(o.new_token_ids) ** lp)


def test_beams_share_blocks_and_need_room_for_all_beams(tiny_llama_dir: Path, hf) -> None:
    prompt = [40 + i for i in range(18)]  # 4 full blocks + 2 tokens
    k = 4
    sampling = SamplingParams(max_tokens=8, beam_width=k, n=k, ignore_eos=True)
    ref = hf_beams(hf, prompt, k, k, 8, 1.0, None)
    snaps: list = []
    ours, peak, copies = run_beams(
        tiny_llama_dir, prompt, sampling, on_done=lambda s: snaps.append(s.metrics_snapshot())
    )
    assert_same_beams(ours, ref)
    # generation_tokens counts the tokens delivered: n = K beams of 8 tokens.
    assert snaps[0].generation_tokens == sum(len(o.new_token_ids) for o in ours) == 8 * k
    # 18 prompt + 7 computed outputs = 25 tokens: the 4 full prompt blocks stay shared and
    # each beam holds 2 tail blocks at the peak (K copies of the prompt would be 4 * 7).
    assert peak == 4 + 2 * k
    assert copies > 0
    with pytest.raises(RequestRejected, match="beam_width 4"):
        run_beams(tiny_llama_dir, prompt, sampling, num_blocks=24)  # K * 7 blocks = 28
