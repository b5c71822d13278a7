"""Idle gap between a worker's steps, with and without overlapped scheduling.

Starts the real cluster in process (embedded Ray, one worker, the default model) once with
``SchedulerConfig.async_scheduling`` off and once on; at each concurrency (default 1, 16,
64) a closed loop of greedy requests (``--prompt-len`` random token ids, ``--max-tokens``
outputs, ``ignore_eos``) keeps the worker busy. The gap is measured by the scheduler from
the worker's own clock (``RunnerOutput.started_s`` and ``execute_time_s``: from the end of
one model step to the start of the next, while work remained; the
``pagedserve:worker_step_gap_seconds`` histogram); the script reports its mean and the
bucket holding its median, the mean model step, and output tokens/s. Writes
``benchmarks/results/step_gap.json`` (or ``--out``).

``--preemption-mode auto --swap-space 4`` runs with a host block store, as ``pagedserve
serve`` does by default (a small ``--num-blocks`` makes it swap); each row then also
reports the swap counters of the level.

Usage::

    .venv/bin/python benchmarks/engine/step_gap.py
    .venv/bin/python benchmarks/engine/step_gap.py --concurrency 1,16 --requests-per-level 16
    .venv/bin/python benchmarks/engine/step_gap.py --preemption-mode auto --swap-space 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import ClusterConfig, ModelConfig, SchedulerConfig, ServerConfig
from pagedserve.cluster.launcher import RAY_ENV, start_cluster
from pagedserve.worker.config import CacheConfig

RESULTS = Path(__file__).resolve().parents[1] / "results"
GAP = "worker_step_gap_seconds"


def _median_bucket(before: Any, after: Any) -> float | None:
    counts = [a - b for a, b in zip(after.counts, before.counts, strict=True)]
    total = sum(counts)
    if total == 0:
        return None
    seen = 0
    bounds = [*after.buckets, float("inf")]
    for bound, c in zip(bounds, counts, strict=True):
        seen += c
        if seen * 2 >= total:
            return bound
    return None


def run_level(handle: Any, loop: Any, concurrency: int, n: int, args: Any) -> dict[str, Any]:
    rng = random.Random(concurrency)
    prompts = [[rng.randint(100, 30000) for _ in range(args.prompt_len)] for _ in range(n)]

    def metrics() -> Any:
        fut = asyncio.run_coroutine_threadsafe(_get_metrics(handle), loop)
        return fut.result(timeout=60)

    lock = threading.Lock()
    todo = list(prompts)
    tokens = [0]

    def client() -> None:
        with Client(handle.address, timeout_s=3600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    p = todo.pop()
                out = c.generate(
                    token_ids=p, max_tokens=args.max_tokens, temperature=0, ignore_eos=True
                )
                with lock:
                    tokens[0] += len(out.choices[0].token_ids)

    def swap() -> dict[str, Any]:
        fut = asyncio.run_coroutine_threadsafe(_get_stats(handle), loop)
        st = fut.result(timeout=60)
        sw = st.swap
        return {
            "recomputed_tokens": st.num_recomputed_tokens,
            "swap_outs": sw.num_swap_outs,
            "swap_ins": sw.num_swap_ins,
            "swap_failures": sw.num_swap_failures,
            "preemptions": sum(sw.preemptions_by_mode.values()),
        }

    before = metrics()
    swap_before = swap()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    after = metrics()
    swap_after = swap()
    gb, ga = before.histograms[GAP], after.histograms[GAP]
    steps = ga.count - gb.count
    it_b, it_a = (
        before.histograms["iteration_tokens_total"],
        after.histograms["iteration_tokens_total"],
    )
    num_steps = it_a.count - it_b.count
    return {
        "concurrency": concurrency,
        "requests": n,
        "gaps_measured": steps,
        "gap_mean_ms": 1e3 * (ga.sum - gb.sum) / steps if steps else None,
        "gap_median_bucket_ms": (1e3 * b if (b := _median_bucket(gb, ga)) is not None else None),
        "steps": num_steps,
        "tokens_computed": it_a.sum - it_b.sum,  # prompt + decode tokens, recomputes included
        "step_mean_ms": 1e3 * wall / num_steps if num_steps else None,
        "output_tokens_per_s": tokens[0] / wall,
        "wall_s": wall,
        **{k: swap_after[k] - swap_before[k] for k in swap_after},
    }


async def _get_metrics(handle: Any) -> Any:
    return await handle.scheduler.get_metrics.remote()


async def _get_stats(handle: Any) -> Any:
    return await handle.scheduler.get_stats.remote()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests-per-level", type=int, default=0, help="0 = 2x concurrency")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    ap.add_argument("--swap-space", type=float, default=0.0, help="GiB of host block store")
    ap.add_argument("--modes", default="serial,overlapped", help="serial, overlapped or both")
    ap.add_argument("--out", default=str(RESULTS / "step_gap.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - {"serial", "overlapped"}:
        ap.error(f"--modes takes serial and/or overlapped, got {args.modes!r}")
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    levels = [int(x) for x in args.concurrency.split(",")]
    result: dict[str, Any] = {"load_avg_before": os.getloadavg(), "args": vars(args)}
    for overlap in (m == "overlapped" for m in modes):
        config = ClusterConfig(
            model=ModelConfig(model=args.model, max_model_len=1024),
            cache=CacheConfig(num_blocks=args.num_blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=max(levels),
                async_scheduling=overlap,
                preemption_mode=args.preemption_mode,
            ),
            server=ServerConfig(port=0, http_port=None),
            cpus_per_worker=os.cpu_count() or 1,
            swap_space=int(args.swap_space * (1 << 30)),
        )
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        handle = asyncio.run_coroutine_threadsafe(start_cluster(config), loop).result()
        try:
            with Client(handle.address, timeout_s=600) as c:
                c.generate(token_ids=[101] * 8, max_tokens=4, temperature=0)
            rows = []
            for conc in levels:
                n = args.requests_per_level or 2 * conc
                row = run_level(handle, loop, conc, n, args)
                print(("overlap " if overlap else "serial  ") + json.dumps(row), flush=True)
                rows.append(row)
            result["overlapped" if overlap else "serial"] = rows
        finally:
            asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(timeout=120)
            loop.call_soon_threadsafe(loop.stop)
    result["load_avg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
