"""Prefill/decode disaggregation: a mixed workload with and without it, and the threshold.

Mixed workload (default): short chat turns (``--short-tokens`` prompt tokens,
``--short-max-tokens`` greedy output tokens) with a long document prompt
(``--long-tokens``, ``--long-max-tokens``) every ``--long-every``-th request, Poisson
arrivals at ``--rate`` requests/s (one seeded schedule for every run). Two clusters of
``--workers`` CPU workers are started one after the other (embedded Ray, SmolLM2 fp32
with ``batch_invariant``, ``--preemption-mode recompute`` so that every KV byte moved is a
handoff): without disaggregation, and with ``prefill_workers=1`` (worker 0 prefills the
long prompts, the others decode). Printed per run and written as JSON, for the short
requests: TTFT p50/p99 and ITL p99 (client side, between streamed tokens), TPOT p99 (a
request's decode time over its tokens after the first); for the long ones TTFT p50; the
handoffs' bytes moved (GetStats swap counters) and whether greedy outputs are equal.

``--calibrate``: the threshold's measurement, in process (no Ray): one prefill worker and
one decode worker sharing a host block store on loopback; for each prompt length, the
step time of a decode worker that prefills the prompt itself next to one decoding
sequence (what disaggregation takes off it) against its step that instead swaps the
prompt's blocks in (what it adds), and a plain decode step.

Usage::

    .venv/bin/python benchmarks/serving/disagg_mixed.py --calibrate
    .venv/bin/python benchmarks/serving/disagg_mixed.py --requests 40 --rate 2 \\
        --json benchmarks/results/disagg_mixed.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
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


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic ordinary vocabulary ids."""
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n)]


def workload(args: argparse.Namespace) -> list[tuple[float, bool, list[int], int]]:
    """(arrival offset s, long?, prompt, max_tokens) per request, Poisson arrivals."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        long = i % args.long_every == args.long_every - 1
        if long:
            out.append((t, True, _tokens(i, args.long_tokens), args.long_max_tokens))
        else:
            n = rng.randint(args.short_tokens, max(args.short_tokens, args.short_tokens_max))
            out.append((t, False, _tokens(i, n), args.short_max_tokens))
    return out


def run_once(
    args: argparse.Namespace, model_dir: str, prefill_workers: int, threshold: int
) -> dict[str, Any]:
    """Start a cluster, play the workload, stop it; the run's figures."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(
            model=model_dir, dtype="float32", max_model_len=args.max_model_len, batch_invariant=True
        ),
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(
            preemption_mode="recompute", max_num_batched_tokens=args.budget, host_prefix_cache=False
        ),
        server=ServerConfig(host="127.0.0.1", port=0, http_port=None),
        num_workers=args.workers,
        cpus_per_worker=args.cpus_per_worker,
        device="cpu",
        swap_space=1 << 30,
        prefill_workers=prefill_workers,
        disagg_min_prompt_tokens=threshold,
    )
    loop = asyncio.new_event_loop()  # the cluster's handle lives on its own loop thread
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    handle = on_loop(start_cluster(config))
    reqs = workload(args)
    results: list[dict[str, Any]] = [{} for _ in reqs]

    def one(i: int, t0: float) -> None:
        at, long, prompt, max_tokens = reqs[i]
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        start = time.perf_counter()
        stamps: list[float] = []
        toks: list[int] = []
        with Client(handle.address, timeout_s=3600) as client:
            for d in client.stream(
                token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ):
                if d.token_ids:
                    stamps.extend([time.perf_counter()] * len(d.token_ids))
                    toks.extend(d.token_ids)
        itl = [b - a for a, b in itertools.pairwise(stamps)]
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
        results[i] = {"long": long, "ttft": stamps[0] - start, "itl": itl, "tpot": tpot}
        results[i]["tokens"] = toks

    try:
        with Client(handle.address, timeout_s=60) as client:  # warm both workers up
            for k in range(args.workers):
                client.generate(token_ids=_tokens(10_000 + k, 8), max_tokens=2)
            before = client.stats()["swap"]
        wall = time.perf_counter()
        with ThreadPoolExecutor(len(reqs)) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: one(i, t0), range(len(reqs))))
        wall = time.perf_counter() - wall
        with Client(handle.address, timeout_s=60) as client:
            stats = client.stats()
    finally:
        on_loop(handle.stop(), timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
    short = [r for r in results if not r["long"]]
    long = [r for r in results if r["long"]]
    sw = stats["swap"]
    return {
        "prefill_workers": prefill_workers,
        "threshold": threshold if prefill_workers else None,
        "wall_s": wall,
        "short_ttft_p50_s": statistics.median(r["ttft"] for r in short),
        "short_ttft_p99_s": _percentile([r["ttft"] for r in short], 0.99),
        "short_itl_p99_s": _percentile([x for r in short for x in r["itl"]], 0.99),
        "short_tpot_p99_s": _percentile([r["tpot"] for r in short], 0.99),
        "long_ttft_p50_s": statistics.median(r["ttft"] for r in long) if long else 0.0,
        "handoffs": sw["num_swap_outs"] - before["num_swap_outs"],
        "bytes_moved": sw["swap_out_bytes"] - before["swap_out_bytes"],
        "num_preemptions": stats["num_preemptions"],
        "outputs": [r["tokens"] for r in results],
    }


def calibrate(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """Decode-worker step times per prompt length (see the module docstring)."""
    from pagedserve.scheduler.config import SchedulerConfig as SC
    from pagedserve.scheduler.disagg import DisaggConfig
    from pagedserve.scheduler.engine_messages import EngineRequest
    from pagedserve.scheduler.sampling_params import SamplingParams
    from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
    from pagedserve.scheduler.swap import SwapSpec
    from pagedserve.worker.config import CacheConfig as WC
    from pagedserve.worker.config import ModelConfig as WM
    from pagedserve.worker.config import WorkerConfig
    from pagedserve.worker.host_store import serve_host_store
    from pagedserve.worker.worker import Worker

    server, port, _ = serve_host_store(1 << 30)
    workers = []
    for wid in (0, 1):
        w = Worker(
            WorkerConfig(
                worker_id=wid,
                model=WM(model=model_dir, dtype="float32", max_model_len=args.max_model_len),
                cache=WC(block_size=16, num_blocks=args.num_blocks),
                device="cpu",
                num_threads=args.cpus_per_worker or 1,
                adaptive_threads=False,
            )
        )
        w.connect_host_store(f"127.0.0.1:{port}")
        workers.append(w)
    info = workers[0].get_info()

    def sched(disagg: bool) -> Scheduler:
        return Scheduler(
            SC(
                max_num_batched_tokens=4096,
                max_model_len=info.max_model_len,
                preemption_mode="recompute",
                host_prefix_cache=False,
                enable_prefix_caching=False,
                async_scheduling=False,
            ),
            [WorkerSpec(i, info.num_blocks, 16) for i in (0, 1)],
            SwapSpec(4096, info.block_bytes, 1e9, 1e-3),
            DisaggConfig(frozenset({0}), 1 if disagg else 1 << 30),
        )

    def steps(s: Scheduler) -> list[tuple[int, float, Any]]:
        out = []
        while any(s.has_work(w) for w in (0, 1)):
            for wid in (0, 1):
                if not s.has_work(wid):
                    continue
                so = s.schedule(wid).output
                t = time.perf_counter()
                ro = workers[wid].execute_model(so)
                out.append((wid, time.perf_counter() - t, so))
                s.update(wid, so, ro)
        return out

    rows = []
    for n in args.calibrate_lengths:
        row: dict[str, Any] = {"prompt_tokens": n}
        for disagg in (False, True):
            times: dict[str, list[float]] = {"with": [], "decode": []}
            for rep in range(args.calibrate_repeats):
                s = sched(disagg)
                # one short sequence decoding on the decode worker, then the prompt arrives
                s.add_request(EngineRequest(f"d{rep}", _tokens(rep, 8), SamplingParams(
                    max_tokens=6, temperature=0.0, ignore_eos=True)))  # fmt: skip
                s.add_request(EngineRequest(f"p{rep}", _tokens(100 + rep, n), SamplingParams(
                    max_tokens=3, temperature=0.0, ignore_eos=True)))  # fmt: skip
                for wid, dt, so in steps(s):
                    if wid != 1:
                        continue
                    plan = so.swap_plan
                    moves = plan is not None and bool(plan.blocks_to_swap_in)
                    prefills = any(v > 1 for v in so.num_scheduled_tokens.values())
                    key = "with" if (moves if disagg else prefills) else "decode"
                    times[key].append(dt)
            name = "swap_in" if disagg else "prefill"
            row[f"{name}_step_s"] = statistics.median(times["with"])
            row[f"decode_step_s_{name}_run"] = statistics.median(times["decode"])
        row["bytes"] = -(-n // 16) * info.block_bytes
        rows.append(row)
        print(
            f"{n:>6} tokens: decode worker step prefilling it {row['prefill_step_s'] * 1e3:8.1f} ms,"
            f" swapping it in {row['swap_in_step_s'] * 1e3:7.1f} ms, plain decode "
            f"{row['decode_step_s_prefill_run'] * 1e3:6.1f} ms, {row['bytes'] / 1e6:6.2f} MB"
        )
    server.stop(0)
    # NOTE: the rule behind DEFAULT_MIN_PROMPT_TOKENS: the shortest prompt whose move
    # saves the decode worker at least two plain decode steps.
    suggested = next(
        (
            r["prompt_tokens"]
            for r in rows
            if r["prefill_step_s"] - r["swap_in_step_s"] >= 2 * r["decode_step_s_prefill_run"]
        ),
        None,
    )
    print(f"shortest prompt saving >= 2 decode steps: {suggested}")
    return {"rows": rows, "block_bytes": info.block_bytes, "suggested_threshold": suggested}


KEYS = ("short_ttft_p50_s", "short_ttft_p99_s", "short_itl_p99_s", "short_tpot_p99_s",
        "long_ttft_p50_s")  # fmt: skip


def report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Print one line per run; the runs and whether their greedy outputs are equal."""
    equal = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    print("prefill_workers threshold " + " ".join(f"{k:>17}" for k in KEYS) + " handoffs MB moved")
    for r in runs:
        print(
            f"{r['prefill_workers']:>15} {r['threshold'] or '-':>9} "
            + " ".join(f"{r[k]:>17.3f}" for k in KEYS)
            + f" {r['handoffs']:>8} {r['bytes_moved'] / 1e6:8.2f}"
        )
    print(f"greedy outputs equal: {equal}")
    return {"runs": runs, "equal": equal}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s")
    p.add_argument("--long-every", type=int, default=8)
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument(
        "--short-tokens-max", type=int, default=0, help="chat prompts uniform in [short, max]"
    )
    p.add_argument("--short-max-tokens", type=int, default=24)
    p.add_argument("--long-tokens", type=int, default=768)
    p.add_argument("--long-max-tokens", type=int, default=8)
    p.add_argument("--threshold", type=int, default=256, help="disagg_min_prompt_tokens")
    p.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=None,
        help="one run without disaggregation, then one per threshold given",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--num-blocks", type=int, default=256, help="device blocks of 16 tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="pairs, in alternating order")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--calibrate-lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--calibrate-repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    model_dir = str(resolve_model(args.model, progress=True))
    if args.calibrate:
        result: dict[str, Any] = {"args": vars(args), **calibrate(args, model_dir)}
    elif args.sweep:
        runs = [run_once(args, model_dir, 0, 0)]
        runs += [run_once(args, model_dir, 1, t) for t in args.sweep]
        result = report(runs)
    else:
        runs = []
        for i in range(args.repeats):  # off, on, on, off, ...: drift on a shared machine cancels
            order = (0, 1) if i % 2 == 0 else (1, 0)
            runs += [run_once(args, model_dir, pw, args.threshold) for pw in order]
        result = report(runs)
        med = {
            pw: {
                k: statistics.median(r[k] for r in runs if r["prefill_workers"] == pw) for k in KEYS
            }
            for pw in (0, 1)
        }
        ratio = {k: med[1][k] / med[0][k] for k in KEYS if med[0][k]}
        print("median disagg / not: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
        result |= {"median": med, "ratio": ratio}
    result["args"] = vars(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
