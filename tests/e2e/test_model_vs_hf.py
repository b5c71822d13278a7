"""SmolLM2-135M-Instruct served by ModelRunner (paged KV cache, continuous batching) vs
HF transformers greedy ``generate``, fp32 on CPU.

Five prompts (three chat, two raw) run together in one runner under a fake scheduler with a
64-token budget, so prefills are chunked and mixed with decodes; every sequence's 40 greedy
ids must equal HF's batch-1 greedy ids (HF is told not to stop at EOS, like the fake
scheduler, so even the tokens after the chat answers' ``<|im_end|>`` are compared).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FakeScheduler, hf_greedy, until_eos

from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.worker import Worker

pytestmark = [pytest.mark.model, pytest.mark.slow]

MAX_NEW = 40
BLOCK_SIZE = 16
CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
]
RAW = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for c in CHATS
    ]
    raws = [tokenizer(r).input_ids for r in RAW]
    return [list(p) for p in (*chats, *raws)]


@pytest.fixture(scope="module")
def hf_outputs(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, attn_implementation="eager").eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_continuous_batching_greedy_equals_hf(
    smollm2_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]], tokenizer
) -> None:
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(smollm2_dir), dtype="float32", max_model_len=1024),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
            device="cpu",
        )
    )
    eos = worker.get_info().eos_token_ids
    sched = FakeScheduler(worker, BLOCK_SIZE, 64, token_budget=64)
    ours = sched.generate(prompts, MAX_NEW)
    assert any(len(so.num_scheduled_tokens) == len(prompts) for so in sched.history)
    for i, (mine, ref) in enumerate(zip(ours, hf_outputs)):
        assert len(mine) == len(ref) == MAX_NEW
        assert mine == ref, (
            f"prompt {i}: ours {tokenizer.decode(mine)!r} vs HF {tokenizer.decode(ref)!r}"
        )
    assert tokenizer.decode(ours[0]).startswith("The capital of France is Paris.")
    # Most answers run past 32 tokens before any EOS (real text, not post-EOS noise).
    assert sum(len(until_eos(o, eos)) >= 32 for o in ours) >= 3


def test_repetition_penalty_and_logprobs_equal_hf(
    smollm2_dir: Path, prompts: list[list[int]], tokenizer
) -> None:
    """Greedy with repetition_penalty=1.3 equals HF ``generate(repetition_penalty=1.3)``
    token for token; logprobs (raw logits) equal HF's ``output_logits`` within 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.scheduler.sampling_params import SamplingParams

    n_new = 24
    chosen = [prompts[0], prompts[3], prompts[4]]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, attn_implementation="eager").eval()
    refs = []
    for p in chosen:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_new,
                do_sample=False,
                repetition_penalty=1.3,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
        lps = [torch.log_softmax(x[0].float(), dim=-1) for x in out.logits]
        refs.append((out.sequences[0, len(p) :].tolist(), lps))
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(smollm2_dir), dtype="float32", max_model_len=1024),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=32),
            device="cpu",
        )
    )
    sched = FakeScheduler(worker, BLOCK_SIZE, 32, token_budget=64)
    sampling = SamplingParams(max_tokens=n_new, temperature=0.0, repetition_penalty=1.3, logprobs=3)
    ours = sched.generate(chosen, n_new, sampling)
    for i, (mine, (ref, ref_lps)) in enumerate(zip(ours, refs)):
        assert mine == ref, f"prompt {i}: {tokenizer.decode(mine)!r} vs {tokenizer.decode(ref)!r}"
        lps = [o.logprobs[f"req-{i}"] for o in sched.outputs if f"req-{i}" in o.logprobs]
        for lp, r in zip(lps, ref_lps, strict=True):
            assert abs(lp.logprob - r[lp.token_id].item()) < 1e-3
            assert [t for t, _ in lp.top] == r.topk(3).indices.tolist()
            assert max(abs(v - r[t].item()) for t, v in lp.top) < 1e-3
    plain = hf_greedy(hf, chosen[1], n_new)
    assert plain != refs[1][0]  # the penalty changes this continuation
