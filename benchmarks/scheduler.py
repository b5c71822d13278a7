"""Scheduler step cost: ``Scheduler.schedule`` + ``update`` with a fake worker (no model).

For each batch size N: N requests decode together on one worker (prompt ``--prompt-len``
tokens, enough ``max_tokens`` and pool for every measured step, ``max_num_seqs`` N); after
the prefills, ``--steps`` decode steps are timed. Two cases:

* ``decode``: nothing waits (the steady state of a busy server);
* ``decode+queue``: N more requests wait that do not fit, so every step also runs the
  admission check (the projected-growth test of ``scheduler/admission.py``) and refuses.

The fake worker answers every scheduled sequence with one token, as a real worker does, at
no cost. Reports microseconds per step (mean, p50, p99; and the p50 of the stepping
thread's CPU time, which a shared machine inflates less) and per sequence; the growth from
one size to the next shows how the cost scales. Writes ``benchmarks/results/scheduler.json``
(or ``--out``).

Usage::

    .venv/bin/python benchmarks/scheduler.py                     # 1, 16, 64, 256, 1024
    .venv/bin/python benchmarks/scheduler.py --sizes 256 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

BLOCK_SIZE = 16


def fake_execute(so: SchedulerOutput) -> RunnerOutput:
    """One sampled token per sequence whose scheduled chunk ends its known tokens.

    The benchmark's prompts fit one step, so every scheduled sequence samples.
    """
    return RunnerOutput(
        step_id=so.step_id,
        sampled_token_ids={sid: 1000 + (i % 7) for i, sid in enumerate(so.num_scheduled_tokens)},
    )


def build(n: int, prompt_len: int, steps: int, queued: bool) -> Scheduler:
    """A scheduler with ``n`` sequences running after their prefill (and ``n`` queued)."""
    max_tokens = steps + 8
    per_seq = -(-(prompt_len + max_tokens) // BLOCK_SIZE)
    cfg = SchedulerConfig(
        max_num_seqs=n,
        max_num_batched_tokens=max(2048, n * prompt_len),
        max_model_len=prompt_len + max_tokens + 1,
    )
    s = Scheduler(cfg, [WorkerSpec(0, n * per_seq, BLOCK_SIZE)])
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 31 + j) % 30000 + 3 for j in range(prompt_len)]
        s.add_request(f"r{i}", prompt, sampling, [2])
    so = s.schedule(0)  # every prefill in one step
    s.update(0, so, fake_execute(so))
    if len(s.workers[0].running) != n:
        raise RuntimeError(f"expected {n} running, got {len(s.workers[0].running)}")
    if queued:
        for i in range(n):
            prompt = [(i * 17 + j) % 30000 + 5 for j in range(prompt_len)]
            s.add_request(f"q{i}", prompt, sampling, [2])
    return s


def measure(n: int, prompt_len: int, steps: int, queued: bool) -> dict[str, float]:
    """Time ``steps`` decode steps (schedule + fake worker + update) at batch ``n``."""
    s = build(n, prompt_len, steps, queued)
    times: list[float] = []
    cpu: list[float] = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        so = s.schedule(0)
        ro = fake_execute(so)
        s.update(0, so, ro)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if len(so.num_scheduled_tokens) != n:
            raise RuntimeError(f"step scheduled {len(so.num_scheduled_tokens)} of {n}")
    s.check_integrity()
    times.sort()
    cpu.sort()
    us = [t * 1e6 for t in times]
    return {
        "num_running": n,
        "mean_us": statistics.fmean(us),
        "p50_us": us[len(us) // 2],
        "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
        "per_seq_us": statistics.fmean(us) / n,
        # CPU time of the stepping thread: what the step costs when the machine is shared
        "cpu_p50_us": cpu[len(cpu) // 2] * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,16,64,256,1024")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results/scheduler.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    for case, queued in (("decode", False), ("decode+queue", True)):
        rows = []
        for n in sizes:
            row = measure(n, args.prompt_len, args.steps, queued)
            if rows:
                row["growth_vs_previous"] = row["mean_us"] / rows[-1]["mean_us"]
            rows.append(row)
            print(
                f"{case:13s} N={n:5d}  mean {row['mean_us']:9.1f} us  p50 {row['p50_us']:9.1f}"
                f"  p99 {row['p99_us']:9.1f}  per seq {row['per_seq_us']:6.2f} us"
                f"  cpu p50 {row['cpu_p50_us']:9.1f} us"
            )
        results[case] = rows
    out = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg": os.getloadavg(),
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "block_size": BLOCK_SIZE,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
