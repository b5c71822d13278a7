"""Beam search through the real Scheduler and Worker (tiny random Llama) vs HF transformers
``generate(num_beams=K, early_stopping=True)``: same beams, same order, same scores; blocks
shared between beams; pruned beams free their blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import CheckedKVCacheManager

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import RequestRejected
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.worker import Worker

PROMPTS = [[5, 17, 33, 9, 100, 64, 2, 77, 31], [99, 3, 3, 3, 120, 7, 8], [12, 13]]
EOS = 2


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()


def hf_beams(hf, prompt, k, n, max_new, length_penalty, eos):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            num_beams=k,
            num_return_sequences=n,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=EOS if eos is not None else 0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    rows = []
    for row, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()):
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append((row, score))
    return rows


def run_beams(model_dir: Path, prompt, sampling, num_blocks=64, eos=(EOS,)):
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(model_dir)),
            cache=CacheConfig(block_size=4, num_blocks=num_blocks),
            device="cpu",
        )
    )
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        [WorkerSpec(0, num_blocks, 4)],
    )
    sched.workers[0].kv = kv = CheckedKVCacheManager(num_blocks, 4, True)
    sched.add_request("r", prompt, sampling, eos)
    outs, peak, copies = [], 0, 0
    while sched.has_work(0):
        so = sched.schedule(0)
        peak = max(peak, kv.used())
        copies += len(so.blocks_to_copy)
        outs.extend(sched.update(0, so, worker.execute_model(so)))
        sched.check_integrity()
    assert kv.num_free_blocks == num_blocks and not sched.requests and not sched.sequences
    run_beams.preemptions = sched.num_preemptions
    return outs, peak, copies


def assert_same_beams(ours, ref):
    assert [o.choice_index for o in ours] == list(range(len(ref)))
    for o, (tokens, score) in zip(ours, ref):
        assert o.score == pytest.approx(score, abs=1e-4)
        if list(o.new_token_ids) != tokens:
            # Only a near-tie between two candidates may order them differently.
            assert any(abs(o.score - s) < 1e-4 for t, s in ref if t == list(o.new_token_ids))
    assert [o.score for o in ours] == sorted((o.score for o in ours), reverse=True)


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
    ours, peak, copies = run_beams(tiny_llama_dir, prompt, sampling)
    assert_same_beams(ours, ref)
    # 18 prompt + 7 computed outputs = 25 tokens: the 4 full prompt blocks stay shared and
    # each beam holds 2 tail blocks at the peak (K copies of the prompt would be 4 * 7).
    assert peak == 4 + 2 * k
    assert copies > 0
    with pytest.raises(RequestRejected, match="beam_width 4"):
        run_beams(tiny_llama_dir, prompt, sampling, num_blocks=24)  # K * 7 blocks = 28
