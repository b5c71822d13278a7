"""Beam search on SmolLM2-135M-Instruct through the real Scheduler and Worker vs HF
transformers ``generate(num_beams=K, num_return_sequences=n, early_stopping=True,
length_penalty=P)``: the same beams in the same order with the same scores (near-ties
within 1e-4 excepted), stopping at the model's EOS."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_same_beams, hf_beams, run_beams

from pagedserve.scheduler.sampling_params import SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

CHATS = ["What is the capital of France?", "Name three colors."]
RAW = "The three primary colors are"


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chats = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": c}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for c in CHATS
    ]
    return [*chats, list(tok(RAW).input_ids)]


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def worker(smollm2_dir: Path):
    from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.worker import Worker

    return Worker(
        WorkerConfig(
            model=ModelConfig(model=str(smollm2_dir), dtype="float32", max_model_len=256),
            cache=CacheConfig(block_size=16, num_blocks=64),
            device="cpu",
        )
    )


@pytest.mark.parametrize(("k", "n", "lp"), [(4, 2, 1.0), (3, 3, 0.6)])
def test_beams_equal_hf_on_smollm2(smollm2_dir: Path, hf, worker, prompts, k, n, lp) -> None:
    eos = 2  # <|im_end|> in SmolLM2-Instruct
    max_new = 12
    sampling = SamplingParams(max_tokens=max_new, beam_width=k, n=n, length_penalty=lp)
    for prompt in prompts:
        ref = hf_beams(hf, prompt, k, n, max_new, lp, eos)
        ours, _, _ = run_beams(
            smollm2_dir, prompt, sampling, 64, (eos,), block_size=16, worker=worker
        )
        assert_same_beams(ours, ref)
