"""Scheduler step cost: ``Scheduler.schedule`` + ``update`` with a fake worker (no model).

For each batch size N: N requests decode together on one worker (prompt ``--prompt-len``
tokens, enough ``max_tokens`` and pool for every measured step, ``max_num_seqs`` N); after
the prefills, ``--steps`` decode steps are timed. Two cases:

* ``decode``: nothing waits (the steady state of a busy server);
* ``decode+queue``: N more requests wait (``max_num_seqs`` 2N, ``--admission projected``)
  that do not fit the pool's projected peak, so every step also runs the admission check
  (the projected-growth test of ``scheduler/admission.py``) and refuses.

The collector is set as in the scheduler actor's process (``--gc actor``:
:func:`pagedserve.scheduler.gc_tuning.tune_gc` for the batch, before the requests arrive)
or left at CPython's defaults (``--gc default``). The fake worker answers every scheduled
sequence with one token, as a real worker does; its own time is not counted. Reports microseconds per step of ``schedule`` + ``update`` (mean,
p50, p99; the p50 of each of the two; the p50 of the stepping thread's CPU time, which a
shared machine inflates less), per sequence, and the garbage collections that ran inside
the timed calls (count and time: they make the tail). Every 16th step all N sequences fill a
block at once (same prompt length), so the p99 is such a step: a new block and one block
hash per sequence. The growth from one size to the next shows how the cost scales. Writes
``benchmarks/results/scheduler.json`` (or ``--out``).

Why not the engine loop (:class:`~pagedserve.scheduler.engine_loop.EngineLoop`), which every
other benchmark drives: the figure is the scheduler's own CPU cost per step, so the timer
must wrap exactly ``schedule`` + ``update`` and nothing else (no event loop turn, no sink, no
worker); the loop around them is a plain ``for`` over a synchronous fake worker, which is what
the loop does minus the parts this figure leaves out (``engine/profile_step.py`` reports the
loop's own share, ``loop``, in a real step).

Usage::

    .venv/bin/python benchmarks/engine/scheduler.py                     # 1, 16, 64, 256, 1024
    .venv/bin/python benchmarks/engine/scheduler.py --sizes 256 --steps 200
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.gc_tuning import tune_gc
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK_SIZE = 16
DEFAULT_GC_THRESHOLDS = gc.get_threshold()  # CPython's, before anything changes them


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
        max_num_seqs=2 * n if queued else n,
        max_num_batched_tokens=max(2048, n * prompt_len),
        max_model_len=prompt_len + max_tokens + 1,
        admission="projected" if queued else "fits-now",
    )
    s = Scheduler(cfg, [WorkerSpec(0, n * per_seq, BLOCK_SIZE)])
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 31 + j) % 30000 + 3 for j in range(prompt_len)]
        s.add_request(EngineRequest(f"r{i}", prompt, sampling, [2]))
    so = s.schedule(0).output  # every prefill in one step
    s.update(0, so, fake_execute(so))
    if len(s.workers[0].running) != n:
        raise RuntimeError(f"expected {n} running, got {len(s.workers[0].running)}")
    if queued:
        for i in range(n):
            prompt = [(i * 17 + j) % 30000 + 5 for j in range(prompt_len)]
            s.add_request(EngineRequest(f"q{i}", prompt, sampling, [2]))
    return s


class GcClock:
    """Counts the garbage collections (and their wall time) while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0


def measure(
    n: int, prompt_len: int, steps: int, queued: bool, tune: bool = True
) -> dict[str, float]:
    """Time ``steps`` decode steps (schedule + update; the fake worker not counted), the
    collector tuned as in the scheduler actor (``tune``) or at CPython's defaults."""
    gc.unfreeze()
    gc.set_threshold(*DEFAULT_GC_THRESHOLDS)
    gc.collect()
    if tune:
        tune_gc(2 * n if queued else n, 1)
    s = build(n, prompt_len, steps, queued)
    clock = GcClock()
    gc.callbacks.append(clock)
    times: list[float] = []
    sched: list[float] = []
    upd: list[float] = []
    cpu: list[float] = []
    try:
        for _ in range(steps):
            clock.active = True
            t0, c0 = time.perf_counter(), time.thread_time()
            so = s.schedule(0).output
            t1, c1 = time.perf_counter(), time.thread_time()
            clock.active = False
            ro = fake_execute(so)
            clock.active = True
            t2, c2 = time.perf_counter(), time.thread_time()
            s.update(0, so, ro)
            t3, c3 = time.perf_counter(), time.thread_time()
            clock.active = False
            sched.append(t1 - t0)
            upd.append(t3 - t2)
            times.append((t1 - t0) + (t3 - t2))
            cpu.append((c1 - c0) + (c3 - c2))
            if len(so.num_scheduled_tokens) != n:
                raise RuntimeError(f"step scheduled {len(so.num_scheduled_tokens)} of {n}")
    finally:
        gc.callbacks.remove(clock)
    s.check_integrity()
    if queued and len(s.workers[0].running) != n:
        raise RuntimeError("the queue was admitted: the projected check did not refuse")

    def p50(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] * 1e6

    us = sorted(t * 1e6 for t in times)
    return {
        "num_running": n,
        "mean_us": statistics.fmean(us),
        "p50_us": us[len(us) // 2],
        "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
        "max_us": us[-1],
        "per_seq_us": statistics.fmean(us) / n,
        "schedule_p50_us": p50(sched),
        "update_p50_us": p50(upd),
        # CPU time of the stepping thread: what the step costs when the machine is shared
        "cpu_p50_us": p50(cpu),
        "gc_collections": sum(clock.count),
        "gc_gen2_collections": clock.count[2],
        "gc_ms": clock.seconds * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,16,64,256,1024")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--out", default=str(RESULTS / "scheduler.json"))
    ap.add_argument(
        "--gc",
        choices=("actor", "default"),
        default="actor",
        help="the collector as the scheduler actor sets it, or CPython's defaults",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    for case, queued in (("decode", False), ("decode+queue", True)):
        rows = []
        for n in sizes:
            row = measure(n, args.prompt_len, args.steps, queued, args.gc == "actor")
            if rows:
                row["growth_vs_previous"] = row["mean_us"] / rows[-1]["mean_us"]
            rows.append(row)
            print(
                f"{case:13s} N={n:5d}  mean {row['mean_us']:8.1f} us  p50 {row['p50_us']:8.1f}"
                f"  p99 {row['p99_us']:8.1f}  per seq {row['per_seq_us']:5.2f} us"
                f"  (schedule {row['schedule_p50_us']:7.1f} + update {row['update_p50_us']:7.1f})"
                f"  cpu p50 {row['cpu_p50_us']:8.1f} us  gc {row['gc_collections']:3d}"
                f" ({row['gc_gen2_collections']} full, {row['gc_ms']:.1f} ms)"
            )
        results[case] = rows
    out = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg": os.getloadavg(),
        "steps": args.steps,
        "gc": args.gc,
        "prompt_len": args.prompt_len,
        "block_size": BLOCK_SIZE,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
