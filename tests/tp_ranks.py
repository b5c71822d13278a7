"""Run a tensor-parallel worker as ``T`` local processes (gloo on 127.0.0.1) for tests.

:func:`run_ranks` spawns one process per rank, each building a
:class:`~pagedserve.worker.worker.Worker` with its :class:`ParallelConfig`; rank 0 runs
``job(worker)`` (a picklable module-level function) and sends back its result, the other
ranks follow rank 0 (:meth:`Worker.follow`). Every rank also reports the bytes of the
weights it holds. Everything is bounded: the group's collectives by ``timeout_s``, the
wait for the answers by ``timeout_s`` more; ranks still alive then are killed.
"""

from __future__ import annotations

import queue as queue_mod
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.multiprocessing as mp

from pagedserve.worker.config import ParallelConfig, WorkerConfig


@dataclass(frozen=True)
class RankResult:
    """What the group sent back: rank 0's job result and every rank's weight bytes."""

    result: Any
    weight_bytes: list[int]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, config: WorkerConfig, job: Callable[[Any], Any], answers: Any) -> None:
    from pagedserve.worker.worker import Worker

    try:
        parallel = replace(config.parallel, rank=rank)
        worker = Worker(replace(config, parallel=parallel, worker_id=0))
        weights = sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())
        answers.put(("weights", rank, weights))
        if rank == 0:
            result = job(worker)
            worker.leave()
            answers.put(("result", rank, result))
        else:
            worker.follow()
    except BaseException:
        answers.put(("error", rank, traceback.format_exc()))
        raise


def run_ranks(
    config: WorkerConfig, size: int, job: Callable[[Any], Any], timeout_s: float = 240.0
) -> RankResult:
    """``job(worker)`` on rank 0 of a ``size``-rank group built from ``config``.

    Raises:
        RuntimeError: a rank failed (its traceback in the message) or the group did not
            answer within ``timeout_s``.
    """
    parallel = ParallelConfig(size, 0, f"tcp://127.0.0.1:{free_port()}", timeout_s=timeout_s)
    config = replace(config, parallel=parallel)
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, config, job, answers), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    weights: dict[int, int] = {}
    result: Any = None
    got_result = False
    try:
        while not (got_result and len(weights) == size):
            try:
                kind, rank, value = answers.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise RuntimeError(f"the {size} ranks did not answer in {timeout_s} s") from None
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if kind == "weights":
                weights[rank] = value
            else:
                result, got_result = value, True
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return RankResult(result, [weights[r] for r in range(size)])


def greedy_job(
    prompts: list[list[int]],
    max_new: int,
    block_size: int,
    num_blocks: int,
    token_budget: int,
    max_num_seqs: int,
    worker: Any,
) -> tuple[list[list[int]], list[list[tuple[int, float, tuple[tuple[int, float], ...]]]]]:
    """Greedy outputs of ``prompts`` through ``worker`` driven by the tests' fake scheduler
    (``logprobs=2``), and each output's ``(token, logprob, top-2)`` per step: a job for
    :func:`run_ranks` (bind the leading arguments with ``functools.partial``)."""
    from helpers import FakeScheduler

    from pagedserve.scheduler.sampling_params import SamplingParams

    sched = FakeScheduler(worker, block_size, num_blocks, token_budget, max_num_seqs)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=2)
    tokens = sched.generate(prompts, max_new, sampling)
    lps = [
        [
            (lp.token_id, lp.logprob, tuple(lp.top))
            for o in sched.outputs
            if (lp := o.logprobs.get(f"req-{i}")) is not None
        ]
        for i in range(len(prompts))
    ]
    return tokens, lps


def swap_job(
    address: str,
    prompts: list[list[int]],
    max_new: int,
    host_blocks: int,
    budget: int,
    worker: Any,
) -> tuple[dict[str, list[int]], Any, int]:
    """Greedy outputs of ``prompts`` through ``worker`` (connected to the host block store
    at ``address``) driven by the real Scheduler with ``preemption_mode="swap"`` and the
    integrity of every step checked, the scheduler's ``SwapStats`` and a rank's block
    bytes: a job for
    :func:`run_ranks` (bind the leading arguments with ``functools.partial``)."""
    import helpers

    from pagedserve.scheduler.config import SchedulerConfig
    from pagedserve.scheduler.engine_messages import EngineRequest
    from pagedserve.scheduler.sampling_params import SamplingParams
    from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
    from pagedserve.scheduler.swap import SwapSpec

    worker.connect_host_store(address)
    bandwidth, prefill = worker.measure_swap_costs()
    info = worker.get_info()
    spec = SwapSpec(
        num_host_blocks=host_blocks,
        block_bytes=info.block_bytes * info.tensor_parallel_size,
        bandwidth_bytes_per_s=bandwidth,
        prefill_s_per_token=prefill,
    )
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=info.max_model_len,
            preemption_mode="swap",
            host_prefix_cache=False,
        ),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
        spec,
    )
    sampling = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(f"r{i}", p, sampling, (2,)))
    seen = helpers.drive(sched, [worker.execute_model])
    tokens = {rid: toks for (rid, _), toks in seen.tokens.items()}
    for ws in sched.workers.values():
        assert ws.kv.num_free_blocks == ws.spec.num_blocks
    return tokens, sched.swap_stats(), info.block_bytes
