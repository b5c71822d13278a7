"""Ray job entrypoint: run pagedserve on an existing Ray cluster with ``ray job submit``.

::

    ray job submit --address http://127.0.0.1:8265 --runtime-env deploy/runtime_env.yaml \\
        -- python -m pagedserve.cluster.job serve --host 0.0.0.0
    ray job submit --address http://127.0.0.1:8265 --runtime-env deploy/runtime_env.yaml \\
        -- python -m pagedserve.cluster.job bench --concurrency 1,8 --max-tokens 32

``serve`` takes every ``pagedserve serve`` option; ``--address`` defaults to ``auto``, the
cluster the job runs on. The job's driver hosts the frontends (gRPC and HTTP, on the node
that runs the driver, usually the head); the scheduler and worker actors are placed by Ray.
It serves until ``ray job stop`` (SIGTERM), then stops the frontends and the actors and
exits 0 within Ray's stop grace period (``RAY_JOB_STOP_WAIT_TIME_S``, set in
deploy/runtime_env.yaml). Actors are owned by the driver, so even a SIGKILL of the driver
takes them down.

``bench`` starts the same cluster on free ports, sends ``--requests`` greedy requests
(``ignore_eos``, so each yields ``--max-tokens`` tokens) at each ``--concurrency`` level
through gRPC, prints one JSON document (client-side throughput and latency, and the
scheduler's own counters from its metrics snapshot) to stdout, which lands in the job's
logs (``ray job logs``), and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.cluster.config import ClusterConfig

# Frontend shutdown grace inside a job (seconds): Ray SIGKILLs the job after
# RAY_JOB_STOP_WAIT_TIME_S (3 s by default) of SIGTERM.
JOB_STOP_GRACE_S = 0.5
# Drain on `ray job stop` unless --drain-timeout says otherwise: well inside the stop wait
# (RAY_JOB_STOP_WAIT_TIME_S, 10 s in deploy/runtime_env.yaml), so nothing is SIGKILLed.
JOB_DRAIN_TIMEOUT_S = 5.0

BENCH_PROMPTS = (
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
)


def _cluster_config(serve_argv: list[str]) -> ClusterConfig:
    """Parse ``pagedserve serve`` options; join the job's Ray cluster unless told otherwise."""
    args = build_parser().parse_args(["serve", *serve_argv])
    if args.address is None:
        args.address = "auto"
    if not any(a.startswith("--drain-timeout") for a in serve_argv):
        args.drain_timeout = JOB_DRAIN_TIMEOUT_S
    return serve_config(args)


def _one_request(address: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, total s, output tokens) of one streamed greedy chat request."""
    from pagedserve.cluster.client import Client

    with Client(address, timeout_s=1800) as c:
        t0 = time.perf_counter()
        ttft, n = None, 0
        for d in c.stream(
            chat=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
        ):
            if d.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(d.token_ids)
        total = time.perf_counter() - t0
    return ttft or total, total, n


def run_bench(address: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """One load level: ``requests`` requests, ``concurrency`` at a time. Times in seconds."""
    prompts = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        rows = list(ex.map(lambda p: _one_request(address, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in rows)
    ttfts = sorted(r[0] for r in rows)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2),
        "mean_ttft_s": round(statistics.mean(ttfts), 4),
        "max_ttft_s": round(ttfts[-1], 4),
        "mean_tpot_s": round(statistics.mean((r[1] - r[0]) / max(1, r[2] - 1) for r in rows), 4),
    }


async def _bench(config: ClusterConfig, levels: list[int], requests: int, max_tokens: int) -> dict:
    from pagedserve.cluster.launcher import start_cluster

    server = dataclasses.replace(config.server, port=0, http_port=0)
    handle = await start_cluster(dataclasses.replace(config, server=server))
    try:
        await asyncio.to_thread(_one_request, handle.address, BENCH_PROMPTS[0], 2)  # warm-up
        rows = []
        for c in levels:
            rows.append(
                await asyncio.to_thread(run_bench, handle.address, c, max(requests, c), max_tokens)
            )
        snap = await handle.scheduler.get_metrics.remote()
    finally:
        await handle.stop(JOB_STOP_GRACE_S)
    ttft = snap.histograms["time_to_first_token_seconds"]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": handle.info.name,
        "max_tokens": max_tokens,
        "levels": rows,
        "scheduler": {  # the scheduler's own counts, warm-up included
            "prompt_tokens": snap.prompt_tokens,
            "generation_tokens": snap.generation_tokens,
            "request_success": snap.request_success,
            "num_preemptions": snap.num_preemptions,
            "mean_ttft_s": round(ttft.sum / ttft.count, 4) if ttft.count else None,
        },
    }


def main(argv: list[str] | None = None) -> int:
    """``serve`` or ``bench`` (see the module docstring); returns the exit code."""
    import logging

    from pagedserve.cluster.launcher import serve_forever

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.cluster.job",
        description="Run pagedserve as a Ray job. Other options go to `pagedserve serve`.",
    )
    parser.add_argument("command", choices=["serve", "bench"])
    parser.add_argument("--concurrency", default="1,8", help="bench: levels, comma-separated")
    parser.add_argument("--requests", type=int, default=8, help="bench: requests per level")
    parser.add_argument("--max-tokens", type=int, default=32, help="bench: tokens per request")
    args, serve_argv = parser.parse_known_args(argv)
    try:
        config = _cluster_config(serve_argv)
        if args.command == "serve":
            status = asyncio.run(serve_forever(config, grace_s=JOB_STOP_GRACE_S))
            print("pagedserve: stopped", flush=True)
            return status
        levels = [int(c) for c in args.concurrency.split(",")]
        result = asyncio.run(_bench(config, levels, args.requests, args.max_tokens))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
