"""Decode steps run on the thread that built the model, or on another one.

libgomp gives every thread that opens a parallel region a team of its own, and once it
manages more threads than there are CPUs its barriers sleep instead of spinning
(:mod:`pagedserve.worker.model_thread`). This runs the offline ``LLM`` (SmolLM2, bf16,
overlapped scheduling) in a fresh process per run, alternating two modes:

* ``model-thread``: as shipped, every step on the worker's model thread, where the model
  was built;
* ``other-thread``: every step on a thread of the handle's own (``ThreadWorker`` calling
  ``ModelRunner.execute_model`` directly), the model built on the model thread.

Per run: 32 prompts of 128 random token ids -> 1 and -> 129 greedy tokens (``ignore_eos``),
twice each; decode ms/step = (best 129-token time - best 1-token time) / 128; the process's
context switches over the timed part (``getrusage``: voluntary + involuntary, all threads).

    .venv/bin/python benchmarks/engine/model_thread.py --rounds 3 \
        --json benchmarks/results/model_thread.json
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("model-thread", "other-thread")


def one_run(mode: str) -> dict[str, float]:
    """In this process: build the LLM, time the decode, count context switches."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.scheduler.engine_loop import ThreadWorker

    llm = LLM("default", kv_cache_memory=1 << 30, async_scheduling=True)
    if mode == "other-thread":
        llm._handle.close()
        llm._handle = ThreadWorker(llm._worker.runner.execute_model)
        llm._engine._workers = {0: llm._handle}
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}
                for _ in range(n)]  # fmt: skip

    llm.generate(prompts(2, 16), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    times: dict[int, list[float]] = {1: [], 129: []}
    for max_tokens in (1, 129, 1, 129):
        t0 = time.perf_counter()
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts(32, 128), sampling)
        times[max_tokens].append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "decode_ms_per_step": round(1000 * (min(times[129]) - min(times[1])) / 128, 2),
        "context_switches": (after.ru_nvcsw - usage.ru_nvcsw) + (after.ru_nivcsw - usage.ru_nivcsw),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one)))
        return
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(mode, runs[mode][-1], flush=True)
    print("| steps on | decode ms/step (runs) | context switches (runs) |")
    print("|---|---|---|")
    for mode, rs in runs.items():
        print(f"| {mode} | {[r['decode_ms_per_step'] for r in rs]} (median "
              f"{statistics.median(r['decode_ms_per_step'] for r in rs)}) | "
              f"{[r['context_switches'] for r in rs]} |")  # fmt: skip
    if args.json:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()  # fmt: skip
        payload = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
                   "command": " ".join(sys.argv), "runs": runs}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
