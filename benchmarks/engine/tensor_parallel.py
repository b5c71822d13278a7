"""Tensor parallelism on this machine: output tok/s through the real server at T ranks,
and each rank's weight bytes.

For each ``--sizes`` T: an embedded cluster with one worker of T ranks (``cpus_per_worker``
CPUs each), ``--batch`` greedy requests of ``--max-tokens`` (``ignore_eos``) submitted at
once after one warm-up request; output tok/s = generated tokens / wall time of the batch.
Each rank's weight bytes are the bytes its :class:`ShardPlan` reads from the checkpoint
(what it holds). On a machine with fewer cores than ranks, T > 1 is not faster: every step
adds 2 all-reduces per layer and a gather over gloo, and the ranks share the cores.

Usage::

    .venv/bin/python benchmarks/engine/tensor_parallel.py --sizes 1 3 --batch 4

Prints a table; writes ``benchmarks/results/tensor_parallel.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    ServerConfig,
)
from pagedserve.cluster.launcher import RAY_ENV, start_cluster
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.sharding import ShardPlan

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def rank_weight_bytes(model_dir: Path, size: int) -> list[int]:
    """Bytes of the checkpoint each of ``size`` ranks reads (fp32 on this machine)."""
    from safetensors import safe_open

    arch = ModelArch.from_pretrained(model_dir)
    out = []
    for rank in range(size):
        plan = ShardPlan(arch, rank, size)
        total = 0
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                name = k.removeprefix("model.")
                if name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                total += 4 * plan.read(f, k, name).numel()
        out.append(total)
    return out


def run_size(model: str, size: int, batch: int, max_tokens: int, cpus: int) -> dict[str, Any]:
    config = ClusterConfig(
        model=ModelConfig(model=model, max_model_len=1024, dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=256),
        server=ServerConfig(host="127.0.0.1", port=0, http_port=None),
        tensor_parallel_size=size,
        cpus_per_worker=cpus,
        device="cpu",
    )
    # The frontend serves on this loop: it runs on a thread of its own.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    handle = asyncio.run_coroutine_threadsafe(start_cluster(config), loop).result(600)
    kw = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def one(_: int) -> int:
        with Client(handle.address, timeout_s=900) as c:
            return len(
                c.generate(chat=[{"role": "user", "content": PROMPT}], **kw).choices[0].token_ids
            )

    try:
        one(0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(batch) as pool:
            tokens = sum(pool.map(one, range(batch)))
        wall = time.perf_counter() - t0
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return {"tensor_parallel_size": size, "tokens": tokens, "wall_s": wall,
            "tok_per_s": tokens / wall}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    args = p.parse_args()
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    model_dir = resolve_model(args.model, progress=False)
    rows = []
    for size in args.sizes:
        row = run_size(args.model, size, args.batch, args.max_tokens, args.cpus_per_worker)
        row["rank_weight_bytes"] = rank_weight_bytes(model_dir, size)
        rows.append(row)
    base = rows[0]["tok_per_s"]
    print(f"{'T':>3} {'tok/s':>8} {'vs first':>9}  weight MB per rank")
    for r in rows:
        mb = ", ".join(f"{b / 1e6:.1f}" for b in r["rank_weight_bytes"])
        print(f"{r['tensor_parallel_size']:>3} {r['tok_per_s']:>8.2f} "
              f"{r['tok_per_s'] / base:>9.2f}  {mb}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
