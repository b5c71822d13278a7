"""Prefill/decode disaggregation end to end in process: the real Scheduler, two real
Workers on a tiny random Llama (worker 0 prefills long prompts, worker 1 decodes) and a
real host block store (gRPC on loopback) that carries the KV between them.

Greedy outputs must equal HF's: the decode worker resumes from the moved KV (nothing is
recomputed) also with n > 1 choices and when its small pool preempts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import hf_greedy, swaps_of
from test_swap_engine_tiny import MAX_NEW, add_all, assert_all_free, drive, make_workers

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.disagg import DisaggConfig
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.scheduler.swap import SwapSpec
from pagedserve.worker.host_store import serve_host_store
from pagedserve.worker.worker import Worker

LONG = 12
PROMPTS = [
    [40 + i for i in range(18)],  # long
    [99, 3, 3, 3, 120, 7, 8],
    [5, 17, 33, 9, 100, 64, 2, 77, 31, 12, 13, 14, 15],  # long
    [12, 13],
    [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80],
]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture()
def store():
    server, port, st = serve_host_store(1 << 30)
    yield f"127.0.0.1:{port}", st
    server.stop(0)


def make_scheduler(workers: list[Worker], mode: str = "recompute", budget: int = 8) -> Scheduler:
    info = workers[0].get_info()
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=info.max_model_len,
            preemption_mode=mode,
            host_prefix_cache=False,
        ),
        [WorkerSpec(i, w.get_info().num_blocks, 4) for i, w in enumerate(workers)],
        SwapSpec(64, info.block_bytes, 1e9, 1e-3),
        DisaggConfig(frozenset({0}), LONG),
    )


def moved_groups(log: list):
    def on_step(s: Scheduler, wid: int, so) -> None:
        for t in swaps_of(so).blocks_to_swap_out:
            log.append(("out", wid, tuple(sorted(t.seq_ids))))
        for t in swaps_of(so).blocks_to_swap_in:
            log.append(("in", wid, tuple(sorted(t.seq_ids))))

    return on_step


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_one_prefill_and_one_decode_worker_equal_hf(
    tiny_llama_dir: Path, expected, store, overlap: bool
) -> None:
    address, st = store
    workers = make_workers(tiny_llama_dir, 2, 32, address)
    sched = make_scheduler(workers)
    add_all(sched, PROMPTS)
    log: list = []
    tokens = drive(sched, workers, moved_groups(log), overlap=overlap)
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref, i
    assert sorted(log) == [
        ("in", 1, ("r0/0",)),
        ("in", 1, ("r2/0",)),
        ("out", 0, ("r0/0",)),
        ("out", 0, ("r2/0",)),
    ]
    assert sched.num_recomputed_tokens == 0
    d, sw = sched.disagg_stats(), sched.swap_stats()
    assert d.num_handoffs == d.num_resumed == 2
    assert st.swap_out_bytes == sw.swap_out_bytes == d.handoff_bytes > 0
    assert sw.num_swap_failures == 0
    assert_all_free(sched, st)


def test_n_choices_and_preemption_on_the_decoder_equal_independent_runs(
    tiny_llama_dir: Path, expected, store
) -> None:
    """n = 3 greedy choices of the long prompts move as one group and each equals HF; the
    decode worker's 9-block pool preempts (recompute) and outputs still equal HF."""
    address, st = store
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=3)
    (decoder,) = make_workers(tiny_llama_dir, 1, 9, address)
    decoder.config = dataclasses.replace(decoder.config, worker_id=1)
    workers = make_workers(tiny_llama_dir, 1, 32, address) + [decoder]
    sched = make_scheduler(workers)
    add_all(sched, [PROMPTS[0], PROMPTS[2]], sampling)
    log: list = []
    tokens = drive(sched, workers, moved_groups(log))
    for i, ref in enumerate([expected[0], expected[2]]):
        for c in range(3):
            assert tokens[(f"r{i}", c)] == ref, (i, c)
    assert ("out", 0, ("r0/0", "r0/1", "r0/2")) in log
    assert sched.workers[1].num_preemptions > 0
    assert sched.disagg_stats().num_resumed == 2
    assert_all_free(sched, st)
