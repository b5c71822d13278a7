"""How the scheduler's steps reach the worker (the step channel against a Ray call per
step), or how its outputs reach the frontend (the output channel against a Ray streaming
generator): ``--compare step`` (the default) or ``--compare output``.

For each round and each transport (``--step-transport socket`` and ``ray``, alternating;
``--output-transport`` with ``--compare output``) it starts ``pagedserve serve`` (SmolLM2, 1 GiB of KV, its defaults otherwise), sends a
warm-up burst, then ``--bursts`` bursts of 32 streaming completions of 128 random token
ids -> ``--max-tokens`` greedy tokens (``ignore_eos``; every burst its own prompts). Per
burst: output tok/s (over the wall time from the first request sent to the last token)
and the decode step time seen by the client (the time from the last request's first token
to the end, over the tokens streamed in that window). Per server, over its bursts: the
mean idle gap between two worker steps (``pagedserve:worker_step_gap_seconds``) and the
CPU time of the frontend (the ``pagedserve serve`` process), the scheduler actor and the
worker actor over the bursts (prefill included) per decode step (``/proc``: only one
server runs at a time).

    .venv/bin/python benchmarks/serving/step_transport.py \
        --json benchmarks/results/step_transport.json
    .venv/bin/python benchmarks/serving/step_transport.py --compare output \
        --json benchmarks/results/output_transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

BURST, PROMPT_LEN = 32, 128
TRANSPORTS = ("socket", "ray")
ACTORS = {"scheduler": "ray::SchedulerActor", "worker": "ray::Worker"}


async def _stream(
    client: Any, base: str, prompt: list[int], max_tokens: int, t0: float
) -> list[float]:
    """One streaming completion; the arrival time of each chunk, seconds from ``t0``."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    times: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter() - t0)
    return times


async def burst(base: str, seed: int, max_tokens: int) -> dict[str, float]:
    """32 requests at once: output tok/s, and the decode step time the client saw (ms)."""
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(BURST)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=BURST + 8)) as client:
        t0 = time.perf_counter()
        arrivals = await asyncio.gather(
            *(_stream(client, base, p, max_tokens, t0) for p in prompts)
        )
        wall = time.perf_counter() - t0
    last_first = max(t[0] for t in arrivals)
    end = max(t[-1] for t in arrivals)
    steps = max(sum(1 for x in t if x > last_first) for t in arrivals)
    return {"tok_s": round(BURST * max_tokens / wall, 1), "wall_s": round(wall, 2),
            "decode_step_ms": round(1000 * (end - last_first) / max(1, steps), 2),
            "decode_steps": steps}  # fmt: skip


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each named process, seconds (0.0 for one that is gone)."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            out[name] = 0.0
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[name] = (int(fields[11]) + int(fields[12])) / hz
    return out


def find_actor(title: str) -> int | None:
    """The pid of the process whose command line starts with ``title`` (a Ray actor)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        cmd = cmd.strip()
        if cmd == title or cmd.startswith(title + "."):  # ray::Actor.method while in a call
            return int(entry.name)
    return None


def step_gap(base: str) -> tuple[float, float]:
    """``(sum seconds, count)`` of ``pagedserve:worker_step_gap_seconds``."""
    import httpx

    total = count = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedserve:worker_step_gap_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pagedserve:worker_step_gap_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def run_server(transport: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Start the server with ``transport``, warm up, the bursts; its figures."""
    port, grpc_port = free_port(), free_port()
    cmd = [str(Path(sys.executable).with_name("pagedserve")), "serve", "--model", args.model,
           "--host", "127.0.0.1", "--http-port", str(port), "--port", str(grpc_port),
           "--kv-cache-memory", "1G", "--max-model-len", "2048", "--served-model-name",
           "smollm2", f"--{args.compare}-transport", transport]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as cwd:
        proc = start_server(cmd, dict(os.environ), Path(cwd), Path(cwd) / "server.log")
        try:
            wait_healthy(proc, f"{base}/health", args.startup_timeout)
            asyncio.run(burst(base, seed - 1, args.max_tokens))  # warm-up
            pids = {"frontend": proc.pid}
            for name, title in ACTORS.items():
                pid = find_actor(title)
                if pid is None:
                    raise RuntimeError(f"no process {title!r}")
                pids[name] = pid
            gap0, cpu0 = step_gap(base), cpu_seconds(pids)
            bursts = [
                asyncio.run(burst(base, seed + i, args.max_tokens)) for i in range(args.bursts)
            ]
            gap1, cpu1 = step_gap(base), cpu_seconds(pids)
        finally:
            stop_server(proc)
    steps = sum(b["decode_steps"] for b in bursts) or 1
    out: dict[str, Any] = {
        "bursts": bursts,
        "median_tok_s": statistics.median(b["tok_s"] for b in bursts),
        "median_decode_step_ms": statistics.median(b["decode_step_ms"] for b in bursts),
        "step_gap_mean_ms": round(1000 * (gap1[0] - gap0[0]) / max(1.0, gap1[1] - gap0[1]), 3),
        "cpu_ms_per_decode_step": {k: round(1000 * (cpu1[k] - cpu0[k]) / steps, 2) for k in pids},
    }
    print(f"{args.compare} {transport}: {[b['tok_s'] for b in bursts]} tok/s, decode "
          f"{[b['decode_step_ms'] for b in bursts]} ms/step, gap {out['step_gap_mean_ms']} ms, "
          f"cpu ms/step {out['cpu_ms_per_decode_step']}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--compare", choices=("step", "output"), default="step",
                    help="which transport flag the servers differ in")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="servers per transport, alternating")
    ap.add_argument("--bursts", type=int, default=3, help="bursts per server")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=3000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TRANSPORTS}
    for r in range(args.rounds):
        for t in TRANSPORTS:
            runs[t].append(run_server(t, args, args.seed + 1000 * r))
    print("| transport | output tok/s (median of servers) | decode ms/step | step gap mean ms | "
          "CPU ms per step: frontend / scheduler / worker |")  # fmt: skip
    print("|---|---|---|---|---|")
    summary = {}
    for t, rs in runs.items():
        cpu = {k: statistics.median(x["cpu_ms_per_decode_step"][k] for x in rs)
               for k in rs[0]["cpu_ms_per_decode_step"]}  # fmt: skip
        summary[t] = {
            "tok_s": statistics.median(x["median_tok_s"] for x in rs),
            "decode_step_ms": statistics.median(x["median_decode_step_ms"] for x in rs),
            "step_gap_mean_ms": statistics.median(x["step_gap_mean_ms"] for x in rs),
            "cpu_ms_per_decode_step": cpu,
        }
        s = summary[t]
        print(f"| {t} | {s['tok_s']} | {s['decode_step_ms']} | {s['step_gap_mean_ms']} | "
              f"{cpu['frontend']:.2f} / {cpu['scheduler']:.2f} / {cpu['worker']:.1f} |")  # fmt: skip
    ratio = summary["socket"]["tok_s"] / summary["ray"]["tok_s"]
    print(f"{args.compare} transport socket / ray output tok/s: {ratio:.3f}")
    if args.json:
        payload = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
                   "command": " ".join(sys.argv), "summary": summary, "runs": runs}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
