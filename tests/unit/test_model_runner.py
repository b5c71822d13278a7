"""ModelRunner / Worker on the tiny model: info, KV pool sizing, seeded sampling across
batching and preemption, and clear errors for SchedulerOutputs that break the contract."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import GREEDY, FakeScheduler

from pagedserve.scheduler.outputs import CachedSequenceData, NewSequenceData, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.kv_pool import bytes_per_block
from pagedserve.worker.worker import Worker

BLOCK_SIZE = 4


def worker_for(model_dir: Path, **cache: int) -> Worker:
    cache.setdefault("num_blocks", 64)
    return Worker(
        WorkerConfig(
            model=ModelConfig(model=str(model_dir), max_model_len=64, dtype="float32"),
            cache=CacheConfig(block_size=BLOCK_SIZE, **cache),
            device="cpu",
        )
    )


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: Path) -> Worker:
    return worker_for(tiny_llama_dir)


def test_info_and_ping(worker: Worker, tiny_llama_dir: Path) -> None:
    info = worker.get_info()
    assert (info.num_blocks, info.block_size, info.max_model_len) == (64, BLOCK_SIZE, 64)
    assert (info.vocab_size, info.eos_token_ids) == (128, (2,))
    assert (info.device, info.dtype) == ("cpu", "float32")
    assert Path(info.model_path) == tiny_llama_dir.resolve()
    assert worker.ping() == "pong"
    # An empty step is fine and returns nothing.
    assert worker.execute_model(SchedulerOutput(0)).sampled_token_ids == {}


def test_pool_sized_from_memory(tiny_llama_dir: Path) -> None:
    w = worker_for(tiny_llama_dir)
    per_block = bytes_per_block(w.runner.arch, BLOCK_SIZE, w.runner.dtype)
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    sized = worker_for(tiny_llama_dir, num_blocks=None, kv_cache_memory=5 * per_block + 7)
    assert sized.get_info().num_blocks == 5
    assert sized.runner.kv_pool.nbytes == 5 * per_block
    with pytest.raises(ValueError, match="holds no KV block"):
        worker_for(tiny_llama_dir, num_blocks=None, kv_cache_memory=per_block - 1)


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=99)
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]


def test_seeded_sampling_ignores_batching_and_preemption(worker: Worker) -> None:
    alone = FakeScheduler(worker, BLOCK_SIZE, 64, token_budget=64).generate(
        [PROMPT], 12, SEEDED, prefix="alone"
    )[0]
    others = [[3, 4, 5], [60] * 9]
    mixed = FakeScheduler(worker, BLOCK_SIZE, 64, token_budget=5, shuffle_seed=3).generate(
        [*others, PROMPT], 12, SEEDED, prefix="mixed"
    )[2]
    assert mixed == alone
    # Preempted after 5 tokens and recomputed: the resumed request carries its outputs.
    head = FakeScheduler(worker, BLOCK_SIZE, 64).generate([PROMPT], 5, SEEDED, prefix="p1")[0]
    tail = FakeScheduler(worker, BLOCK_SIZE, 64, token_budget=4).generate(
        [PROMPT + head], 7, SEEDED, prefix="p2", num_prompt_tokens=[len(PROMPT)]
    )[0]
    assert head + tail == alone
    # Greedy stays greedy and another seed gives another stream.
    other = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99, max_tokens=99)
    assert FakeScheduler(worker, BLOCK_SIZE, 64).generate([PROMPT], 12, other)[0] != alone


def test_unseeded_requests_draw_distinct_seeds(worker: Worker) -> None:
    unseeded = SamplingParams(temperature=1.0, max_tokens=99)
    outs = FakeScheduler(worker, BLOCK_SIZE, 64).generate([PROMPT, PROMPT], 10, unseeded)
    assert outs[0] != outs[1]  # two requests draw two seeds


def new_req(seq_id: str, blocks: list[int], computed: int = 0) -> NewSequenceData:
    return NewSequenceData(seq_id, PROMPT, len(PROMPT), blocks, computed, GREEDY)


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (SchedulerOutput(1, cached_seqs=[CachedSequenceData("ghost", 0, [], 0)]), "unknown"),
        (SchedulerOutput(1, num_scheduled_tokens={"ghost": 1}), "unknown"),
        (
            SchedulerOutput(1, [new_req("a", [0, 1, 2])], num_scheduled_tokens={"a": 12}),
            "past its 11 known tokens",
        ),
        (
            SchedulerOutput(1, [new_req("a", [0, 1])], num_scheduled_tokens={"a": 11}),
            "need 3 blocks",
        ),
        (
            SchedulerOutput(1, [new_req("a", [0, 1, 64])], num_scheduled_tokens={"a": 11}),
            r"block ids must be in \[0, 64\)",
        ),
        (
            SchedulerOutput(1, [new_req("a", [0, 1, 2])], num_scheduled_tokens={"a": 0}),
            "must be >= 1",
        ),
    ],
)
def test_contract_violations_raise(worker: Worker, so: SchedulerOutput, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        worker.execute_model(so)
    worker.execute_model(SchedulerOutput(2, finished_seq_ids=["a"]))


def test_max_model_len_enforced(worker: Worker) -> None:
    long = NewSequenceData("long", list(range(70)), 70, list(range(18)), 0, GREEDY)
    with pytest.raises(ValueError, match="beyond max_model_len 64"):
        worker.execute_model(SchedulerOutput(1, [long], num_scheduled_tokens={"long": 65}))
    worker.execute_model(SchedulerOutput(2, finished_seq_ids=["long"]))


def test_device_and_length_errors(tiny_llama_dir: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            Worker(
                WorkerConfig(
                    model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"), device="cuda"
                )
            )
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        Worker(
            WorkerConfig(
                model=ModelConfig(model=str(tiny_llama_dir), max_model_len=513, dtype="float32")
            )
        )
