"""The fused CPU forwards (``worker/cpu_forward.py``) with a bf16 KV cache under an fp32
model (``kv_cache_dtype="bfloat16"``): chosen by the runner, and giving the generic torch
path's greedy tokens and (close) logits on a tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import GREEDY, TINY_PROMPTS, FakeScheduler, chunk_and_decode_inputs, use_forward

from pagedserve.kernels import cpu_native
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.cpu_forward import CpuLayerForward, FusedCpuForward
from pagedserve.worker.forward import select_forward
from pagedserve.worker.input_batch import SequenceState, prepare_inputs
from pagedserve.worker.worker import Worker

pytestmark = pytest.mark.skipif(not cpu_native.gemm_available(), reason="CPU kernels not built")

BLOCK_SIZE = 4
NUM_BLOCKS = 160
PROMPTS = TINY_PROMPTS


def bf16_kv_worker(model_dir: Path) -> Worker:
    return Worker(
        WorkerConfig(
            # fp32 pinned: "auto" is bf16 on a CPU with the bf16 kernels.
            model=ModelConfig(model=str(model_dir), dtype="float32"),
            cache=CacheConfig(
                block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, kv_cache_dtype="bfloat16"
            ),
            device="cpu",
        )
    )


def test_the_runner_picks_the_fast_path_for_a_bf16_kv_cache(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = bf16_kv_worker(tiny_llama_dir)
    runner = worker.runner
    assert runner.kv_pool.dtype == torch.bfloat16
    assert runner.model.embed_tokens.weight.dtype == torch.float32
    assert runner.model.model_forward.name == "cpu-fused"
    caches = runner.kv_pool.layer_caches()
    assert select_forward(runner.model, caches).name == "cpu-fused"
    monkeypatch.setenv("PAGEDSERVE_FUSED_LAYERS", "0")
    assert bf16_kv_worker(tiny_llama_dir).runner.model.model_forward.name == "cpu-layers"
    # An fp16 cache is still the generic path's.
    half = [(k.half(), v.half()) for k, v in caches]
    assert FusedCpuForward.build(runner.model, half) is None
    assert CpuLayerForward.build(runner.model, half) is None


@pytest.fixture(scope="module")
def generic_tokens(tiny_llama_dir: Path) -> list[list[int]]:
    worker = bf16_kv_worker(tiny_llama_dir)
    use_forward(worker, "layers")
    sched = FakeScheduler(worker, BLOCK_SIZE, NUM_BLOCKS, token_budget=9, max_num_seqs=3)
    return sched.generate(PROMPTS, 24)


def last_logits(worker: Worker, forward: str, ids: list[int]) -> torch.Tensor:
    """The logits after a prefill of ``ids`` on ``forward``: fp32 ``[vocab]``."""
    use_forward(worker, forward)
    seq = SequenceState("x", list(ids), len(ids), list(range(40)), 0, GREEDY, 0, 0)
    inputs = prepare_inputs([(seq, len(ids))], BLOCK_SIZE, NUM_BLOCKS, worker.runner.device)
    with torch.inference_mode():
        return worker.runner.model(
            inputs.input_ids, inputs.positions, worker.runner.kv_pool.layer_caches(),
            inputs.attn_metadata, torch.tensor([len(ids) - 1]),
        )[0]  # fmt: skip


@pytest.mark.parametrize("forward", ["cpu-fused", "cpu-layers"])
def test_greedy_equals_the_generic_path_with_chunked_prefill(
    tiny_llama_dir: Path, generic_tokens: list[list[int]], forward: str
) -> None:
    worker = bf16_kv_worker(tiny_llama_dir)
    use_forward(worker, forward)
    # A budget of 9 tokens cuts the long prompts into chunks mixed with decodes.
    sched = FakeScheduler(worker, BLOCK_SIZE, NUM_BLOCKS, token_budget=9, max_num_seqs=3)
    ours = sched.generate(PROMPTS, 24)
    assert len({tuple(o[:4]) for o in generic_tokens}) == len(PROMPTS)
    # The generic path rounds the queries to bf16 too, so a near tie may flip: a sequence
    # may part from the generic one only where the generic top-2 are within 0.02 (this
    # model's logits are ~4) and our token is the generic second choice.
    same = 0
    for prompt, mine, theirs in zip(PROMPTS, ours, generic_tokens):
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is None:
            same += 1
            continue
        top = last_logits(worker, "layers", prompt + theirs[:first]).topk(2)
        assert top.values[0] - top.values[1] < 0.02, (prompt, first, top)
        assert mine[first] == top.indices[1], (prompt, first, top)
    assert same >= len(PROMPTS) - 1


def step_logits(worker: Worker, forward: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A prefill chunk over a cached (random bf16) prefix and a decode in one step, from
    the same cache contents: the logits of every row and the caches afterwards."""
    model, pool = worker.runner.model, worker.runner.kv_pool
    inputs = chunk_and_decode_inputs(worker, BLOCK_SIZE, NUM_BLOCKS)
    gen = torch.Generator().manual_seed(0)
    for cache in pool.key_caches + pool.value_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    use_forward(worker, forward)
    with torch.inference_mode():
        logits = model(
            inputs.input_ids, inputs.positions, pool.layer_caches(), inputs.attn_metadata,
            torch.arange(21),
        )  # fmt: skip
    return logits, [c.clone() for c in pool.key_caches + pool.value_caches]


def test_logits_close_to_the_generic_path_and_fused_equals_per_layer(
    tiny_llama_dir: Path,
) -> None:
    worker = bf16_kv_worker(tiny_llama_dir)
    fused, fused_caches = step_logits(worker, "cpu-fused")
    layers, layer_caches = step_logits(worker, "cpu-layers")
    generic, generic_caches = step_logits(worker, "layers")
    assert fused.dtype == torch.float32 and fused.shape == (21, 128)
    assert torch.equal(fused, layers)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layer_caches))
    # The generic path rounds the queries and the attention output to bf16 too (one bf16
    # ulp is 2^-8 relative); the fast path keeps them fp32. Logits are ~1-4 here.
    torch.testing.assert_close(fused, generic, atol=8e-2, rtol=3e-2)
    assert (fused - generic).abs().mean() < 1.5e-2
    assert torch.equal(fused.argmax(-1), generic.argmax(-1))
    # Layer 0's stored K/V (caches [k0, k1, v0, v1]): the same fp32 rows but for the
    # GEMMs' last bits, rounded the same way: at most one bf16 ulp apart (same signs).
    for a, b in zip(fused_caches[0::2], generic_caches[0::2]):
        ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.05
