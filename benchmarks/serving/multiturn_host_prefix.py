"""Multi-turn chat with and without the host tier of the prefix cache, through the server.

Each of ``--conversations`` conversations sends ``--turns`` requests one after another;
each turn resends the whole conversation so far (a system prompt, the previous turns and
answers) plus a new user turn of ``--turn-tokens`` tokens. The conversations run side by
side, more of them than the device pool (``--num-blocks`` of 16 tokens per worker) keeps,
so without the tier a returning conversation mostly recomputes its evicted prefix; with it
(the default whenever a host store runs) the prefix comes back from the node's host store
when the cost model says loading beats recomputing.

Two clusters are started one after the other (embedded Ray, SmolLM2 by default,
``--swap-space`` GiB of host store, fp32, ``batch_invariant`` so greedy outputs do not
depend on the batch): ``--no-host-prefix-cache`` and the default. Printed per run and
written as JSON: prompt tokens computed (prompt tokens minus those served from either
cache tier, from each response's ``usage.cached_tokens``), TTFT p50/p99 (client side,
first streamed token), output tokens/s over the run's wall time, the tier's counters
(GetStats) and whether greedy outputs are equal.

Usage::

    .venv/bin/python benchmarks/serving/multiturn_host_prefix.py
    .venv/bin/python benchmarks/serving/multiturn_host_prefix.py --conversations 6 --turns 3 \\
        --json benchmarks/results/multiturn_host_prefix.json
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
from pagedserve.worker.model_store import resolve_model


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else 0.0


def _user_turn(conv: int, turn: int, n: int) -> list[int]:
    """A deterministic user turn of ``n`` token ids (ordinary vocabulary ids)."""
    return [1000 + (conv * 7919 + turn * 104729 + i * 31) % 20000 for i in range(n)]


def run_once(args: argparse.Namespace, model_dir: str, tier: bool) -> dict[str, Any]:
    """Start a cluster, play the workload, stop it; the run's figures."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(
            model=model_dir, dtype="float32", max_model_len=args.max_model_len, batch_invariant=True
        ),
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(
            preemption_mode=args.preemption_mode,
            max_num_batched_tokens=512,
            host_prefix_cache=tier,
        ),
        server=ServerConfig(host="127.0.0.1", port=0, http_port=None),
        num_workers=1,
        cpus_per_worker=0,
        device="cpu",
        swap_space=int(args.swap_space * (1 << 30)),
    )
    loop = asyncio.new_event_loop()  # the cluster's handle lives on its own loop thread
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    handle = on_loop(start_cluster(config))
    ttfts: list[float] = []
    outputs: dict[tuple[int, int], list[int]] = {}
    computed = 0
    prompt_tokens = 0
    lock = threading.Lock()
    system = _user_turn(999, 0, args.system_tokens)

    def conversation(c: int) -> int:
        nonlocal computed, prompt_tokens
        history = list(system)
        out_tokens = 0
        with Client(handle.address, timeout_s=3600) as client:
            for t in range(args.turns):
                history += _user_turn(c, t, args.turn_tokens)
                start = time.perf_counter()
                first = None
                toks: list[int] = []
                usage: dict[str, int] | None = None
                for d in client.stream(
                    token_ids=history, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
                ):
                    if first is None and d.token_ids:
                        first = time.perf_counter() - start
                    toks.extend(d.token_ids)
                    usage = d.usage or usage
                assert usage is not None and first is not None
                with lock:
                    ttfts.append(first)
                    outputs[(c, t)] = toks
                    prompt_tokens += usage["prompt_tokens"]
                    computed += usage["prompt_tokens"] - usage["cached_tokens"]
                out_tokens += len(toks)
                history += toks
        return out_tokens

    try:
        wall = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            total_out = sum(pool.map(conversation, range(args.conversations)))
        wall = time.perf_counter() - wall
        with Client(handle.address, timeout_s=60) as client:
            stats = client.stats()
    finally:
        on_loop(handle.stop(), timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
    return {
        "host_prefix_cache": tier,
        "requests": len(ttfts),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": computed,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "output_tokens_per_s": total_out / wall,
        "wall_s": wall,
        "host_prefix": stats["swap"]["host_prefix"],
        "num_preemptions": stats["num_preemptions"],
        "outputs": {f"{c}/{t}": v for (c, t), v in sorted(outputs.items())},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--turn-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=40, help="device blocks of 16 tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of host store")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "swap"])
    p.add_argument("--repeats", type=int, default=1, help="pairs, in alternating order")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    model_dir = str(resolve_model(args.model, progress=True))
    runs = []
    for i in range(args.repeats):  # off, on, on, off, ...: drift on a shared machine cancels
        order = (False, True) if i % 2 == 0 else (True, False)
        runs += [run_once(args, model_dir, tier) for tier in order]
    equal = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    print(f"{'tier':>5} {'prompt tok':>10} {'computed':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'tok/s':>7} {'host hits (tok)':>15} {'spills':>7} {'spill s':>7} {'loads':>6} "
          f"{'load s':>7}")  # fmt: skip
    for r in runs:
        hp = r["host_prefix"]
        print(
            f"{'on' if r['host_prefix_cache'] else 'off':>5} {r['prompt_tokens']:>10} "
            f"{r['prompt_tokens_computed']:>9} {r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>9.3f} "
            f"{r['output_tokens_per_s']:>7.2f} {hp['num_hit_tokens']:>15} {hp['num_spills']:>7} "
            f"{hp['spill_seconds']:>7.3f} {hp['num_loads']:>6} {hp['load_seconds']:>7.3f}"
        )
    med = {}
    for tier in (False, True):
        mine = [r for r in runs if r["host_prefix_cache"] is tier]
        med[tier] = {
            k: statistics.median(r[k] for r in mine)
            for k in ("prompt_tokens_computed", "ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")
        }
    ratio = {k: med[True][k] / med[False][k] for k in med[True] if med[False][k]}
    print("median on / off: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    print(f"greedy outputs equal: {equal}")
    result = {
        "args": vars(args),
        "runs": runs,
        "median": {"off": med[False], "on": med[True]},
        "ratio_on_off": ratio,
        "greedy_equal": equal,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
