"""Batch-invariant mode: fixed-shape matmuls make a sequence's logits, and so its seeded
samples, bitwise independent of what it is batched with and of preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import drive
from torch.nn import functional as F

from pagedserve.kernels import cpu_native
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.batch_invariant import ROWS, InvariantLinear, invariant_linear
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.packed_linear import PackedLinear
from pagedserve.worker.worker import Worker

GOLDFISH = "A list of names for a pet goldfish:"


@pytest.mark.parametrize(("k", "n"), [(96, 192), (576, 1536), (1536, 576), (576, 49152)])
def test_invariant_linear_rows_do_not_depend_on_the_batch(k: int, n: int):
    torch.manual_seed(0)
    x = torch.randn(3 * ROWS + 5, k)
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n)
    full = invariant_linear(x, w, b)
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for start, stop in [(0, 1), (7, 8), (len(x) - 1, len(x)), (3, 3 + ROWS + 2), (10, 40)]:
        part = invariant_linear(x[start:stop], w, b)
        assert torch.equal(part, full[start:stop]), (k, n, start, stop)
    # A row keeps its value whatever rows surround it in the tile.
    shuffled = x[torch.randperm(len(x))]
    again = invariant_linear(torch.cat([x[5:6], shuffled]), w, b)
    assert torch.equal(again[0], full[5])


def run(model_dir: Path, requests, num_blocks: int, batch_invariant: bool, budget: int = 64,
        block_size: int = 4, max_model_len: int | None = None):  # fmt: skip
    """Serve ``requests`` ((id, prompt ids, SamplingParams)) in process; per (id, choice):
    (token ids, logprobs of the sampled tokens)."""
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(
                model=str(model_dir),
                batch_invariant=batch_invariant,
                max_model_len=max_model_len,
                dtype="float32",
            ),
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
            device="cpu",
        )
    )
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=budget,
            max_model_len=info.max_model_len,
            async_scheduling=False,
        ),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    for rid, prompt, sampling in requests:
        sched.add_request(EngineRequest(rid, prompt, sampling, info.eos_token_ids))
    out: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    for o in drive(sched, [worker.execute_model], timeout_s=600).outputs:
        ids, lps = out.setdefault((o.request_id, o.choice_index), ([], []))
        ids.extend(o.new_token_ids)
        lps.extend(lp.logprob for lp in o.logprobs)
    assert sched.workers[0].kv.num_free_blocks == info.num_blocks
    return out, sched.num_preemptions


def test_seeded_request_alone_equals_in_a_batch_with_preemption(tiny_llama_dir: Path):
    seeded = SamplingParams(
        max_tokens=16, temperature=1.0, seed=5, n=8, ignore_eos=True, logprobs=0
    )
    prompt = [5, 17, 33, 9, 100, 64, 2, 77, 31, 8]
    alone, _ = run(tiny_llama_dir, [("s", prompt, seeded)], 256, True)
    others = [
        (f"o{i}", [40 + i, 41, 42, 43, 44, 45, 46, 47][: 3 + i], SamplingParams(
            max_tokens=12, temperature=0.7, seed=i, n=1 + i % 3, ignore_eos=True))
        for i in range(5)
    ]  # fmt: skip
    busy, preemptions = run(
        tiny_llama_dir, [others[0], ("s", prompt, seeded), *others[1:]], 14, True, budget=7
    )
    assert preemptions > 0  # the small pool made sequences recompute
    for c in range(8):
        assert busy[("s", c)] == alone[("s", c)], c  # token ids and logprobs, bitwise


def test_batch_invariant_refuses_a_path_it_does_not_cover(tiny_llama_dir: Path):
    cfg = WorkerConfig(
        model=ModelConfig(model=str(tiny_llama_dir), batch_invariant=True, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=8),
        device="cpu",
        attention_backend="torch",
    )
    with pytest.raises(ValueError, match="batch_invariant"):
        Worker(cfg)


def _invariant_worker(tiny_llama_dir: Path) -> Worker:
    return Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), batch_invariant=True, dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=8),
            device="cpu",
        )
    )


@pytest.mark.skipif(not cpu_native.gemm_available(), reason="CPU kernels not built")
def test_model_layers_use_the_packed_gemm(tiny_llama_dir: Path):
    """With the packed GEMM (row-invariant by construction) every linear is packed."""
    model = _invariant_worker(tiny_llama_dir).runner.model
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    tied = model.packed_head is not None
    assert tied == (model.lm_head is None)
    assert len(packed) == 4 * len(model.layers) + (0 if tied else 1)  # qkv, o, gate_up, down
    assert model.batch_invariant


def test_model_layers_switch_to_invariant_linear(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """Without the packed GEMM the linears run on fixed-shape tiles of torch's GEMM."""
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "0")
    model = _invariant_worker(tiny_llama_dir).runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is InvariantLinear for m in linears)
    assert model.batch_invariant


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_goldfish_n64_alone_equals_small_pool(smollm2_dir: Path):
    """The example that shows the problem: n=64, seed 5, 32 tokens, temperature 1, a roomy
    pool against 12 blocks of 16 and max_model_len 256 (preemption, other batch sizes)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_dir)(GOLDFISH)["input_ids"]
    sampling = SamplingParams(max_tokens=32, temperature=1.0, seed=5, n=64, ignore_eos=True)
    req = [("g", ids, sampling)]
    roomy, _ = run(smollm2_dir, req, 512, True, budget=2048, block_size=16)
    small, preemptions = run(
        smollm2_dir, req, 12, True, budget=2048, block_size=16, max_model_len=256
    )
    assert preemptions > 0
    same = sum(roomy[("g", c)][0] == small[("g", c)][0] for c in range(64))
    assert same == 64
