"""Load test: many concurrent streaming clients over gRPC and HTTP against one real server.

The server (embedded Ray, one CPU worker, its gRPC and OpenAI-compatible HTTP frontends on
127.0.0.1) runs in this process; the clients run in a second process (asyncio: ``--clients``
coroutines over ``grpc.aio`` channels and one ``httpx`` pool) so that they do not share the
frontend's interpreter. ``--requests`` requests of mixed prompt and output lengths, half
gRPC and half HTTP (``--http-share``), some with n > 1 (``--n-share``), some cancelled by the
client after a random number of stream items (``--cancel-share``), greedy or seeded.

Checked and reported:

* every request ends with a terminal status (all choices finished, cancelled by the client,
  or refused with a status); a request still open after ``--request-timeout`` counts as hung;
* zero leaked blocks at the end: every worker's blocks free, nothing running or waiting, and
  the scheduler's integrity check (ref counts, free queue, block tables, prefix index);
* RSS of every process of the server (driver/frontend, scheduler and worker actors, Ray's
  own daemons) and of the load generator, sampled as requests complete; growth per 1,000
  requests after warm-up (least-squares slope over the samples after ``--warmup-share``);
* p50 / p99 TTFT and ITL (client side), output tokens/s and requests/s.

Everything is bounded: ``--requests`` in count, ``--time-limit`` in seconds (requests not
yet started then are not sent and are reported as such). Writes ``--out`` (JSON; default
``benchmarks/results/stress.json``).

Usage::

    .venv/bin/python benchmarks/serving/stress.py                         # 200 clients, 2,000 requests
    .venv/bin/python benchmarks/serving/stress.py --clients 20 --requests 60 --model PATH   # small
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "Give me a short list of names for a pet goldfish.",
    "How many legs does a spider have?",
    "Summarise the plot of Romeo and Juliet.",
    "What does a compiler do?",
]
DOCUMENT = (
    "The history of computing spans centuries, from the abacus and mechanical calculators "
    "to programmable machines, transistors, integrated circuits and networked systems. "
)


@dataclass(frozen=True)
class StressConfig:
    """One load run (see the module docstring; CLI flags have the same names)."""

    model: str = "default"
    clients: int = 200
    requests: int = 2000
    http_share: float = 0.5
    cancel_share: float = 0.1
    n_share: float = 0.1
    max_tokens_min: int = 4
    max_tokens_max: int = 64
    num_blocks: int | None = None
    max_model_len: int | None = 2048
    max_paragraphs: int = 6
    cpus_per_worker: int | None = None  # Ray CPUs of the worker; None = every core
    seed: int = 0
    time_limit_s: float = 1800.0
    request_timeout_s: float = 600.0
    warmup_share: float = 0.2
    sample_every: int = 50
    out: str = str(RESULTS / "stress.json")


@dataclass(frozen=True)
class Spec:
    """One request of the workload."""

    index: int
    transport: str  # "grpc" or "http"
    prompt: str
    max_tokens: int
    n: int
    temperature: float
    seed: int | None
    cancel_after: int | None  # stream items received before the client cancels


def workload(cfg: StressConfig) -> list[Spec]:
    """The requests, reproducible from ``cfg.seed``: prompts short (a question), medium
    (a question after a paragraph) or long (a question after several); log-uniform
    ``max_tokens``."""
    rng = random.Random(cfg.seed)
    specs = []
    for i in range(cfg.requests):
        question = rng.choice(QUESTIONS)
        size = rng.choices([0, min(1, cfg.max_paragraphs), cfg.max_paragraphs], weights=[6, 3, 1])[
            0
        ]
        prompt = DOCUMENT * size + question
        lo, hi = cfg.max_tokens_min, cfg.max_tokens_max
        max_tokens = round(lo * (hi / lo) ** rng.random())
        n = rng.choice([2, 3, 4]) if rng.random() < cfg.n_share else 1
        sampled = rng.random() < 0.5
        cancel = (
            rng.randint(1, max(1, max_tokens // 2)) if rng.random() < cfg.cancel_share else None
        )
        specs.append(
            Spec(
                index=i,
                transport="http" if rng.random() < cfg.http_share else "grpc",
                prompt=prompt,
                max_tokens=max_tokens,
                n=n,
                temperature=0.8 if sampled or n > 1 else 0.0,
                seed=rng.randrange(2**31) if sampled or n > 1 else None,
                cancel_after=cancel,
            )
        )
    return specs


# ---------------------------------------------------------------------------- load process
def _grpc_request(stub: Any, spec: Spec, timeout: float) -> Any:
    from pagedserve.cluster.client import build_request

    req = build_request(
        spec.prompt,
        max_tokens=spec.max_tokens,
        n=spec.n,
        temperature=spec.temperature,
        seed=spec.seed,
    )
    return stub.Generate(req, timeout=timeout)


async def _run_grpc(stub: Any, spec: Spec, timeout: float, rec: dict) -> None:
    import grpc

    from pagedserve.v1 import generate_pb2 as pb

    call = _grpc_request(stub, spec, timeout)
    items = 0
    try:
        async for msg in call:
            _note(rec, msg.index, len(msg.delta_token_ids))
            items += 1
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                name = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_")
                rec["finish"][msg.index] = name.lower()
            if spec.cancel_after is not None and items >= spec.cancel_after:
                call.cancel()
                rec["status"] = "cancelled"
                return
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and rec["status"] == "cancelled":
            return
        rec["status"] = f"error:{exc.code().name}"
        return
    rec["status"] = "finished"


async def _run_http(client: Any, base: str, model: str, spec: Spec, rec: dict) -> None:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "n": spec.n,
        "temperature": spec.temperature,
        "stream": True,
        "return_token_ids": True,
    }
    if spec.seed is not None:
        body["seed"] = spec.seed
    items = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            rec["status"] = f"error:http{resp.status_code}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                rec["status"] = "finished"
                return
            chunk = json.loads(data)
            if "error" in chunk:
                rec["status"] = f"error:{chunk['error'].get('code')}"
                return
            for choice in chunk["choices"]:
                _note(rec, choice["index"], len(choice.get("token_ids") or ()))
                if choice.get("finish_reason"):
                    rec["finish"][choice["index"]] = choice["finish_reason"]
            items += 1
            if spec.cancel_after is not None and items >= spec.cancel_after:
                rec["status"] = "cancelled"
                return  # leaving the block closes the connection: the server aborts
    rec["status"] = "error:stream_ended_without_done"


def _note(rec: dict, index: int, num_tokens: int) -> None:
    now = time.perf_counter()
    if num_tokens == 0:
        return
    if rec["first"] is None:
        rec["first"] = now
    last = rec["last"].get(index)
    if last is not None:
        rec["itl"].append(now - last)
    rec["last"][index] = now
    rec["tokens"] += num_tokens


async def _load(cfg: StressConfig, address: str, http_address: str, model: str, done: Any):
    import grpc
    import httpx

    from pagedserve.v1 import generate_pb2_grpc as pb_grpc

    specs = workload(cfg)
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    channels = [grpc.aio.insecure_channel(address) for _ in range(8)]
    stubs = [pb_grpc.GenerationStub(ch) for ch in channels]
    base = f"http://{http_address}"
    limits = httpx.Limits(max_connections=cfg.clients, max_keepalive_connections=cfg.clients)
    records: list[dict] = []
    start = time.perf_counter()
    deadline = start + cfg.time_limit_s
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout_s) as http:

        async def client(cid: int) -> None:
            while not queue.empty() and time.perf_counter() < deadline:
                spec = queue.get_nowait()
                rec: dict[str, Any] = {
                    "index": spec.index, "transport": spec.transport, "n": spec.n,
                    "cancel": spec.cancel_after is not None, "status": "open",
                    "start": time.perf_counter(), "first": None, "last": {}, "itl": [],
                    "tokens": 0, "finish": {},
                }  # fmt: skip
                records.append(rec)
                try:
                    if spec.transport == "grpc":
                        coro = _run_grpc(stubs[cid % len(stubs)], spec, cfg.request_timeout_s, rec)
                    else:
                        coro = _run_http(http, base, model, spec, rec)
                    await asyncio.wait_for(coro, cfg.request_timeout_s)
                except TimeoutError:
                    rec["status"] = "hung"
                except Exception as exc:
                    rec["status"] = f"error:{type(exc).__name__}"
                rec["end"] = time.perf_counter()
                with done.get_lock():
                    done.value += 1

        await asyncio.gather(*(client(i) for i in range(cfg.clients)))
    for ch in channels:
        await ch.close()
    wall = time.perf_counter() - start
    for rec in records:
        rec.pop("last")
        rec["ttft"] = None if rec["first"] is None else rec["first"] - rec["start"]
    return {"wall_s": wall, "not_sent": queue.qsize(), "records": records}


def load_main(cfg: StressConfig, address: str, http_address: str, model: str, done, path: str):
    """Entry point of the load process: run the workload, write the raw records to path."""
    result = asyncio.run(_load(cfg, address, http_address, model, done))
    Path(path).write_text(json.dumps(result))


# ---------------------------------------------------------------------------- server side
def _process_name(proc: Any) -> str:
    try:
        cmd = proc.cmdline()
    except Exception:
        return "?"
    joined = " ".join(cmd)
    for key in ("SchedulerActor", "Worker", "raylet", "gcs_server", "dashboard", "log_monitor"):
        if key in joined or (cmd and key in cmd[0]):
            return f"ray::{key}" if key in ("SchedulerActor", "Worker") else key
    return Path(cmd[0]).name if cmd else proc.name()


def rss_sample() -> dict[str, int]:
    """RSS (bytes) of this process and every descendant, keyed ``name[pid]``."""
    import psutil

    me = psutil.Process()
    out = {f"driver+frontend[{me.pid}]": me.memory_info().rss}
    for child in me.children(recursive=True):
        try:
            out[f"{_process_name(child)}[{child.pid}]"] = child.memory_info().rss
        except psutil.Error:
            continue
    return out


def _slope_per_1000(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of RSS over completed requests, bytes per 1,000 requests."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(cfg: StressConfig, load: dict, samples: list, stats: dict, integrity: str) -> dict:
    """The report: statuses, latencies, throughput, RSS growth, blocks."""
    records = load["records"]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    finished = [r for r in records if r["status"] == "finished"]
    incomplete = [r for r in finished if len(r["finish"]) != r["n"]]
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    itl = [x for r in records for x in r["itl"]]
    tokens = sum(r["tokens"] for r in records)
    warm = int(cfg.warmup_share * cfg.requests)
    procs = sorted({k for _, s in samples for k in s})
    rss = {}
    for name in procs:
        pts = [(done, s[name]) for done, s in samples if name in s]
        after = [p for p in pts if p[0] >= warm]
        slope = _slope_per_1000(after)
        rss[name] = {
            "first_mib": round(pts[0][1] / 2**20, 1),
            "last_mib": round(pts[-1][1] / 2**20, 1),
            "max_mib": round(max(p[1] for p in pts) / 2**20, 1),
            "growth_mib_per_1000_requests": None if slope is None else round(slope / 2**20, 2),
        }
    leaked = sum(w["num_blocks"] - w["num_free_blocks"] for w in stats["workers"])
    return {
        "config": dataclasses.asdict(cfg),
        "requests_sent": len(records),
        "not_sent": load["not_sent"],
        "statuses": statuses,
        "all_terminal": all(r["status"] != "open" and r["status"] != "hung" for r in records)
        and not incomplete,
        "finished_with_missing_choices": len(incomplete),
        "wall_s": round(load["wall_s"], 2),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / load["wall_s"], 2),
        "requests_per_s": round(len(records) / load["wall_s"], 3),
        "ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "itl_s": {"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99)},
        "leaked_blocks": leaked,
        "running_after": stats["num_requests_running"],
        "waiting_after": stats["num_requests_waiting"],
        "integrity": integrity,
        "rss": rss,
        "loadavg": os.getloadavg(),
    }


def run(cfg: StressConfig) -> dict:
    """Start the server, run the load in a second process, check the server, report."""
    import ray

    from pagedserve.cluster.client import Client
    from pagedserve.cluster.config import CacheConfig, ClusterConfig, ModelConfig, ServerConfig
    from pagedserve.cluster.launcher import RAY_ENV, start_cluster

    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    cache = CacheConfig(num_blocks=cfg.num_blocks) if cfg.num_blocks else CacheConfig()
    config = ClusterConfig(
        model=ModelConfig(model=cfg.model, max_model_len=cfg.max_model_len),
        cache=cache,
        server=ServerConfig(host="127.0.0.1", port=0, http_port=0),
        num_workers=1,
        cpus_per_worker=(
            max(1, os.cpu_count() or 1) if cfg.cpus_per_worker is None else cfg.cpus_per_worker
        ),
        device="cpu",
    )
    loop = asyncio.new_event_loop()
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    handle = on_loop(start_cluster(config))
    try:
        model = Path(handle.info.name).name
        ctx = mp.get_context("spawn")
        done = ctx.Value("i", 0)
        raw_path = str(Path(cfg.out).with_suffix(".records.json"))
        Path(raw_path).parent.mkdir(parents=True, exist_ok=True)
        load = ctx.Process(
            target=load_main,
            args=(cfg, handle.address, handle.http_address, model, done, raw_path),
            name="stress-load",
        )
        load.start()
        samples = [(0, rss_sample())]
        next_at = cfg.sample_every
        hard_deadline = time.monotonic() + cfg.time_limit_s + cfg.request_timeout_s + 60
        while load.is_alive() and time.monotonic() < hard_deadline:
            load.join(timeout=1.0)
            if done.value >= next_at:
                samples.append((done.value, rss_sample()))
                next_at = done.value + cfg.sample_every
        if load.is_alive():
            load.terminate()
            load.join(10)
            raise RuntimeError("the load process overran its time limit")
        samples.append((done.value, rss_sample()))
        result = json.loads(Path(raw_path).read_text())
        with Client(handle.address, timeout_s=60) as c:
            deadline = time.monotonic() + 60
            while True:
                stats = c.stats()
                idle = stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
                free = all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
                if (idle and free) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        try:
            ray.get(handle.scheduler.check_integrity.remote(), timeout=60)
            integrity = "ok"
        except Exception as exc:
            integrity = f"failed: {exc!r}"
        report = summarize(cfg, result, samples, stats, integrity)
        report["model"] = handle.info.name
        Path(cfg.out).write_text(json.dumps(report, indent=2))
        Path(raw_path).unlink(missing_ok=True)
        return report
    finally:
        on_loop(handle.stop(), timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def main() -> int:
    fields = {f.name: f for f in dataclasses.fields(StressConfig)}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, f in fields.items():
        default = f.default
        kind = type(default) if default is not None else int
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    args = ap.parse_args()
    cfg = StressConfig(**{k: getattr(args, k) for k in fields})
    report = run(cfg)
    rss = report.pop("rss")
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    print("RSS per process (MiB: first, last, max, growth per 1,000 requests after warm-up):")
    for name, r in rss.items():
        print(
            f"  {name:40s} {r['first_mib']:8.1f} {r['last_mib']:8.1f} {r['max_mib']:8.1f} "
            f"{r['growth_mib_per_1000_requests']}"
        )
    ok = report["all_terminal"] and report["leaked_blocks"] == 0 and report["integrity"] == "ok"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
