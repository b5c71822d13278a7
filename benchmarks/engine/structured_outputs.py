"""Structured outputs: output tok/s with a JSON-schema constraint vs unconstrained.

``pagedserve.LLM`` on SmolLM2, ``--batch`` chat requests submitted at once (the prompts of
``engine_inprocess.py``), greedy, ``--max-tokens`` each. The unconstrained run uses
``ignore_eos``; the constrained one a schema whose shortest valid output is longer than
``--max-tokens`` (an array of at least 64 strings), so both keep the whole batch for every
step and end by length. After a short warm-up batch of each, the two alternate,
``--rounds`` times each, on one engine; the table shows medians.
Reported per run: output tok/s, worker execute time per step, the grammar bitmask fill
time per step (``RunnerOutput.grammar_fill_s``: filled on a thread while the forward runs)
and the grammar's time on the step's critical path (starting the fill, waiting for it and
masking after the forward, accepting the sampled tokens: timed by wrapping those calls
here), which is what a constrained step costs beyond an unconstrained one.

Usage::

    .venv/bin/python benchmarks/engine/structured_outputs.py --batch 32 --max-tokens 64

Prints a table; writes ``benchmarks/results/structured_outputs.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pagedserve import LLM, SamplingParams
from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.worker.structured import SequenceGrammar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads.py
from workloads import PROMPTS

RESULTS = Path(__file__).resolve().parents[1] / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "facts": {
            "type": "array",
            "items": {"type": "string", "minLength": 4, "maxLength": 60},
            "minItems": 64,
        },
    },
    "required": ["topic", "facts"],
}


def time_grammar_calls(llm: LLM) -> dict[str, float]:
    """Wrap the worker's grammar calls that run on the step's thread; the returned dict's
    ``"s"`` accumulates their seconds."""
    spent = {"s": 0.0}

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0

        return wrapper

    runner = llm._worker.runner.structured
    runner.start_fill = timed(runner.start_fill)  # type: ignore[method-assign]
    runner.apply = timed(runner.apply)  # type: ignore[method-assign]
    SequenceGrammar.accept = timed(SequenceGrammar.accept)  # type: ignore[method-assign]
    return spent


def run_once(
    llm: LLM, messages: list[Any], sampling: SamplingParams, spent: dict[str, float]
) -> dict[str, float]:
    """One batch; the wall time, tokens and per-step worker figures."""
    steps: list[tuple[float, float, float]] = []

    def on_step(worker_id: int, so: Any, ro: Any) -> None:
        steps.append((ro.execute_time_s, ro.grammar_fill_s, spent["s"]))
        spent["s"] = 0.0

    llm._engine._on_step = on_step  # the step timings, without changing the loop
    start = time.perf_counter()
    outs = llm.chat(messages, sampling)
    wall = time.perf_counter() - start
    tokens = sum(o.num_output_tokens for o in outs)
    decode = [s for s in steps if s[0] > 0]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "steps": len(steps),
        "execute_ms_per_step": 1e3 * statistics.mean(s[0] for s in decode),
        "fill_ms_per_step": 1e3 * statistics.mean(s[1] for s in decode),
        "fill_ms_per_step_max": 1e3 * max(s[1] for s in decode),
        "critical_ms_per_step": 1e3 * statistics.mean(s[2] for s in decode),
        "finished_by_length": sum(o.outputs[0].finish_reason == "length" for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_outputs.json")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        num_blocks=1024,
        device="cpu",
        num_threads=args.threads,
        max_num_seqs=max(64, args.batch),
        **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
    )
    messages = [
        [{"role": "user", "content": "As JSON: " + PROMPTS[i % len(PROMPTS)]}]
        for i in range(args.batch)
    ]
    kinds = {
        "unconstrained": SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        ),
        "json_schema": SamplingParams(
            max_tokens=args.max_tokens,
            temperature=0.0,
            structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)),
        ),
    }
    spent = time_grammar_calls(llm)
    for sampling in kinds.values():  # warm-up: compile, first full-batch steps
        run_once(llm, messages, dataclasses.replace(sampling, max_tokens=8), spent)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, sampling in kinds.items():
            runs[kind].append(run_once(llm, messages, sampling, spent))
    loop = "overlapped" if llm.scheduler.config.async_scheduling else "serial"
    dtype = llm.info.dtype
    llm.close()
    summary = {
        kind: {
            key: statistics.median(r[key] for r in rs)
            for key in (
                "tok_per_s",
                "execute_ms_per_step",
                "fill_ms_per_step",
                "critical_ms_per_step",
            )
        }
        for kind, rs in runs.items()
    }
    ratio = summary["json_schema"]["tok_per_s"] / summary["unconstrained"]["tok_per_s"]
    print(f"batch {args.batch}, {args.max_tokens} tokens each, {dtype}, {loop} loop, medians:")
    print(
        f"{'run':<15}{'tok/s':>10}{'execute ms/step':>18}{'mask fill ms/step':>20}"
        f"{'grammar on critical path ms/step':>34}"
    )
    for kind, s in summary.items():
        print(
            f"{kind:<15}{s['tok_per_s']:>10.1f}{s['execute_ms_per_step']:>18.1f}"
            f"{s['fill_ms_per_step']:>20.3f}{s['critical_ms_per_step']:>34.3f}"
        )
    print(f"constrained / unconstrained tok/s: {ratio:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "loop": loop,
                "dtype": dtype,
                "commit": os.popen("git rev-parse --short HEAD").read().strip(),
                "load_avg": os.getloadavg(),
                "runs": runs,
                "summary": summary,
                "ratio_tok_per_s": ratio,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
