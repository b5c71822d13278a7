"""End-to-end serving throughput through gRPC: 1 request vs N concurrent requests.

Starts an embedded cluster (local Ray, one worker, the default SmolLM2 model unless
``--model``), sends greedy requests with ``ignore_eos`` so every request produces exactly
``--max-tokens`` tokens, and reports for each concurrency level: output tokens/s, mean TTFT
and mean TPOT (time per output token after the first), and the ratio to concurrency 1.
Writes ``benchmarks/results/serving.json``.

Usage::

    .venv/bin/python benchmarks/serving.py --concurrency 1,16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import CacheConfig, ClusterConfig, ModelConfig, ServerConfig
from pagedserve.cluster.launcher import RAY_ENV, start_cluster

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are the main causes of climate change?",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
]


def one_request(address: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """Returns (ttft_s, total_s, completion_tokens) of one streamed chat request."""
    with Client(address, timeout_s=1800) as c:
        t0 = time.perf_counter()
        ttft = None
        n = 0
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


def run_level(address: str, concurrency: int, max_tokens: int) -> dict[str, float]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(lambda p: one_request(address, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    tpots = [(r[1] - r[0]) / max(1, r[2] - 1) for r in results]
    return {
        "concurrency": concurrency,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "mean_ttft_s": round(statistics.mean(r[0] for r in results), 3),
        "mean_tpot_ms": round(1000 * statistics.mean(tpots), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--cpus-per-worker", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    args = ap.parse_args()
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=args.model),
        cache=CacheConfig(num_blocks=args.num_blocks),
        server=ServerConfig(port=0),
        cpus_per_worker=args.cpus_per_worker,
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    handle = asyncio.run_coroutine_threadsafe(start_cluster(config), loop).result()
    try:
        one_request(handle.address, PROMPTS[0], 4)  # warm-up
        rows = [
            run_level(handle.address, int(c), args.max_tokens) for c in args.concurrency.split(",")
        ]
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_first"] = round(r["tokens_per_s"] / base, 2)
        print(
            f"concurrency {r['concurrency']:>3}: {r['tokens_per_s']:8.2f} tok/s  "
            f"TTFT {r['mean_ttft_s']:.3f} s  TPOT {r['mean_tpot_ms']:.1f} ms  "
            f"x{r['speedup_vs_first']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    out.write_text(json.dumps(meta, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
