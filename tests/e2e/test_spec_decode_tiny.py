"""Speculative decoding (n-gram) through the offline API on the tiny random Llama: the
same tokens as without it, greedy and seeded, under chunked prefill and preemption, with
n > 1, logprobs and penalties, in both loops; proposals both accepted and rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler.errors import InvalidRequest

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, "ngram_max": 3}
PROMPTS = [
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42],  # repetitive: proposals from the prompt
    [12, 13],
    [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8],
]


def run(model_dir: Path, params, spec: bool, prompts=PROMPTS, **kw):
    opts = dict(block_size=4, num_gpu_blocks=64, device="cpu", dtype="float32")
    opts.update(kw)
    if spec:
        opts["speculative_config"] = SPEC
    with LLM(str(model_dir), **opts) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.scheduler.stats()
    return outs, stats


def ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize(
    "kw",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        # 3 requests of up to 36 tokens in 4-token blocks: preempted by recompute
        {"async_scheduling": False, "num_gpu_blocks": 16, "max_num_batched_tokens": 6},
        {"async_scheduling": True, "num_gpu_blocks": 16, "max_num_batched_tokens": 6},
    ],
    ids=["serial", "overlapped", "preempting-serial", "preempting-overlapped"],
)
def test_greedy_equals_greedy_without_speculation(tiny_llama_dir, kw):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = run(tiny_llama_dir, greedy, False, **kw)
    spec, st = run(tiny_llama_dir, greedy, True, **kw)
    assert ids(spec) == ids(plain)
    sd = st.spec_decode
    assert sd.num_accepted_tokens > 0  # proposals accepted...
    assert sd.num_draft_tokens > sd.num_accepted_tokens  # ...and rejected
    if "num_gpu_blocks" in kw:
        assert st.num_preemptions > 0


def test_seeded_sampling_n_logprobs_penalties_equal(tiny_llama_dir):
    """On the fused fp32 CPU path a verified row's logits are the plain decode's bits and
    each row draws with its output position's uniform: seeded outputs are equal too."""
    params = [
        SamplingParams(n=3, max_tokens=20, temperature=0.7, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
    ]
    plain, _ = run(tiny_llama_dir, params, False)
    spec, st = run(tiny_llama_dir, params, True)
    assert ids(spec) == ids(plain)
    lp_plain = [(lp.token_id, round(lp.logprob, 4)) for lp in plain[1].outputs[0].logprobs]
    lp_spec = [(lp.token_id, round(lp.logprob, 4)) for lp in spec[1].outputs[0].logprobs]
    assert lp_spec == lp_plain and len(lp_spec) == 20
    assert st.spec_decode.num_drafts > 0


def test_max_tokens_and_min_tokens_hold(tiny_llama_dir):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 2, 5, 7)]
    plain, _ = run(tiny_llama_dir, params, False)
    spec, _ = run(tiny_llama_dir, params, True)
    assert ids(spec) == ids(plain)
    assert [len(o.outputs[0].token_ids) for o in spec] == [1, 2, 5, 7]


def test_beam_search_refused(tiny_llama_dir):
    with pytest.raises((InvalidRequest, ValueError), match="speculative"):
        run(tiny_llama_dir, SamplingParams(beam_width=2, max_tokens=4), True, prompts=[[5, 6]])


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_greedy_equal_under_swap_preemption(tiny_llama_dir, overlap):
    """A pool of 14 blocks for 4 sequences of up to 36 tokens: sequences are swapped out
    and back in between speculative steps; tokens equal the plain run, pools end empty."""
    import helpers

    from pagedserve.scheduler.config import SchedulerConfig, SpeculativeConfig
    from pagedserve.scheduler.engine_messages import EngineRequest
    from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
    from pagedserve.scheduler.swap import SwapSpec
    from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.host_store import serve_host_store
    from pagedserve.worker.worker import Worker

    server, port, _ = serve_host_store(1 << 28)
    try:
        results = []
        for spec in (None, SpeculativeConfig(**SPEC)):
            worker = Worker(
                WorkerConfig(
                    model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                    cache=CacheConfig(block_size=4, num_blocks=14),
                    device="cpu",
                )
            )
            worker.connect_host_store(f"127.0.0.1:{port}")
            info = worker.get_info()
            sched = Scheduler(
                SchedulerConfig(
                    max_num_batched_tokens=8,
                    max_model_len=info.max_model_len,
                    preemption_mode="swap",
                    async_scheduling=overlap,
                    speculative_config=spec,
                ),
                [WorkerSpec(0, info.num_blocks, 4)],
                SwapSpec(64, info.block_bytes, 1e9, 1e-3),
            )
            greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(PROMPTS):
                sched.add_request(EngineRequest(f"r{i}", p, greedy, (2,)))
            seen = helpers.drive(sched, [worker.execute_model])
            sw = sched.swap_stats()
            assert sw.num_swap_outs > 0 and sw.num_swap_ins == sw.num_swap_outs
            assert sched.workers[0].kv.num_free_blocks == 14
            results.append((seen.tokens, sched.stats().spec_decode))
        assert results[1][0] == results[0][0]
        assert results[1][1].num_accepted_tokens > 0
    finally:
        server.stop(0)


def test_stop_string_inside_an_accepted_run(tiny_llama_dir):
    """The text and ids end where the plain run's do, though the speculative step that
    completed the stop string carried ids after it."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[3]]
    plain, _ = run(tiny_llama_dir, greedy, False, prompts=prompts)
    # stop strings ending at every position: most land inside an accepted run
    cases = [
        (p, o.outputs[0].text[k : k + 2]) for p, o in zip(prompts, plain) for k in range(2, 20)
    ]
    prompts = [p for p, stop in cases if len(stop) == 2]
    stops = [stop for _, stop in cases if len(stop) == 2]
    assert len(stops) > 10
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[s]) for s in stops
    ]
    plain, _ = run(tiny_llama_dir, params, False, prompts=prompts)
    spec, st = run(tiny_llama_dir, params, True, prompts=prompts)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert ids(spec) == ids(plain)
    assert all(o.outputs[0].finish_reason == "stop" for o in spec)
    assert st.spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("forward", ["cpu-layers", "layers"])
def test_greedy_equal_on_the_per_layer_and_generic_forwards(tiny_llama_dir, forward):
    """The verification chunk runs through each forward's chunked-prefill path."""
    from helpers import use_forward

    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = []
    for spec in (False, True):
        opts = dict(block_size=4, num_gpu_blocks=64, device="cpu", dtype="float32")
        if spec:
            opts["speculative_config"] = SPEC
        with LLM(str(tiny_llama_dir), **opts) as engine:
            use_forward(engine._worker, forward)
            assert engine._worker.runner.model.model_forward.name == forward
            results.append(ids(engine.generate(PROMPTS, greedy)))
            if spec:
                assert engine.scheduler.stats().spec_decode.num_drafts > 0
    assert results[1] == results[0]
