"""In-process engine throughput: ``pagedserve.LLM`` (the engine loop that serves, no Ray,
no gRPC).

The same workload as ``benchmarks/serving/serving.py`` (its chat prompts, greedy, ``ignore_eos``,
``--max-tokens`` each), all requests submitted at once, so the two figures side by side
show what Ray + gRPC cost. Prints one line (tokens/s); writes nothing.

Usage::

    .venv/bin/python benchmarks/engine/engine_inprocess.py --num-requests 16 --max-tokens 64
    .venv/bin/python benchmarks/engine/engine_inprocess.py --async-scheduling  # overlapped loop
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pagedserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads.py
from workloads import PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlapped loop (default: LLM's, serial on CPU)",
    )
    args = ap.parse_args()
    llm = LLM(
        args.model,
        num_blocks=1024,
        device="cpu",
        num_threads=args.threads,
        **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
    )
    messages = [
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.num_requests)
    ]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    execute_s = 0.0
    steps = 0

    def on_step(worker_id: int, so: object, ro: object) -> None:
        nonlocal execute_s, steps
        execute_s += ro.execute_time_s  # type: ignore[attr-defined]
        steps += 1

    llm._engine._on_step = on_step  # the step timings, without changing the loop
    start = time.perf_counter()
    outs = llm.chat(messages, sampling)
    wall = time.perf_counter() - start
    tokens = sum(o.num_output_tokens for o in outs)
    print(
        f"{args.num_requests} requests: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} "
        f"tok/s; worker execute {execute_s:.2f} s over {steps} steps "
        f"({'overlapped' if llm.scheduler.config.async_scheduling else 'serial'})"
    )
    llm.close()


if __name__ == "__main__":
    main()
