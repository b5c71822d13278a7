"""Overlapped scheduling with the real Worker in-process on a tiny random Llama.

The engine loop that serves (:mod:`pagedserve.scheduler.engine_loop`, overlapped), driven
in-process (``helpers.drive``): step t+1 is planned (and, as the worker actor would once t
ends, executed) before step t's answer is applied. Greedy outputs must equal HF transformers' greedy, also under preemption and
chunked prefill, with stop tokens found one step late and aborts while steps are in
flight; every block is free at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import drive, hf_greedy

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
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 60, 61, 62],
    [12, 13],
]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def engine(model_dir: Path, num_blocks: int, budget: int, admission: str):
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
            admission=admission,
        ),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    return worker, sched, info


def run_overlapped(worker, sched, abort=None):
    """Run the overlapped engine loop over one in-process worker; ``abort(step, sched)``
    is called after each step is planned (requests can be aborted while it is in flight)."""
    assert sched.config.async_scheduling
    planned = [0]
    finish: dict[str, object] = {}

    def on_plan(s, wid, so, cur):
        planned[0] += 1
        if abort is not None:
            for out in abort(planned[0], s):
                finish[out.request_id] = out.finish_reason

    seen = drive(sched, [worker.execute_model], on_plan=on_plan)
    assert seen.ahead > 0
    return seen.tokens, {**seen.finish, **finish}


@pytest.mark.parametrize(
    ("num_blocks", "budget", "admission"),
    [(64, 64, "projected"), (14, 6, "fits-now"), (14, 6, "projected")],
)
def test_overlapped_greedy_equals_hf(tiny_llama_dir, expected, num_blocks, budget, admission):
    worker, sched, info = engine(tiny_llama_dir, num_blocks, budget, admission)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        sched.add_request(EngineRequest(f"r{i}", p, greedy, info.eos_token_ids))
    tokens, _ = run_overlapped(worker, sched)
    for i, ref in enumerate(expected):
        assert tokens[(f"r{i}", 0)] == ref
    if admission == "fits-now":
        assert sched.num_preemptions > 0
    assert sched.workers[0].kv.num_free_blocks == info.num_blocks


def test_stops_found_late_and_aborts_in_flight(tiny_llama_dir, expected):
    worker, sched, info = engine(tiny_llama_dir, 64, 64, "projected")
    # r0 stops at its 4th token (a stop token id, found one step late); r1 is aborted
    # after the 5th step was planned, while it is in flight; the others run to the end.
    stop_tok = expected[0][3]
    cut = expected[0].index(stop_tok) + 1
    for i, p in enumerate(PROMPTS):
        stop = (stop_tok,) if i == 0 else ()
        sp = SamplingParams(
            max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop_token_ids=stop
        )
        sched.add_request(EngineRequest(f"r{i}", p, sp, info.eos_token_ids))

    def abort(step, s):
        return s.abort_request("r1") if step == 5 else []

    tokens, finish = run_overlapped(worker, sched, abort)
    assert tokens[("r0", 0)] == expected[0][:cut]
    assert finish["r0"].name == "STOP" and finish["r1"].name == "ABORT"
    assert tokens[("r1", 0)] == expected[1][: len(tokens[("r1", 0)])]
    assert len(tokens[("r1", 0)]) < MAX_NEW
    for i in (2, 3, 4):
        assert tokens[(f"r{i}", 0)] == expected[i]
    assert sched.workers[0].kv.num_free_blocks == info.num_blocks
    assert not sched.sequences


def test_n_choices_fork_under_overlap(tiny_llama_dir, expected):
    worker, sched, info = engine(tiny_llama_dir, 64, 64, "projected")
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=3)
    for i, p in enumerate(PROMPTS[:2]):
        sched.add_request(EngineRequest(f"r{i}", p, sp, info.eos_token_ids))
    tokens, _ = run_overlapped(worker, sched)
    for i in range(2):
        for c in range(3):
            assert tokens[(f"r{i}", c)] == expected[i]
    assert sched.workers[0].kv.num_free_blocks == info.num_blocks
