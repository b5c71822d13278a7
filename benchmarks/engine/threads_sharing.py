"""Worker torch threads when the cores are shared: tokens/s with and without a busy core.

The real Scheduler + Worker in process (no Ray), ``--num-requests`` greedy requests of
``--prompt-len`` random token ids x ``--max-tokens`` outputs all at once, for each thread
setting (``fixed-N``: ``torch.set_num_threads(N)``; ``adaptive``: N = all cores with
``pagedserve.worker.cpu_threads.ThreadGovernor``), once on the machine as it is and once
with a busy process pinned to core 0 (``--co-load``, a seeded integer loop). Prints and
writes ``benchmarks/results/threads_sharing.json`` (or ``--out``) with tokens/s, the
slowdown with the busy core, and the thread count the governor settled on.

Usage::

    .venv/bin/python benchmarks/engine/threads_sharing.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads.py
from workloads import busy_core

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run(worker: Worker, args: Any) -> float:
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.num_requests,
            max_model_len=info.max_model_len,
            async_scheduling=False,
        ),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = [rng.randint(100, 30000) for _ in range(args.prompt_len)]
        sched.add_request(EngineRequest(f"r{i}", prompt, sp, info.eos_token_ids))
    tokens = 0

    def count(outputs: list) -> None:
        nonlocal tokens
        tokens += sum(len(o.new_token_ids) for o in outputs)

    engine = EngineLoop(sched, {0: InlineWorker(worker.execute_model)}, count)
    t0 = time.perf_counter()
    asyncio.run(engine.run_until_idle())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--settings", default="fixed-2,fixed-1,adaptive")
    ap.add_argument("--out", default=str(RESULTS / "threads_sharing.json"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    model_dir = str(resolve_model(args.model, progress=False))
    result: dict[str, Any] = {"cpu_count": cores, "load_avg_before": os.getloadavg()}
    rows = []
    for setting in args.settings.split(","):
        adaptive = setting == "adaptive"
        threads = cores if adaptive else int(setting.split("-")[1])
        worker = Worker(
            WorkerConfig(
                model=ModelConfig(model=model_dir, max_model_len=1024),
                cache=CacheConfig(num_blocks=2048),
                device="cpu",
                num_threads=threads,
                adaptive_threads=adaptive,
            )
        )
        run(worker, args)  # warm-up
        row: dict[str, Any] = {"setting": setting}
        for co_load in (False, True):
            stop = mp.Event()
            hog = None
            if co_load:
                hog = mp.Process(target=busy_core, args=(0, 0, stop), daemon=True)
                hog.start()
                time.sleep(2.5)  # two governor readings see it
            try:
                row["busy_core" if co_load else "as_is"] = run(worker, args)
                row["threads_after_busy" if co_load else "threads_after_as_is"] = (
                    torch.get_num_threads()
                )
            finally:
                stop.set()
                if hog is not None:
                    hog.join(timeout=10)
            time.sleep(2.5)
        row["slowdown"] = row["as_is"] / row["busy_core"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.set_num_threads(cores)
    result["rows"] = rows
    result["load_avg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
