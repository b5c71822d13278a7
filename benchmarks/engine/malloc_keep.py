"""Prefill throughput with and without the CPU worker's glibc malloc settings
(``worker/cpu_malloc.py``: freed activations kept for reuse instead of unmapped).

Each round starts two child processes, ``PAGEDSERVE_MALLOC_KEEP=0`` and ``=1``, the order
alternating by round (this VM's speed drifts between minutes: only interleaved ratios
mean anything). A child builds one in-process ``pagedserve.LLM`` (the default model in its
default precision, prefix caching off so every prompt is computed), warms it up, then
times ``--passes`` passes of ``--num-requests`` random prompts of ``--prompt-len`` tokens
with ``max_tokens=1`` (prefill alone), and reports prompt tokens/s and its minor page
faults per pass (``getrusage``). Writes ``benchmarks/results/malloc_keep.json``.

Usage::

    .venv/bin/python benchmarks/engine/malloc_keep.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"

CHILD = """
import json, random, resource, sys, time
from pagedserve import LLM, SamplingParams
n, length, passes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM("default", enable_prefix_caching=False)
rng = random.Random(0)
def prompts(count, size):
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(size)]}
            for _ in range(count)]
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
llm.generate(prompts(n, length), one)  # warm-up: the same shapes once
out = []
for _ in range(passes):
    batch = prompts(n, length)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    llm.generate(batch, one)
    wall = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    out.append({"wall_s": wall, "prompt_tok_s": n * length / wall, "minor_faults": faults})
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(keep: bool, args: argparse.Namespace) -> list[dict[str, float]]:
    """One child process's passes (see the module docstring)."""
    env = dict(os.environ, PAGEDSERVE_MALLOC_KEEP="1" if keep else "0")
    cmd = [sys.executable, "-c", CHILD, str(args.num_requests), str(args.prompt_len),
           str(args.passes)]  # fmt: skip
    # a working folder outside the repository keeps its folders off the child's sys.path
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/",
                          timeout=args.timeout)  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return list(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"child failed (rc {done.returncode}): {done.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--passes", type=int, default=2, help="timed passes per child")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child")
    ap.add_argument("--out", type=Path, default=RESULTS / "malloc_keep.json")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        rnd: dict[str, list[dict[str, float]]] = {}
        for keep in order:
            name = "keep" if keep else "glibc_default"
            rnd[name] = run_child(keep, args)
            best = max(p["prompt_tok_s"] for p in rnd[name])
            faults = statistics.median(p["minor_faults"] for p in rnd[name])
            print(f"round {r + 1} {name}: {best:.0f} prompt tok/s (best pass), "
                  f"{faults:.0f} minor faults per pass", flush=True)  # fmt: skip
        rounds.append(rnd)
    ratios = [
        statistics.median(p["prompt_tok_s"] for p in rnd["keep"])
        / statistics.median(p["prompt_tok_s"] for p in rnd["glibc_default"])
        for rnd in rounds
    ]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor()}",
        "command": " ".join(sys.argv),
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "rounds": rounds,
        "ratio_keep_over_default_per_round": ratios,
        "ratio_median": statistics.median(ratios),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"keep / glibc default, per round: {', '.join(f'{x:.2f}x' for x in ratios)}; "
          f"median {report['ratio_median']:.2f}x")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
