"""pagedserve's Llama-family model through the paged KV cache vs HF transformers (fp32).

A random tiny model is driven through ModelRunner by a fake scheduler (block_size 4, shuffled
non-contiguous block ids, several prompts of different lengths, chunked prefill, block reuse)
and its greedy ids must equal HF ``generate(do_sample=False)`` exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    GREEDY,
    TINY_PROMPTS,
    FakeScheduler,
    build_tiny_model,
    chunk_and_decode_inputs,
    hf_greedy,
    use_forward,
)

from pagedserve.kernels import cpu_native
from pagedserve.scheduler.outputs import CachedSequenceData, NewSequenceData, SchedulerOutput
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.forward import select_forward
from pagedserve.worker.input_batch import SequenceState, prepare_inputs
from pagedserve.worker.worker import Worker

needs_c = pytest.mark.skipif(not cpu_native.gemm_available(), reason="CPU kernels not built")

BLOCK_SIZE = 4
NUM_BLOCKS = 160
MAX_NEW = 24
PROMPTS = TINY_PROMPTS


def make_worker(model_dir: Path, block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS):
    config = WorkerConfig(
        # fp32 pinned: "auto" is bf16 on a CPU with the bf16 kernels.
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        device="cpu",
    )
    return Worker(config)


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir: Path):
    return load_hf(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_expected(hf_tiny) -> list[list[int]]:
    return [hf_greedy(hf_tiny, p, MAX_NEW) for p in PROMPTS]


@needs_c
def test_the_runner_picks_the_fused_forward_once(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tiny_llama_dir)
    model = worker.runner.model
    assert model.model_forward.name == "cpu-fused"
    monkeypatch.setenv("PAGEDSERVE_FUSED_LAYERS", "0")
    assert make_worker(tiny_llama_dir).runner.model.model_forward.name == "cpu-layers"
    monkeypatch.delenv("PAGEDSERVE_FUSED_LAYERS")
    torch_worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=8),
            device="cpu",
            attention_backend="torch",
        )
    )
    assert torch_worker.runner.model.model_forward.name == "layers"
    # Packing again drops the forward built on the old layers.
    model.pack_weights()
    assert model.model_forward.name == "layers"
    caches = worker.runner.kv_pool.layer_caches()
    assert select_forward(model, caches).name == "cpu-fused"
    assert select_forward(model, caches, candidates=()).name == "layers"


FORWARDS = [
    pytest.param("cpu-fused", marks=needs_c),
    pytest.param("cpu-layers", marks=needs_c),
    "layers",
]


@pytest.mark.parametrize("forward", FORWARDS)
def test_batched_greedy_equals_hf(
    tiny_llama_dir: Path, hf_expected: list[list[int]], forward: str
) -> None:
    worker = make_worker(tiny_llama_dir)
    use_forward(worker, forward)
    sched = FakeScheduler(worker, BLOCK_SIZE, NUM_BLOCKS, token_budget=512)
    assert sched.generate(PROMPTS, MAX_NEW) == hf_expected
    # All prompts were prefilled together in the first step.
    assert len(sched.history[0].new_seqs) == len(PROMPTS)
    # The outputs depend on the prompt (the test would catch a cache that ignores context).
    assert len({tuple(o[:4]) for o in hf_expected}) == len(PROMPTS)


@pytest.mark.parametrize("forward", FORWARDS)
def test_chunked_prefill_and_block_reuse_equal_hf(
    tiny_llama_dir: Path, hf_expected: list[list[int]], forward: str
) -> None:
    worker = make_worker(tiny_llama_dir)
    use_forward(worker, forward)
    # A budget of 9 tokens splits the long prompts into 2-5 chunks and mixes prefill
    # chunks with decodes; max_num_seqs 3 makes later requests reuse freed (dirty) blocks.
    sched = FakeScheduler(worker, BLOCK_SIZE, NUM_BLOCKS, token_budget=9, max_num_seqs=3)
    assert sched.generate(PROMPTS, MAX_NEW) == hf_expected
    chunks_of_longest = [
        so.num_scheduled_tokens["req-4"]
        for so in sched.history
        if so.num_scheduled_tokens.get("req-4", 0) > 1
    ]
    assert len(chunks_of_longest) >= 3
    assert any(
        len(so.num_scheduled_tokens) > 1 and max(so.num_scheduled_tokens.values()) > 1
        for so in sched.history
    ), "expected a step mixing a prefill chunk with other requests"
    # Run again on the same worker: every block now holds stale K/V of finished requests.
    again = FakeScheduler(worker, BLOCK_SIZE, NUM_BLOCKS, token_budget=13, shuffle_seed=7)
    assert again.generate(PROMPTS[::-1], MAX_NEW, prefix="again") == hf_expected[::-1]


def test_prefill_logits_close_to_hf(tiny_llama_dir: Path, hf_tiny) -> None:
    worker = make_worker(tiny_llama_dir)
    runner = worker.runner
    prompt = PROMPTS[4]
    state = SequenceState(
        "x", list(prompt), len(prompt), list(range(40, 40 - 10, -1)), 0, GREEDY, 0, 0
    )
    inputs = prepare_inputs([(state, len(prompt))], BLOCK_SIZE, NUM_BLOCKS, runner.device)
    with torch.inference_mode():
        ours = runner.model(
            inputs.input_ids,
            inputs.positions,
            runner.kv_pool.layer_caches(),
            inputs.attn_metadata,
            torch.arange(len(prompt)),
        )
        ref = hf_tiny(torch.tensor([prompt])).logits[0].float()
    assert ours.dtype == torch.float32 and ours.shape == (len(prompt), 128)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_copy_on_write_fork_and_prefix_sharing(
    tiny_llama_dir: Path, hf_expected: list[list[int]]
) -> None:
    """Choice 1 forks from choice 0 after its prefill: full blocks shared, the partial last
    block copied (blocks_to_copy) in the same step in which choice 0 appends into its own."""
    worker = make_worker(tiny_llama_dir)
    prompt = PROMPTS[3]  # 7 tokens: block 17 full, block 88 holds 3
    a_blocks = [17, 88]
    so0 = SchedulerOutput(
        0,
        new_seqs=[NewSequenceData("a", prompt, len(prompt), a_blocks, 0, GREEDY, 0)],
        num_scheduled_tokens={"a": len(prompt)},
    )
    first = worker.execute_model(so0).sampled_token_ids["a"]
    b_blocks = [17, 51]
    so1 = SchedulerOutput(
        1,
        new_seqs=[NewSequenceData("b", prompt, len(prompt), b_blocks, len(prompt) - 1, GREEDY, 1)],
        cached_seqs=[CachedSequenceData("a", len(a_blocks), [], len(prompt))],
        num_scheduled_tokens={"a": 1, "b": 1},
        blocks_to_copy=[(88, 51)],
    )
    out = worker.execute_model(so1).sampled_token_ids
    assert out["b"] == first
    outs = {"a": [first, out["a"]], "b": [out["b"]]}
    blocks = {"a": a_blocks, "b": b_blocks}
    computed = {"a": len(prompt) + 1, "b": len(prompt)}
    for step in range(2, MAX_NEW + 1):
        cached = []
        for rid in ("a", "b"):
            need = -(-(computed[rid] + 1) // BLOCK_SIZE) - len(blocks[rid])
            new_ids = [100 + step * 2 + (rid == "b")] if need > 0 else []
            start = len(blocks[rid])
            blocks[rid].extend(new_ids)
            cached.append(CachedSequenceData(rid, start, new_ids, computed[rid]))
        sampled = worker.execute_model(
            SchedulerOutput(step, cached_seqs=cached, num_scheduled_tokens={"a": 1, "b": 1})
        ).sampled_token_ids
        for rid in ("a", "b"):
            outs[rid].append(sampled[rid])
            computed[rid] += 1
    assert outs["a"][:MAX_NEW] == hf_expected[3]
    assert outs["b"][:MAX_NEW] == hf_expected[3]
    # Prefix-cache hit: a new request reuses the full prompt block of "a" and computes
    # the remaining 3 prompt tokens into a fresh block.
    hit = SchedulerOutput(
        MAX_NEW + 1,
        new_seqs=[NewSequenceData("c", prompt, len(prompt), [17, 155], 4, GREEDY, 0)],
        num_scheduled_tokens={"c": 3},
    )
    assert worker.execute_model(hit).sampled_token_ids == {"c": hf_expected[3][0]}


VARIANTS = {
    "tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "bias-headdim": (
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 32, "num_key_value_heads": 3},
    ),
    "mistral": ("MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_equal_hf(variant: str, tmp_path: Path) -> None:
    arch, overrides = VARIANTS[variant]
    model_dir = build_tiny_model(tmp_path / variant, arch, seed=3, **overrides)
    hf = load_hf(model_dir)
    prompts = [PROMPTS[0], PROMPTS[4]]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    sched = FakeScheduler(make_worker(model_dir), BLOCK_SIZE, NUM_BLOCKS, token_budget=16)
    assert sched.generate(prompts, 12) == expected


@needs_c
@pytest.mark.parametrize("variant", ["tied", "bias-headdim"])
def test_all_layers_in_one_call_equal_the_per_layer_path_bit_for_bit(
    variant: str, tmp_path: Path
) -> None:
    # A prefill chunk over a cached prefix and a decode in one step; the cache afterwards
    # and every logits row must be the same bits on both paths.
    arch, overrides = VARIANTS[variant]
    model_dir = build_tiny_model(tmp_path / variant, arch, seed=5, **overrides)
    worker = make_worker(model_dir)
    model, pool = worker.runner.model, worker.runner.kv_pool
    inputs = chunk_and_decode_inputs(worker, BLOCK_SIZE, NUM_BLOCKS)
    torch.manual_seed(0)
    for cache in pool.key_caches + pool.value_caches:  # the cached prefixes
        cache.normal_()
    before = [c.clone() for c in pool.key_caches + pool.value_caches]
    results = []
    for forward in ("cpu-fused", "cpu-layers"):
        for cache, saved in zip(pool.key_caches + pool.value_caches, before):
            cache.copy_(saved)
        use_forward(worker, forward)
        with torch.inference_mode():
            logits = model(
                inputs.input_ids, inputs.positions, pool.layer_caches(), inputs.attn_metadata,
                torch.arange(21),
            )  # fmt: skip
        results.append((logits, [c.clone() for c in pool.key_caches + pool.value_caches]))
    (fused_logits, fused_caches), (layer_logits, layer_caches) = results
    assert torch.equal(fused_logits, layer_logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layer_caches))
    assert not torch.equal(fused_caches[0], before[0])  # the step's K rows were stored


def _bad_step(kind: str, meta, positions: torch.Tensor):
    """The step's metadata and positions with one index pointing outside its buffer."""
    import dataclasses

    if kind == "cu_seqlens_q":  # claims a query row past the batch
        cu = meta.cu_seqlens_q.clone()
        cu[-1] += 1
        return dataclasses.replace(meta, cu_seqlens_q=cu), positions
    if kind == "block_tables":
        tables = meta.block_tables.clone()
        tables[1, 0] = NUM_BLOCKS
        return dataclasses.replace(meta, block_tables=tables), positions
    if kind == "slot_mapping":
        slots = meta.slot_mapping.clone()
        slots[3] = NUM_BLOCKS * BLOCK_SIZE
        return dataclasses.replace(meta, slot_mapping=slots), positions
    bad = positions.clone()
    bad[0] = 10_000  # beyond the rotary table
    return meta, bad


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize(
    "kind, message",
    [
        ("cu_seqlens_q", r"cu_seqlens_q\[2\] = 22 != the 21 query rows"),
        ("block_tables", rf"block_tables\[1, 0\] = {NUM_BLOCKS} is outside"),
        ("slot_mapping", rf"slot_mapping\[3\] = {NUM_BLOCKS * BLOCK_SIZE} is beyond"),
        ("positions", r"positions\[0\] = 10000 is outside"),
    ],
)
def test_every_forward_rejects_indices_outside_the_buffers(
    tiny_llama_dir: Path, forward: str, kind: str, message: str
) -> None:
    worker = make_worker(tiny_llama_dir)
    use_forward(worker, forward)
    runner = worker.runner
    long = SequenceState("a", list(PROMPTS[4]), len(PROMPTS[4]), list(range(30)), 0, GREEDY, 0, 0)
    short = SequenceState("b", list(PROMPTS[0]), len(PROMPTS[0]), [60, 59, 58], 0, GREEDY, 0, 0)
    short.num_computed_tokens = 8
    inputs = prepare_inputs([(long, 20), (short, 1)], BLOCK_SIZE, NUM_BLOCKS, runner.device)
    meta, positions = _bad_step(kind, inputs.attn_metadata, inputs.positions)
    before = [c.clone() for c in runner.kv_pool.key_caches]
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        runner.model(
            inputs.input_ids, positions, runner.kv_pool.layer_caches(), meta, torch.arange(21)
        )
    # Rejected before any kernel ran: the cache is untouched.
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_pool.key_caches))
