"""A burst of requests on a fresh server and on the same server after a load of unique
prompts: what a long-running server pays for state the load left (the host tier of the
prefix cache spilling evictions that never come back).

For each configuration (``--configs``: the default flags, ``swap`` =
``--preemption-mode swap``, which spills every evicted cached block to the host tier,
``no-tier`` = ``--no-host-prefix-cache``) it starts ``pagedserve serve`` (SmolLM2, 1 GiB
of KV, its defaults otherwise), sends ``--bursts`` bursts of 32 streaming completions of
128 random token ids -> 64 greedy tokens (``ignore_eos``; every burst its own prompts, so
nothing hits a cache), then the load: 128 completions of 20-900 random prompt tokens and
10-250 output tokens, 64 in flight (ShareGPT-like lengths, every prompt unique: the pool
fills with cached blocks that allocation then evicts), then ``--bursts`` bursts again.
Per burst: output tok/s (64 x 32 over the wall time from the first request sent to the
last token), the time until every request had its first token; per configuration the host
tier's counters from ``/metrics`` at the end (spilled blocks, the worker's seconds in spills).

    .venv/bin/python benchmarks/serving/burst_after_load.py \
        --json benchmarks/results/burst_after_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))
from server_process import free_port, start_server, stop_server, wait_healthy  # noqa: E402

CONFIGS = {
    "default": [],
    "swap": ["--preemption-mode", "swap"],
    "no-tier": ["--no-host-prefix-cache"],
}
BURST, PROMPT_LEN, MAX_TOKENS = 32, 128, 64
TIER_METRICS = ("host_prefix_cache_spills_total", "host_prefix_cache_hits_total")


async def _stream(client: Any, base: str, prompt: list[int], max_tokens: int, t0: float) -> float:
    """One streaming completion; seconds from ``t0`` to its first token."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    first = None
    async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:") and "[DONE]" not in line:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


async def burst(base: str, seed: int) -> dict[str, float]:
    """32 requests at once; output tok/s and when the last first token came (s)."""
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(BURST)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=BURST + 8)) as client:
        t0 = time.perf_counter()
        firsts = await asyncio.gather(*(_stream(client, base, p, MAX_TOKENS, t0) for p in prompts))
        wall = time.perf_counter() - t0
    return {"tok_s": round(BURST * MAX_TOKENS / wall, 1), "wall_s": round(wall, 2),
            "all_prefilled_s": round(max(firsts), 2)}  # fmt: skip


async def load(base: str, seed: int, requests: int = 128, in_flight: int = 64) -> float:
    """The load of unique prompts; its wall time (s)."""
    import httpx

    rng = random.Random(seed)
    specs = [([rng.randrange(100, 40000) for _ in range(rng.randrange(20, 900))],
              rng.randrange(10, 250)) for _ in range(requests)]  # fmt: skip
    sem = asyncio.Semaphore(in_flight)

    async def one(client: Any, prompt: list[int], max_tokens: int) -> None:
        async with sem:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            (await client.post(f"{base}/v1/completions", json=body, timeout=600)).raise_for_status()

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=in_flight + 8)) as client:
        await asyncio.gather(*(one(client, p, m) for p, m in specs))
    return round(time.perf_counter() - t0, 1)


def tier_counters(base: str) -> dict[str, float]:
    """The host tier's counters of ``/metrics``: blocks spilled, prompt tokens served from
    the tier, and the workers' seconds in spills."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if not line.startswith("pagedserve:host_prefix_cache_"):
            continue
        name = line.split("{")[0].split(" ")[0].removeprefix("pagedserve:")
        if name in TIER_METRICS:
            key = name
        elif name == "host_prefix_cache_seconds_total" and 'direction="spill"' in line:
            key = "spill_seconds"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_config(name: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Start the server with ``name``'s flags, bursts, load, bursts; its figures."""
    port, grpc_port = free_port(), free_port()
    cmd = [str(Path(sys.executable).with_name("pagedserve")), "serve", "--model", args.model,
           "--host", "127.0.0.1", "--http-port", str(port), "--port", str(grpc_port),
           "--kv-cache-memory", "1G", "--max-model-len", "2048", "--served-model-name",
           "smollm2", *CONFIGS[name], *shlex.split(args.pagedserve_args)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"flags": CONFIGS[name]}
    with tempfile.TemporaryDirectory() as cwd:
        proc = start_server(cmd, dict(os.environ), Path(cwd), Path(cwd) / "server.log")
        try:
            wait_healthy(proc, f"{base}/health", args.startup_timeout)
            asyncio.run(burst(base, seed - 1))  # warm-up
            out["fresh"] = [asyncio.run(burst(base, seed + i)) for i in range(args.bursts)]
            out["load_s"] = asyncio.run(load(base, seed + 100))
            out["after"] = [asyncio.run(burst(base, seed + 200 + i)) for i in range(args.bursts)]
            out["tier"] = tier_counters(base)
        finally:
            stop_server(proc)
    for phase in ("fresh", "after"):
        out[f"{phase}_median_tok_s"] = statistics.median(b["tok_s"] for b in out[phase])
    print(f"{name}: fresh {[b['tok_s'] for b in out['fresh']]} tok/s, after the load "
          f"{[b['tok_s'] for b in out['after']]} tok/s; load {out['load_s']} s; "
          f"tier {out['tier']}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--configs", default="default,swap,no-tier",
                    help=f"comma-separated, from {sorted(CONFIGS)}")  # fmt: skip
    ap.add_argument("--bursts", type=int, default=3, help="bursts before and after the load")
    ap.add_argument("--pagedserve-args", default="", help="more `serve` flags for every config")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    if bad := [c for c in names if c not in CONFIGS]:
        raise SystemExit(f"unknown configs {bad}; choose from {sorted(CONFIGS)}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    results = {n: run_config(n, args, args.seed) for n in names}
    print(
        "| config | fresh: median tok/s | after the load: median tok/s | after / fresh | "
        "blocks spilled | spill s (worker) |"
    )
    print("|---|---|---|---|---|---|")
    for n, r in results.items():
        print(f"| {n} | {r['fresh_median_tok_s']} | {r['after_median_tok_s']} | "
              f"{r['after_median_tok_s'] / r['fresh_median_tok_s']:.2f} | "
              f"{r['tier'].get('host_prefix_cache_spills_total', 0):.0f} | "
              f"{r['tier'].get('spill_seconds', 0):.2f} |")  # fmt: skip
    if args.json:
        payload = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
                   "command": " ".join(sys.argv), "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
