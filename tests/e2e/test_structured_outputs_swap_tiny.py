"""Structured outputs under swap preemption on a tiny random Llama: the real Scheduler,
real Workers and a real host block store. A swapped-in (or migrated) sequence reaches a
worker as a new sequence and its matcher is rebuilt from its output tokens, so outputs
equal those of a run with room for everything (serial and overlapped loops) and still
satisfy their constraints; when the worker that swapped them out dies, the other worker
finishes them with the same tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helpers
import pytest
from helpers import InProcessWorker

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.scheduler.swap import SwapSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.host_store import serve_host_store
from pagedserve.worker.worker import Worker

SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["aa", "bb"]}, "v": {"type": "integer", "maximum": 999}},
    "required": ["k", "v"],
}
REGEX = r"[a-f]{3,9}"
REQUESTS = [  # (prompt, spec, n)
    ([5, 17, 33, 9, 100, 64, 2, 77, 31], StructuredOutputs(regex=REGEX), 1),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], StructuredOutputs(json=json.dumps(SCHEMA)), 1),
    ([99, 3, 3, 3, 120, 7, 8], StructuredOutputs(choice=("alpha", "beta", "gamma")), 2),
    ([70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80], StructuredOutputs(json=json.dumps(SCHEMA)), 1),
    ([12, 13], StructuredOutputs(regex=REGEX), 1),
]  # fmt: skip


def sampling(spec: StructuredOutputs, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=28, temperature=1.0, seed=5, n=n, structured_outputs=spec)


@pytest.fixture()
def store():
    server, port, _ = serve_host_store(1 << 30)
    yield f"127.0.0.1:{port}"
    server.stop(0)


def make_workers(model_dir: Path, n: int, num_blocks: int, address: str | None) -> list[Worker]:
    workers = []
    for wid in range(n):
        w = Worker(
            WorkerConfig(
                worker_id=wid,
                model=ModelConfig(model=str(model_dir), dtype="float32"),
                cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                device="cpu",
            )
        )
        if address is not None:
            w.connect_host_store(address)
        workers.append(w)
    return workers


def make_scheduler(workers: list[Worker], mode: str, overlap: bool = False) -> Scheduler:
    info = workers[0].get_info()
    spec = SwapSpec(
        num_host_blocks=64,
        block_bytes=info.block_bytes,
        bandwidth_bytes_per_s=1e9,
        prefill_s_per_token=1e-3,
    )
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=6,
            max_model_len=info.max_model_len,
            preemption_mode=mode,
            async_scheduling=overlap,
        ),
        [WorkerSpec(i, w.get_info().num_blocks, 4) for i, w in enumerate(workers)],
        spec,
    )
    for i, (prompt, so, n) in enumerate(REQUESTS):
        seq = sched.add_request(EngineRequest(f"r{i}", prompt, sampling(so, n), (2,)))[0]
        if seq.queued_on != 0:  # everything starts on worker 0
            sched.workers[seq.queued_on].waiting.remove(seq)
            sched._enqueue(sched.workers[0], seq)
    return sched


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict:
    workers = make_workers(tiny_llama_dir, 1, 128, None)
    sched = make_scheduler(workers, "recompute")
    tokens = helpers.drive(sched, [w.execute_model for w in workers]).tokens
    assert sched.num_preemptions == 0
    return tokens


def check_constraints(model_dir: Path, tokens: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for i, (_, spec, n) in enumerate(REQUESTS):
        for c in range(n):
            ids = tokens[(f"r{i}", c)]
            assert ids[-1] == 2, (i, c, ids)  # ended on EOS, where the grammar accepts
            text = tok.decode(ids[:-1])
            if spec.regex is not None:
                assert re.fullmatch(REGEX, text), text
            elif spec.choice is not None:
                assert text in spec.choice, text
            else:
                obj = json.loads(text)
                assert set(obj) == {"k", "v"} and obj["k"] in ("aa", "bb"), obj
                assert isinstance(obj["v"], int) and obj["v"] <= 999, obj


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_forced_swap_keeps_tokens_and_constraints(
    tiny_llama_dir: Path, reference, store, overlap: bool
) -> None:
    workers = make_workers(tiny_llama_dir, 1, 14, store)
    sched = make_scheduler(workers, "swap", overlap)
    seen = helpers.drive(sched, [w.execute_model for w in workers])
    assert (seen.ahead > 0) is overlap
    assert sched.swap_stats().num_swap_ins > 0
    assert seen.tokens == reference
    check_constraints(tiny_llama_dir, seen.tokens)


def test_migration_to_the_other_worker_rebuilds_matchers(
    tiny_llama_dir: Path, reference, store
) -> None:
    workers = make_workers(tiny_llama_dir, 2, 14, store)
    sched = make_scheduler(workers, "swap")
    migrated: list[str] = []

    def dies_once_swapped(so) -> bool:
        swapped = [sid for sid, g in sched._swaps.groups.items() if not g.pending]
        migrated.extend(swapped)
        return bool(swapped)

    real_has_work = sched.has_work
    # Worker 1 idles (it would steal) until worker 0 has swapped something out and died.
    sched.has_work = lambda w: real_has_work(w) and (w == 0 or not sched.workers[0].alive)  # type: ignore[method-assign]
    dying = InProcessWorker(workers[0].execute_model, die_when=dies_once_swapped)
    seen = helpers.drive(sched, [dying, workers[1].execute_model])
    assert migrated
    assert seen.tokens == reference
    check_constraints(tiny_llama_dir, seen.tokens)
