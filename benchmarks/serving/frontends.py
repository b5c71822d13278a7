"""Streamed tokens/s of one cluster through one frontend process and through two.

Starts ``pagedserve serve`` (embedded Ray, ``--workers`` CPU workers, a named cluster) as a
subprocess, then runs the same ``--requests`` greedy streaming requests (``--max-tokens``
each, ``--concurrency`` streams at a time) twice from two client processes: first both
clients against the first frontend, then, with a second frontend attached
(``pagedserve serve --attach``, another process), one client against each. The client
side is the same in both phases (two processes, the same streams), so the ratio measures
what the second frontend process adds. Greedy outputs of the two phases must be equal.

Prints one JSON document: tokens/s per phase, their ratio, and whether the outputs match.
The frontends are stopped with SIGINT (by their PIDs), the cluster last.

Usage::

    .venv/bin/python benchmarks/serving/frontends.py --model PATH --requests 64 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], ready: str, timeout_s: float) -> tuple[subprocess.Popen[str], str]:
    """Start ``cmd``; return it and its first stdout line matching the regex ``ready``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: list[str] = []
    got = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not got.is_set() and re.search(ready, line):
                found.append(line)
                got.set()
            if os.environ.get("FRONTENDS_VERBOSE"):
                sys.stderr.write(line)

    threading.Thread(target=pump, daemon=True).start()
    if not got.wait(timeout_s):
        proc.send_signal(signal.SIGINT)
        raise RuntimeError(f"{cmd[:3]} did not print {ready!r} within {timeout_s} s")
    return proc, found[0]


def stop(proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def client_main(address: str, ids: list[int], concurrency: int, max_tokens: int, out: Any) -> None:
    """Stream requests ``ids`` against ``address``; put ``{id: tokens}`` on ``out``."""
    from pagedserve.cluster.client import Client

    def one(i: int) -> tuple[int, list[int]]:
        with Client(address, timeout_s=600) as c:
            toks: list[int] = []
            for d in c.stream(
                f"Request {i}: tell me a story",
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
            ):
                toks.extend(d.token_ids)
            return i, toks

    with ThreadPoolExecutor(concurrency) as pool:
        out.put(dict(pool.map(one, ids)))


def phase(addresses: list[str], args: argparse.Namespace) -> tuple[float, dict[int, list[int]]]:
    """Two client processes, one per address (``addresses`` of length 2); returns
    (streamed tokens/s, tokens by request)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    halves = [list(range(args.requests))[k::2] for k in range(2)]
    procs = [
        ctx.Process(
            target=client_main,
            args=(addr, ids, max(1, args.concurrency // 2), args.max_tokens, out),
        )
        for addr, ids in zip(addresses, halves, strict=True)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    tokens: dict[int, list[int]] = {}
    for _ in procs:
        tokens.update(out.get(timeout=args.time_limit))
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return sum(len(t) for t in tokens.values()) / wall, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32, help="streams at a time, all clients")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--time-limit", type=float, default=600.0)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("pagedserve"))
    name = f"bench-{uuid.uuid4().hex[:8]}"
    p1, p2 = free_port(), free_port()
    common = [
        "--host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--cluster-name",
        name,
        "--max-num-seqs",
        "64",
    ]
    cluster, line = start(
        [
            exe,
            "serve",
            "--model",
            args.model,
            "--workers",
            str(args.workers),
            "--port",
            str(p1),
            "--device",
            "cpu",
            "--cpus-per-worker",
            "1",
            "--max-model-len",
            str(args.max_model_len),
            "--num-blocks",
            "1024",
            *common,
        ],
        r"serve --attach \S+",
        300,
    )
    ray_address = re.search(r"serve --attach (\S+)", line).group(1)  # type: ignore[union-attr]
    attached = None
    try:
        a = f"127.0.0.1:{p1}"
        phase([a, a], args)  # warm-up (not reported)
        one_tps, one_tokens = phase([a, a], args)
        attached, _ = start(
            [exe, "serve", "--attach", ray_address, "--port", str(p2), *common],
            r"serving on",
            300,
        )
        two_tps, two_tokens = phase([a, f"127.0.0.1:{p2}"], args)
    finally:
        if attached is not None:
            stop(attached)
        stop(cluster)
    print(
        json.dumps(
            {
                "requests": args.requests,
                "concurrency": args.concurrency,
                "max_tokens": args.max_tokens,
                "workers": args.workers,
                "one_frontend_tokens_per_s": round(one_tps, 1),
                "two_frontends_tokens_per_s": round(two_tps, 1),
                "ratio_two_over_one": round(two_tps / one_tps, 3),
                "outputs_equal": one_tokens == two_tokens,
            },
            indent=2,
        )
    )
    return 0 if one_tokens == two_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
