"""Throughput under KV-memory pressure, through the real server (``pagedserve serve``).

The workload a new user tried (seeded): ``--num-requests`` requests (default 256) with
prompts of 10..200 random token ids and 4..64 output tokens (greedy, ``ignore_eos``, so the
lengths are the drawn ones), 30% cancelled by the client after a random number of their
tokens, ``--concurrency`` in flight (default 64; a closed loop: a client thread sends its
next request when the previous one ends), against ``serve --num-blocks 96 --block-size 16
--max-model-len 512`` (one worker). Per run it reports output tokens/s (tokens the clients
received / wall time), TTFT p50/p99 (client side), the server's preemptions and recomputed
tokens (GetStats, before/after), and checks that nothing leaked (every request ended,
every block free, nothing running or waiting afterwards).

``--reference`` also runs the same workload at the concurrency the pool holds without
preemption (``num_blocks // ceil((200 + 64) / block_size)``, 5 by default) and reports the
ratio (goal: >= 0.7). ``--co-load`` runs a seeded busy process pinned to one core during
the run(s) (the shared-machine case; goal: within 2.5x of the idle run's wall time).
Server flags after ``--`` are passed to ``pagedserve serve`` (e.g. ``-- --admission
fits-now`` for the previous behaviour). Writes ``benchmarks/results/pressure.json`` (or
``--out``).

Usage::

    .venv/bin/python benchmarks/memory/pressure.py --reference            # the issue's workload
    .venv/bin/python benchmarks/memory/pressure.py --reference --co-load  # with a busy core
    .venv/bin/python benchmarks/memory/pressure.py --num-requests 64 --concurrency 16  # quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pagedserve.cluster.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads.py
from workloads import busy_core

RESULTS = Path(__file__).resolve().parents[1] / "results"
MAX_PROMPT = 200
MAX_OUTPUT = 64


def make_workload(n: int, seed: int, cancel_share: float) -> list[dict[str, Any]]:
    """``n`` requests: prompt ids, max_tokens, and the token count after which the client
    cancels (None = reads to the end)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt_len = rng.randint(10, MAX_PROMPT)
        max_tokens = rng.randint(4, MAX_OUTPUT)
        cancel_after = rng.randint(1, max_tokens - 1) if rng.random() < cancel_share else None
        reqs.append(
            {
                "id": f"p{i}",
                "prompt_ids": [rng.randint(100, 40000) for _ in range(prompt_len)],
                "max_tokens": max_tokens,
                "cancel_after": cancel_after,
            }
        )
    return reqs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(args: argparse.Namespace, extra: list[str]) -> Iterator[str]:
    """``pagedserve serve`` in a subprocess; yields its gRPC address once it answers.

    ``args.num_blocks`` ``None`` leaves the pool size to ``extra`` (``--kv-cache-memory``).
    """
    port, http_port = free_port(), free_port()
    cmd = [
        str(Path(sys.executable).parent / "pagedserve"),
        "serve",
        "--port", str(port),
        "--http-port", str(http_port),
        *(["--num-blocks", str(args.num_blocks)] if args.num_blocks is not None else []),
        "--block-size", str(args.block_size),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        *extra,
    ]  # fmt: skip
    log = open(args.server_log, "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: see {args.server_log}")
            try:
                with Client(address, timeout_s=5) as c:
                    c.stats()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        yield address
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_workload(address: str, reqs: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Send ``reqs`` with ``concurrency`` client threads; return the client-side figures."""
    lock = threading.Lock()
    queue = list(reversed(reqs))
    recs: list[dict[str, Any]] = []

    def client_loop() -> None:
        with Client(address, timeout_s=3600) as c:
            while True:
                with lock:
                    if not queue:
                        return
                    req = queue.pop()
                rec: dict[str, Any] = {"tokens": 0, "ttft": None, "finish": None}
                t0 = time.perf_counter()
                stream = c.stream(
                    token_ids=req["prompt_ids"],
                    max_tokens=req["max_tokens"],
                    temperature=0,
                    ignore_eos=True,
                )
                for d in stream:
                    if d.token_ids and rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
                    rec["tokens"] += len(d.token_ids)
                    if d.finish_reason is not None:
                        rec["finish"] = d.finish_reason
                    if req["cancel_after"] is not None and rec["tokens"] >= req["cancel_after"]:
                        rec["finish"] = "cancelled"
                        break
                stream.close()  # cancels the call when the client stopped reading
                with lock:
                    recs.append(rec)

    with Client(address, timeout_s=30) as c:
        before = c.stats()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(client_loop) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    # The server frees a cancelled request's blocks when it sees the cancel: wait for it.
    deadline = time.monotonic() + 60
    with Client(address, timeout_s=30) as c:
        while True:
            after = c.stats()
            idle = after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
            free = all(w["num_free_blocks"] == w["num_blocks"] for w in after["workers"])
            if (idle and free) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    tokens = sum(r["tokens"] for r in recs)
    ttfts = [r["ttft"] for r in recs if r["ttft"] is not None]
    return {
        "concurrency": concurrency,
        "num_requests": len(reqs),
        "completed": len(recs),
        "cancelled": sum(1 for r in recs if r["finish"] == "cancelled"),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "recomputed_tokens": after["num_recomputed_tokens"] - before["num_recomputed_tokens"],
        "leak_free": idle and free,
        "load_avg_after": os.getloadavg(),
    }


def main() -> None:
    # A SIGTERM (e.g. from `timeout`) must still stop the server subprocess.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--reference", action="store_true", help="also run at the no-preemption concurrency"
    )
    ap.add_argument(
        "--co-load", action="store_true", help="a busy process on one core during the runs"
    )
    ap.add_argument("--co-load-core", type=int, default=0)
    ap.add_argument("--server-log", default="/tmp/pagedserve-pressure-server.log")
    ap.add_argument("--out", default=str(RESULTS / "pressure.json"))
    args = ap.parse_args(argv)

    reqs = make_workload(args.num_requests, args.seed, args.cancel_share)
    per_req = -(-(MAX_PROMPT + MAX_OUTPUT) // args.block_size)
    ref_conc = max(1, args.num_blocks // per_req)
    result: dict[str, Any] = {
        "args": vars(args),
        "server_flags": extra,
        "load_avg_before": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    stop = mp.Event()
    hog = None
    if args.co_load:
        hog = mp.Process(target=busy_core, args=(args.co_load_core, args.seed, stop), daemon=True)
        hog.start()
    try:
        with server(args, extra) as address:
            # Warm-up (model load, first-step compilation) outside the measured runs.
            with Client(address, timeout_s=600) as c:
                c.generate(token_ids=reqs[0]["prompt_ids"][:16], max_tokens=4, temperature=0)
            result["pressure"] = run_workload(address, reqs, args.concurrency)
            print(json.dumps({"pressure": result["pressure"]}, indent=1), flush=True)
            if args.reference:
                result["reference"] = run_workload(address, reqs, ref_conc)
                print(json.dumps({"reference": result["reference"]}, indent=1), flush=True)
                result["throughput_ratio"] = (
                    result["pressure"]["output_tokens_per_s"]
                    / result["reference"]["output_tokens_per_s"]
                )
    finally:
        stop.set()
        if hog is not None:
            hog.join(timeout=10)
    result["load_avg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if "throughput_ratio" in result:
        print(f"throughput ratio (pressure / reference): {result['throughput_ratio']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
