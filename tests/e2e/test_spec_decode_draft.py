"""Speculative decoding with a draft model (``method="draft"``) through the offline API on
tiny random Llamas with one character tokenizer: the target as its own draft (every
proposal accepted) and a smaller random draft (proposals accepted and rejected); greedy
and seeded outputs equal those without speculation, under recompute and swap
preemption, with n > 1, in both loops; a draft of another vocabulary is refused at
start-up, beams and structured outputs at validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.structured_outputs import StructuredOutputs

PROMPTS = [
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42],
    [12, 13],
    [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random Llama with the tiny target's vocabulary and tokenizer: it agrees
    with the target on some tokens only."""
    from helpers import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_draft"), seed=1, num_hidden_layers=1, hidden_size=48,
        num_attention_heads=3, num_key_value_heads=1, intermediate_size=96,
    )  # fmt: skip


def spec(draft: Path, k: int = 3, **kw) -> dict:
    return {"method": "draft", "draft_model": str(draft), "num_speculative_tokens": k, **kw}


def run(model_dir: Path, params, speculative: dict | None, prompts=PROMPTS, **kw):
    opts = dict(block_size=4, num_gpu_blocks=64, device="cpu", dtype="float32")
    opts.update(kw)
    if speculative is not None:
        opts["speculative_config"] = speculative
    with LLM(str(model_dir), **opts) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.scheduler.stats()
        assert engine.scheduler.workers[0].kv.num_free_blocks == engine.info.num_blocks
    return [[c.token_ids for c in o.outputs] for o in outs], stats


@pytest.mark.parametrize(
    "kw",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        # 4 requests of up to 36 tokens in 16 blocks of 4: preempted by recompute
        {"async_scheduling": False, "num_gpu_blocks": 16, "max_num_batched_tokens": 6},
        {"async_scheduling": True, "num_gpu_blocks": 16, "max_num_batched_tokens": 6},
    ],
    ids=["serial", "overlapped", "preempting-serial", "preempting-overlapped"],
)
def test_greedy_equals_greedy_without_speculation(tiny_llama_dir, small_draft_dir, kw):
    plain, _ = run(tiny_llama_dir, GREEDY, None, **kw)
    got, st = run(tiny_llama_dir, GREEDY, spec(small_draft_dir), **kw)
    assert got == plain
    sd = st.spec_decode
    assert sd.num_accepted_tokens > 0  # proposals accepted...
    assert sd.num_draft_tokens > sd.num_accepted_tokens  # ...and rejected
    if "num_gpu_blocks" in kw:
        assert st.num_preemptions > 0


@pytest.mark.parametrize("preempting", [False, True], ids=["roomy", "preempting"])
def test_target_as_its_own_draft_accepts_every_proposal(tiny_llama_dir, preempting):
    """Same weights, same fp32 kernels: the draft's greedy proposals are the target's
    greedy tokens, so every proposal is accepted, also for sequences recomputed after a
    preemption (their draft KV recomputed with them): a draft KV position left stale or
    unwritten would change a proposal."""
    kw = {"num_gpu_blocks": 10, "max_num_batched_tokens": 8} if preempting else {}
    plain, _ = run(tiny_llama_dir, GREEDY, None, **kw)
    got, st = run(tiny_llama_dir, GREEDY, spec(tiny_llama_dir, k=4), **kw)
    assert got == plain
    sd = st.spec_decode
    assert sd.num_drafts > 0
    assert sd.num_accepted_tokens == sd.num_draft_tokens
    if preempting:
        assert st.num_preemptions > 0
    else:
        # 23 tokens after the first: 4 steps of 4 proposals + 1, then 2 (max_tokens caps K)
        assert sd.num_draft_tokens == len(PROMPTS) * (4 * 4 + 2)


def test_seeded_sampling_n_and_logprobs_equal(tiny_llama_dir):
    """The draft (the target's weights) proposes greedily, a point mass: verification
    keeps the target's distribution, and on the fused fp32 path the seeded tokens
    themselves; sampled rows reject some greedy proposals, greedy rows none."""
    params = [
        SamplingParams(n=3, max_tokens=20, temperature=0.7, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True),
    ]
    plain, _ = run(tiny_llama_dir, params, None)
    got, st = run(tiny_llama_dir, params, spec(tiny_llama_dir))
    assert got == plain
    sd = st.spec_decode
    assert 0 < sd.num_accepted_tokens < sd.num_draft_tokens


def test_greedy_equal_under_swap_preemption(tiny_llama_dir, small_draft_dir):
    """Swapped-in sequences come back without draft KV: the draft recomputes them."""
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
        for sc in (None, SpeculativeConfig(**spec(small_draft_dir))):
            model = ModelConfig(model=str(tiny_llama_dir), dtype="float32")
            draft = None if sc is None else ModelConfig(model=str(small_draft_dir), dtype="float32")
            worker = Worker(
                WorkerConfig(
                    model=model,
                    cache=CacheConfig(block_size=4, num_blocks=14),
                    device="cpu",
                    draft_model=draft,
                )
            )
            worker.connect_host_store(f"127.0.0.1:{port}")
            info = worker.get_info()
            sched = Scheduler(
                SchedulerConfig(
                    max_num_batched_tokens=8,
                    max_model_len=info.max_model_len,
                    preemption_mode="swap",
                    async_scheduling=False,
                    speculative_config=sc,
                ),
                [WorkerSpec(0, info.num_blocks, 4)],
                SwapSpec(64, info.block_bytes, 1e9, 1e-3),
            )
            for i, p in enumerate(PROMPTS):
                sched.add_request(EngineRequest(f"r{i}", p, GREEDY, (2,)))
            seen = helpers.drive(sched, [worker.execute_model])
            assert sched.swap_stats().num_swap_ins > 0
            assert sched.workers[0].kv.num_free_blocks == 14
            results.append((seen.tokens, sched.stats().spec_decode))
        assert results[1][0] == results[0][0]
        assert results[1][1].num_accepted_tokens > 0
    finally:
        server.stop(0)


def test_kv_cache_memory_holds_both_pools(tiny_llama_dir, small_draft_dir):
    """Without num_blocks the pool size counts the draft's bytes per block too."""
    from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.model_runner import ModelRunner

    cache = CacheConfig(block_size=4, kv_cache_memory=1 << 20)
    model = ModelConfig(model=str(tiny_llama_dir), dtype="float32")
    alone = ModelRunner(WorkerConfig(model=model, cache=cache, device="cpu"))
    draft = ModelConfig(model=str(small_draft_dir), dtype="float32")
    both = ModelRunner(WorkerConfig(model=model, cache=cache, device="cpu", draft_model=draft))
    # per 4-token block: target 2 layers x 2 KV heads x 16, draft 1 x 1 x 16 (fp32, K and V)
    target_bytes, draft_bytes = 2 * 2 * 4 * 2 * 16 * 4, 2 * 1 * 4 * 1 * 16 * 4
    assert alone.kv_pool.num_blocks == (1 << 20) // target_bytes
    assert both.kv_pool.num_blocks == (1 << 20) // (target_bytes + draft_bytes)
    assert both.draft is not None and both.draft.kv_pool.num_blocks == both.kv_pool.num_blocks


def test_another_vocabulary_is_refused_at_start_up(tiny_llama_dir, tmp_path):
    from helpers import build_tiny_model

    other = build_tiny_model(tmp_path / "v120", vocab_size=120)
    with pytest.raises(ValueError, match=r"vocabulary of 120 tokens.*target's tokenizer"):
        run(tiny_llama_dir, GREEDY, spec(other))


def test_draft_needs_a_model_and_ngram_takes_none(tiny_llama_dir):
    from pagedserve.scheduler.config import SpeculativeConfig

    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="only used by speculative method 'draft'"):
        SpeculativeConfig(method="ngram", draft_model=str(tiny_llama_dir))


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(beam_width=2, max_tokens=4), "beam search"),
        (
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="a+")),
            "structured_outputs",
        ),
    ],
    ids=["beams", "structured-outputs"],
)
def test_refused_combinations(tiny_llama_dir, params, match):
    with pytest.raises((InvalidRequest, ValueError), match=match):
        run(tiny_llama_dir, params, spec(tiny_llama_dir), prompts=[[5, 6]])


def test_tensor_parallel_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLM(
            str(tiny_llama_dir),
            device="cpu",
            tensor_parallel_size=2,
            speculative_config=spec(tiny_llama_dir),
        )


CHATS = [
    [{"role": "user", "content": "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n"}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Name three colours."}],
]


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_as_its_own_draft(smollm2_dir: Path):
    """SmolLM2 drafting for itself (fp32, the fused CPU path): greedy and n = 2 outputs
    equal the plain run's, under recompute preemption (3 chats in 10 blocks of 16 slots,
    ~15 needed at their longest), and every proposal is accepted."""
    opts = dict(max_model_len=256, num_gpu_blocks=10, device="cpu", dtype="float32")
    params = [
        SamplingParams(max_tokens=32, temperature=0.0),
        SamplingParams(max_tokens=32, temperature=0.0, n=2),
        SamplingParams(max_tokens=32, temperature=0.0),
    ]
    draft = spec(smollm2_dir, k=4)
    results = []
    for speculative in (None, draft):
        kw = {} if speculative is None else {"speculative_config": speculative}
        with LLM(str(smollm2_dir), **opts, **kw) as llm:
            results.append([[c.token_ids for c in o.outputs] for o in llm.chat(CHATS, params)])
            st = llm.scheduler.stats()
        assert st.num_preemptions > 0
    assert results[1] == results[0]
    sd = st.spec_decode
    assert sd.num_drafts > 10
    assert sd.num_accepted_tokens == sd.num_draft_tokens
