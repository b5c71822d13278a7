"""The real Scheduler driving the real Worker in-process (no Ray) on a tiny random Llama.

Checks the scheduler <-> worker contract under pressure: a pool so small that recompute
preemption happens, chunked prefill under a small token budget, prefix-cache hits across
requests, and n > 1 choices; greedy outputs must equal HF transformers' greedy exactly and
every block must be free at the end.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from helpers import FakeScheduler, drive, hf_greedy

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.worker import Worker

MAX_NEW = 12
PROMPTS = [
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
    [99, 3, 3, 3, 120, 7, 8],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 60, 61, 62],  # shares a prefix
    [12, 13],
]


def run_engine(model_dir: Path, num_blocks: int, budget: int, prompts, n: int = 1, sampling=None):
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=num_blocks),
            device="cpu",
        )
    )
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=info.max_model_len,
            admission="fits-now",  # admit by current need, so that small pools preempt
            async_scheduling=False,
        ),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    if sampling is None:
        sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=n)
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, sampling, info.eos_token_ids))
    seen = drive(sched, [worker.execute_model])
    tokens = seen.tokens
    cached = {out.request_id: out.num_cached_tokens for out in seen.outputs}
    kv = sched.workers[0].kv
    assert kv.num_free_blocks == info.num_blocks
    return tokens, sched, cached


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_roomy_pool_equals_hf(tiny_llama_dir: Path, expected) -> None:
    tokens, sched, _ = run_engine(tiny_llama_dir, num_blocks=64, budget=64, prompts=PROMPTS)
    assert sched.num_preemptions == 0
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref


def test_preemption_and_chunking_still_equal_hf(tiny_llama_dir: Path, expected) -> None:
    # 14 blocks of 4 slots = 56 slots for 5 sequences that grow to ~105 tokens together.
    tokens, sched, _ = run_engine(tiny_llama_dir, num_blocks=14, budget=6, prompts=PROMPTS)
    assert sched.num_preemptions > 0
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref


def test_prefix_cache_hit_gives_cold_prefill_tokens(tiny_llama_dir: Path, expected) -> None:
    # Sequential requests on one engine: prompt 1, prompt 1 again (hits), prompt 3 (shares
    # 12 tokens = 3 full blocks with prompt 1).
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=64),
            device="cpu",
        )
    )
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(max_model_len=info.max_model_len, async_scheduling=False),
        [WorkerSpec(0, info.num_blocks, 4)],
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = {}
    for rid, prompt in (("a", PROMPTS[1]), ("b", PROMPTS[1]), ("c", PROMPTS[3])):
        sched.add_request(EngineRequest(rid, prompt, greedy, info.eos_token_ids))
        outs = drive(sched, [worker.execute_model]).outputs
        results[rid] = ([t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens)
    assert results["a"] == (expected[1], 0)
    assert results["b"] == (expected[1], 16)  # 18-token prompt: 4 full blocks, last kept out
    assert results["c"] == (expected[3], 12)  # 3 shared full blocks


def test_n_choices_greedy_all_equal_hf(tiny_llama_dir: Path, expected) -> None:
    tokens, _, _ = run_engine(tiny_llama_dir, 64, 64, PROMPTS[:2], n=3)
    for i in range(2):
        for c in range(3):
            assert tokens[(f"r{i}", c)] == expected[i]


def test_forked_choices_sample_like_independent_sequences(tiny_llama_dir: Path) -> None:
    """n=4 seeded sampling by fork (one prefill, shared prompt blocks) gives every choice
    the tokens an independent sequence with that choice index gets, also when the pool is
    so small that forked choices are preempted and recomputed."""
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True, n=4)
    prompts = PROMPTS[:2]
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=64),
            device="cpu",
        )
    )
    single = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True)
    independent = FakeScheduler(worker, 4, 64).generate(
        [p for p in prompts for _ in range(4)], MAX_NEW, single, choice_indices=[0, 1, 2, 3] * 2
    )
    assert len({tuple(t) for t in independent[:4]}) == 4  # the choices differ
    for num_blocks, preempted in ((64, False), (13, True)):
        tokens, sched, _ = run_engine(tiny_llama_dir, num_blocks, 64, prompts, sampling=sampling)
        assert (sched.num_preemptions > 0) is preempted
        for i in range(2):
            for c in range(4):
                assert tokens[(f"r{i}", c)] == independent[4 * i + c], (num_blocks, i, c)


def _hf_generate(model_dir: Path, prompt: list[int], **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    return hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        **kwargs,
    )


def test_repetition_penalty_equals_hf_also_after_preemption(tiny_llama_dir: Path) -> None:
    prompts = PROMPTS[:3]
    refs = [
        _hf_generate(tiny_llama_dir, p, repetition_penalty=1.3).sequences[0, len(p) :].tolist()
        for p in prompts
    ]
    sampling = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3
    )
    for num_blocks, preempted in ((64, False), (10, True)):
        tokens, sched, _ = run_engine(tiny_llama_dir, num_blocks, 6, prompts, sampling=sampling)
        assert (sched.num_preemptions > 0) is preempted
        for i, ref in enumerate(refs):
            assert tokens[(f"r{i}", 0)] == ref, (num_blocks, i)


def test_presence_frequency_penalties_survive_preemption(tiny_llama_dir: Path) -> None:
    kw = dict(max_tokens=MAX_NEW, temperature=0.8, seed=3, ignore_eos=True)
    penalized = SamplingParams(**kw, presence_penalty=1.5, frequency_penalty=2.0)
    runs = [
        run_engine(tiny_llama_dir, nb, 6, PROMPTS[:3], sampling=sp)
        for nb, sp in ((64, penalized), (10, penalized), (64, SamplingParams(**kw)))
    ]
    assert runs[1][1].num_preemptions > 0
    assert runs[0][0] == runs[1][0]
    assert runs[0][0] != runs[2][0]  # the penalties change the draws
    # With a frequency penalty of 2 no token repeats many times in a row.
    for toks in runs[0][0].values():
        assert max(len(list(g)) for _, g in itertools.groupby(toks)) <= 3


def test_logprobs_equal_hf_output_scores(tiny_llama_dir: Path) -> None:
    import torch

    prompt = PROMPTS[1]
    out = _hf_generate(tiny_llama_dir, prompt, output_scores=True)
    ref_tokens = out.sequences[0, len(prompt) :].tolist()
    ref_lp = [torch.log_softmax(s[0].float(), dim=-1) for s in out.scores]
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=64),
            device="cpu",
        )
    )
    sched = FakeScheduler(worker, 4, 64, token_budget=7)
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=5)
    assert sched.generate([prompt], MAX_NEW, sampling)[0] == ref_tokens
    ours = [o.logprobs["req-0"] for o in sched.outputs if "req-0" in o.logprobs]
    assert len(ours) == MAX_NEW
    for lp, ref, tok in zip(ours, ref_lp, ref_tokens):
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[tok].item()) < 1e-3
        top = ref.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        for (_, v), r in zip(lp.top, top.values.tolist()):
            assert abs(v - r) < 1e-3


def test_every_step_runs_on_the_model_thread_over_the_step_channel(
    tiny_llama_dir: Path, expected
) -> None:
    """Steps sent on the step channel, and a direct call from this thread, run on the
    worker's model thread (where its model was built), with the same greedy tokens as HF."""
    import asyncio
    import threading

    from pagedserve.scheduler.engine_loop import EngineLoop
    from pagedserve.scheduler.step_channel import StepChannelClient

    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=64),
            device="cpu",
        )
    )
    threads: set[int] = set()
    run_step = worker.runner.execute_model

    def recorded(so):
        threads.add(threading.get_ident())
        return run_step(so)

    worker.runner.execute_model = recorded  # type: ignore[method-assign]
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=info.max_model_len),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, sampling, info.eos_token_ids))

    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}

    def sink(outputs):
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)

    async def over_the_channel():
        client = await StepChannelClient.connect(worker.open_step_channel("127.0.0.1"))
        try:
            await asyncio.wait_for(EngineLoop(sched, {0: client}, sink).run_until_idle(), 120)
        finally:
            await client.close()

    asyncio.run(over_the_channel())
    assert not sched.requests
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert threads == {worker.model_thread.ident}
    worker.reset()  # a Ray call's path: on the model thread too
    assert worker.model_thread.call(threading.get_ident) == worker.model_thread.ident
    worker.close()
