"""TPOT through the server, with and without speculative decoding (n-gram, draft models), batch 1.

Starts the real cluster in this process (embedded Ray, one CPU worker, the gRPC frontend)
once plain, once with ``--speculative-method ngram`` and once per ``--draft NAME=PATH``
with ``--speculative-method draft --draft-model PATH``, in alternation (``--rounds``
times), and streams the repetitive prompts of ``engine/speculative.py`` one at a time
through the gRPC client, greedy. Per request: TPOT = (last token's arrival - first
token's) / (tokens - 1), on the client's clock; the fastest round of each configuration
is kept per prompt (this machine's load only adds time). Prints a table and writes
``results/speculative_serving.json``.

Usage::

    .venv/bin/python benchmarks/serving/speculative_serving.py --rounds 3
    .venv/bin/python benchmarks/common/layer_draft.py --layers 4 --out /tmp/smollm2-4l
    .venv/bin/python benchmarks/serving/speculative_serving.py --max-tokens 64 \
        --draft self=default --draft cut4=/tmp/smollm2-4l \
        --out benchmarks/results/speculative_serving_draft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pagedserve.cluster.launcher import RAY_ENV, start_cluster
from pagedserve.scheduler.config import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from speculative import REPETITIVE

RESULTS = Path(__file__).resolve().parents[1] / "results"


def serve_and_measure(
    spec: SpeculativeConfig | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Start a cluster, stream every prompt once (after a warm-up), stop it."""
    config = ClusterConfig(
        model=ModelConfig(model=args.model, max_model_len=1024),
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(speculative_config=spec),
        server=ServerConfig(host="127.0.0.1", port=0, http_port=None),
        num_workers=1,
        cpus_per_worker=args.threads,
        device="cpu",
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    handle = asyncio.run_coroutine_threadsafe(start_cluster(config), loop).result(600)
    rows = []
    try:
        with Client(handle.address, timeout_s=600) as client:
            client.generate(chat=[{"role": "user", "content": "Hi"}], max_tokens=8)
            for prompt in REPETITIVE:
                chat = [{"role": "user", "content": prompt}]
                times: list[float] = []
                tokens: list[int] = []
                for d in client.stream(chat=chat, max_tokens=args.max_tokens, temperature=0.0):
                    if d.token_ids:
                        times.append(time.perf_counter())
                        tokens.extend(d.token_ids)
                n = len(tokens)
                rows.append(
                    {
                        "tokens": n,
                        "tpot_ms": 1e3 * (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0,
                        "token_ids": tokens,
                    }
                )
            rows.append({"stats": client.stats()["spec_decode"]})
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--draft",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also measure --speculative-method draft with this draft model (repeatable)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative_serving.json")
    args = ap.parse_args()
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    configs: dict[str, SpeculativeConfig | None] = {
        "plain": None,
        "ngram": SpeculativeConfig("ngram", args.k, 1, 3),
    }
    for item in args.draft:
        name, _, path = item.partition("=")
        configs[f"draft:{name}"] = SpeculativeConfig("draft", args.k, draft_model=path)
    best: dict[str, list[dict[str, Any]]] = {}
    stats: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name, spec in configs.items():
            *rows, st = serve_and_measure(spec, args)
            stats[name] = st["stats"]
            if name not in best:
                best[name] = rows
            else:
                best[name] = [
                    min(a, b, key=lambda r: r["tpot_ms"]) for a, b in zip(best[name], rows)
                ]
    out = []
    for i, p in enumerate(best["plain"]):
        row: dict[str, Any] = {"prompt": i, "tokens": p["tokens"], "tpot_ms_plain": p["tpot_ms"]}
        line = f"prompt {i}: {p['tokens']} tokens, TPOT plain {p['tpot_ms']:.1f} ms"
        for name in list(configs)[1:]:
            s = best[name][i]
            row[f"tpot_ms_{name}"] = s["tpot_ms"]
            row[f"tpot_speedup_{name}"] = p["tpot_ms"] / s["tpot_ms"]
            row[f"same_tokens_{name}"] = p["token_ids"] == s["token_ids"]
            line += (
                f", {name} {s['tpot_ms']:.1f} ms ({p['tpot_ms'] / s['tpot_ms']:.2f}x, "
                f"same tokens {p['token_ids'] == s['token_ids']})"
            )
        out.append(row)
        print(line, flush=True)
    for name in list(configs)[1:]:
        print(f"{name} counters (last round): {stats[name]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "rows": out,
                "spec_decode": {name: stats[name] for name in list(configs)[1:]},
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
