"""The offline API, ``pagedserve.LLM``: greedy token ids equal HF transformers' greedy (a
tiny random Llama; the default SmolLM2 under the ``model`` mark), overlapped and serial
scheduling agree, n > 1, stop strings, logprobs, prefix caching seen in the output, bad
input refused with a clear error, and ``import pagedserve`` stays light.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hf_greedy

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler.errors import InvalidRequest, ServingError

MAX_NEW = 10
PROMPTS = [
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [12, 13],
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def expected(hf) -> list[list[int]]:
    return [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path):
    with LLM(
        str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, device="cpu", dtype="float32"
    ) as engine:
        yield engine


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_equals_hf_overlapped_and_serial(tiny_llama_dir, expected, async_scheduling):
    with LLM(
        str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=14,  # forces preemption: 3 prompts of up to 21 tokens, 4-token blocks
        max_num_batched_tokens=6,  # chunked prefill
        async_scheduling=async_scheduling,
        device="cpu",
        dtype="float32",
    ) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert engine.scheduler.workers[0].kv.num_free_blocks == 14
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.slow  # ~20 s: a second process starts torch
def test_tensor_parallel_t2_equals_hf(tiny_llama_dir, expected):
    with LLM(
        str(tiny_llama_dir),
        tensor_parallel_size=2,  # rank 1 a local process, gloo
        block_size=4,
        num_gpu_blocks=14,
        max_num_batched_tokens=6,  # chunked prefill
        device="cpu",
        dtype="float32",
    ) as engine:
        assert engine.info.tensor_parallel_size == 2
        outs = engine.generate(PROMPTS, GREEDY)
        assert engine.scheduler.workers[0].kv.num_free_blocks == 14
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_n_choices_text_and_prompt_shapes(llm, hf, expected):
    one = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=3)
    )
    assert len(one) == 1 and [c.index for c in one[0].outputs] == [0, 1, 2]
    assert all(list(c.token_ids) == expected[0] for c in one[0].outputs)
    text = "hello world"
    ids = llm.tokenizer(text)["input_ids"]
    by_text, by_dict = llm.generate([text, {"prompt_token_ids": ids}], GREEDY)
    assert by_text.prompt == text and by_text.prompt_token_ids == ids and by_dict.prompt is None
    assert list(by_text.outputs[0].token_ids) == hf_greedy(hf, ids, MAX_NEW)
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(
        list(by_text.outputs[0].token_ids), skip_special_tokens=True
    )


def test_stop_string_cuts_text_and_ends_the_choice(llm):
    ids = PROMPTS[1]
    full = llm.generate(ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert len(text) >= 4
    stop = text[2:4]
    cut = text.index(stop)
    out = llm.generate(
        ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,))
    )[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 30
    assert list(out.token_ids) == list(full.outputs[0].token_ids[: len(out.token_ids)])
    assert not llm.scheduler.requests  # the choice was aborted on the scheduler: blocks back
    assert llm.scheduler.workers[0].kv.num_free_blocks == 64


def test_logprobs_match_the_tokens_and_their_sum(llm, expected):
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    )[0].outputs[0]
    assert list(out.token_ids) == expected[0]
    assert out.logprobs is not None and len(out.logprobs) == MAX_NEW
    assert [lp.token_id for lp in out.logprobs] == expected[0]
    for lp in out.logprobs:
        assert (
            lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][0] == lp.token_id
        )  # greedy: the best
    assert out.cumulative_logprob == pytest.approx(
        math.fsum(lp.logprob for lp in out.logprobs), abs=1e-4
    )
    plain = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    assert plain.logprobs is None


def test_prefix_caching_shows_in_num_cached_tokens(llm, expected):
    first = llm.generate(PROMPTS[1], GREEDY)[0]
    again = llm.generate(PROMPTS[1], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == tuple(expected[1])
    # 11 prompt tokens, 4-token blocks: the 2 full blocks come from the cache.
    assert again.num_cached_tokens == 8


def test_bad_input_is_refused_clearly(llm, tiny_llama_dir):
    with pytest.raises(ValueError, match="prompts must be a string or a list"):
        llm.generate(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="each prompt must be"):
        llm.generate([[1, 2], 3.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(InvalidRequest, match="out of range"):
        llm.generate([[1, 500]], GREEDY)
    with pytest.raises(ServingError):
        llm.generate([[3] * 600], GREEDY)  # longer than max_model_len (512)
    with pytest.raises(ValueError, match=r"unknown engine option.*max_num_seq\b"):
        LLM(str(tiny_llama_dir), max_num_seq=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_llama_dir), block_size=0)
    assert not llm.scheduler.requests and llm.scheduler.workers[0].kv.num_free_blocks == 64
    assert llm.generate([], GREEDY) == []


def test_chat_renders_the_template(llm, hf):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, GREEDY)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.prompt == text and out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, MAX_NEW)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "x"}])


def test_import_pagedserve_loads_neither_torch_ray_nor_grpc():
    code = (
        "import sys, pagedserve; assert pagedserve.SamplingParams; "
        "print(sorted(m for m in ('torch', 'ray', 'grpc') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_greedy_equals_hf(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is", "def fibonacci(n):"]
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, attn_implementation="eager").eval()
    expected = [hf_greedy(hf_model, tok(t)["input_ids"], 16) for t in texts]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(
        str(smollm2_dir), max_model_len=512, num_gpu_blocks=64, device="cpu", dtype="float32"
    ) as engine:
        outs = engine.generate(texts, sp)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
