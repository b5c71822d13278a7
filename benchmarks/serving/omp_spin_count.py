"""Serving with CPU workers' ``GOMP_SPINCOUNT`` (``--omp-spin-count``): libgomp's default
against short spins.

For each round and each setting (``--settings``, alternating; ``-1`` is libgomp's default
300,000, the environment's setting left alone) it starts ``pagedserve serve`` (SmolLM2, 1
GiB of KV, its defaults otherwise), checks the worker process's ``GOMP_SPINCOUNT``, sends a
warm-up burst, then ``--bursts`` bursts of ``--concurrency`` streaming completions of 128
random token ids -> ``--max-tokens`` greedy tokens (``ignore_eos``; every burst its own
prompts). Per burst: output tok/s and the decode step time the client saw (as in
``step_transport.py``, whose client this uses).

    .venv/bin/python benchmarks/serving/omp_spin_count.py --rounds 2 \\
        --json benchmarks/results/omp_spin_count.json
    .venv/bin/python benchmarks/serving/omp_spin_count.py --concurrency 1 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
sys.path.insert(0, str(HERE))
import step_transport  # noqa: E402
from server_process import free_port, start_server, stop_server, wait_healthy  # noqa: E402


def worker_spin_count(pid: int) -> str | None:
    """``GOMP_SPINCOUNT`` in the environment of process ``pid`` (None: unset)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"GOMP_SPINCOUNT="):
            return entry.split(b"=", 1)[1].decode()
    return None


def run_server(setting: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Start the server with ``--omp-spin-count setting``, warm up, the bursts."""
    port, grpc_port = free_port(), free_port()
    cmd = [str(Path(sys.executable).with_name("pagedserve")), "serve", "--model", args.model,
           "--host", "127.0.0.1", "--http-port", str(port), "--port", str(grpc_port),
           "--kv-cache-memory", "1G", "--max-model-len", "2048", "--served-model-name",
           "smollm2", "--omp-spin-count", setting]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as cwd:
        proc = start_server(cmd, dict(os.environ), Path(cwd), Path(cwd) / "server.log")
        try:
            wait_healthy(proc, f"{base}/health", args.startup_timeout)
            pid = step_transport.find_actor("ray::Worker")
            env = None if pid is None else worker_spin_count(pid)
            asyncio.run(step_transport.burst(base, seed - 1, args.max_tokens))  # warm-up
            bursts = [
                asyncio.run(step_transport.burst(base, seed + i, args.max_tokens))
                for i in range(args.bursts)
            ]
        finally:
            stop_server(proc)
    print(f"--omp-spin-count {setting} (worker GOMP_SPINCOUNT={env}): "
          f"{[b['tok_s'] for b in bursts]} tok/s, decode "
          f"{[b['decode_step_ms'] for b in bursts]} ms/step", flush=True)  # fmt: skip
    return {"worker_gomp_spincount": env, "bursts": bursts}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--settings", default="-1,1000", help="--omp-spin-count values")
    ap.add_argument("--rounds", type=int, default=2, help="servers per setting, alternating")
    ap.add_argument("--bursts", type=int, default=3, help="bursts per server")
    ap.add_argument("--concurrency", type=int, default=32, help="requests per burst")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=7000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    step_transport.BURST = args.concurrency
    settings = [s for s in args.settings.split(",") if s]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for i, s in enumerate(settings):
            runs[s].append(run_server(s, args, args.seed + 1000 * r + 100 * i))
    print("| --omp-spin-count | output tok/s, median of bursts | decode ms/step, median |")
    print("|---|---|---|")
    summary = {}
    for s, rs in runs.items():
        bursts = [b for x in rs for b in x["bursts"]]
        summary[s] = {"tok_s": statistics.median(b["tok_s"] for b in bursts),
                      "decode_step_ms": statistics.median(b["decode_step_ms"] for b in bursts)}  # fmt: skip
        print(f"| {s} | {summary[s]['tok_s']:.1f} | {summary[s]['decode_step_ms']:.2f} |")
    if args.json:
        payload = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
                   "command": " ".join(sys.argv), "summary": summary, "runs": runs}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
