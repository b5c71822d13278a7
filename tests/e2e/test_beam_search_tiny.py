"""Beam search through the real Scheduler and Worker (tiny random Llama) vs HF transformers
``generate(num_beams=K, early_stopping=True)``: same beams, same order, same scores; blocks
shared between beams; pruned beams free their blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_same_beams, drive, hf_beams, run_beams

from pagedserve.scheduler.engine_messages import EngineRequest
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
    timers: list[int] = []

    def done(s) -> None:
        snaps.append(s.metrics_snapshot())
        timers.append(s.metrics.num_live_timers)

    ours, peak, copies = run_beams(tiny_llama_dir, prompt, sampling, on_done=done)
    assert_same_beams(ours, ref)
    # generation_tokens counts the tokens delivered: n = K beams of 8 tokens.
    assert snaps[0].generation_tokens == sum(len(o.new_token_ids) for o in ours) == 8 * k
    # The request's n choices are its finished sequences; the beams pruned on the way
    # (copies > 0 below: there were forks) are neither finished sequences nor aborts.
    assert snaps[0].request_success == {"stop": 0, "length": k, "abort": 0}
    h = snaps[0].histograms
    assert h["e2e_request_latency_seconds"].count == k
    assert h["request_generation_tokens"].count == k
    assert h["request_generation_tokens"].sum == 8 * k
    assert h["time_to_first_token_seconds"].count == k
    assert h["request_queue_time_seconds"].count == 1  # one admission of the request
    assert snaps[0].prompt_tokens == 18 * k
    assert timers == [0]
    # 18 prompt + 7 computed outputs = 25 tokens: the 4 full prompt blocks stay shared and
    # each beam holds 2 tail blocks at the peak (K copies of the prompt would be 4 * 7).
    assert peak == 4 + 2 * k
    assert copies > 0
    with pytest.raises(RequestRejected, match="beam_width 4"):
        run_beams(tiny_llama_dir, prompt, sampling, num_blocks=24)  # K * 7 blocks = 28


def test_an_aborted_beam_request_counts_its_choices_as_aborted(tiny_llama_dir: Path) -> None:
    from pagedserve.scheduler.config import SchedulerConfig
    from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
    from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.worker import Worker

    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=64),
            device="cpu",
        )
    )
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, async_scheduling=False),
        [WorkerSpec(0, 64, 4)],
    )
    sampling = SamplingParams(max_tokens=20, beam_width=3, n=2, ignore_eos=True)
    sched.add_request(EngineRequest("r", PROMPTS[0], sampling, (EOS,)))
    steps: list[int] = []
    # prefill + 3 beam steps: beams forked and pruned, nothing streamed yet
    seen = drive(
        sched,
        [worker.execute_model],
        on_step=lambda s, w, so: steps.append(so.step_id),
        until=lambda: len(steps) == 4,
    )
    assert steps == [0, 1, 2, 3] and seen.outputs == []
    outs = sched.abort_request("r")
    assert [(o.choice_index, o.finish_reason) for o in outs] == [
        (0, FinishReason.ABORT),
        (1, FinishReason.ABORT),
    ]
    snap = sched.metrics_snapshot()
    assert snap.request_success == {"stop": 0, "length": 0, "abort": 2}
    assert snap.histograms["e2e_request_latency_seconds"].count == 2
    assert snap.histograms["time_to_first_token_seconds"].count == 0
    assert snap.generation_tokens == 0 and snap.prompt_tokens == 0
    assert sched.metrics.num_live_timers == 0
    assert snap.stats.workers[0].num_free_blocks == 64
