"""Offline engines side by side: ``pagedserve.LLM`` against vLLM's ``LLM``, same prompts.

Each system runs in its own process (vLLM from its venv, ``benchmarks/.venv-vllm``, made
once by ``benchmarks/common/vllm_venv.py`` as for ``benchmarks/serving/vllm_bench.py``), both in their default precision (``dtype`` auto:
bf16 on a CPU with avx512_bf16 or AMX), 1 GiB of KV, prefix caching off, greedy with
``ignore_eos``, every request submitted at once. vLLM gets both cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: its engine core runs in a second process, as in
``vllm serve``). Workloads (random token ids, seeded, the same ids for both systems):

* ``prefill-16x512``: 16 prompts of 512 tokens, ``max_tokens=1`` (prompt tokens/s);
* ``prefill-32x128``: 32 prompts of 128 tokens, ``max_tokens=1`` (prompt tokens/s);
* ``decode-32x64``: 32 prompts of 128 tokens, 64 tokens each (output tokens/s; prefill
  included, as a client sees it).

After one warm-up request, each process times ``--passes`` passes of the workload and keeps
the best; the systems alternate process by process for ``--rounds`` rounds; the table gives
the median over rounds and the ratio. This measures the engines without HTTP or Ray: what the
kernels and the step loop give. Writes ``benchmarks/results/offline_vs_vllm.json`` (or ``--out``).

Usage::

    .venv/bin/python benchmarks/engine/offline_vs_vllm.py --rounds 2
    .venv/bin/python benchmarks/engine/offline_vs_vllm.py --workloads prefill-16x512 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # vllm_venv.py
from vllm_venv import ensure_vllm_venv

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# (prompts, prompt tokens, max_tokens, what the rate counts)
WORKLOADS: dict[str, tuple[int, int, int, str]] = {
    "prefill-16x512": (16, 512, 1, "prompt"),
    "prefill-32x128": (32, 128, 1, "prompt"),
    "decode-32x64": (32, 128, 64, "output"),
}


def token_ids(workload: str, seed: int) -> list[list[int]]:
    """The workload's prompts: random ids in [100, 40000), the same for every system."""
    n, length, _, _ = WORKLOADS[workload]
    rng = random.Random(f"{workload}-{seed}")
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_child(system: str, model: str, workload: str, passes: int) -> dict[str, Any]:
    """Build ``system``'s engine in this process, time ``passes`` passes, return the best."""
    n, _, max_tokens, counted = WORKLOADS[workload]
    if system == "pagedserve":
        from pagedserve import LLM, SamplingParams

        llm: Any = LLM(model, enable_prefix_caching=False, kv_cache_memory=1 << 30)

        def generate(prompts: list[list[int]], tokens: int) -> None:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    else:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        llm = VLLM(model, dtype="auto", max_model_len=2048, seed=0, enable_prefix_caching=False)

        def generate(prompts: list[list[int]], tokens: int) -> None:
            params = VParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                         use_tqdm=False)  # fmt: skip

    generate(token_ids("prefill-32x128", -1)[:2], 2)  # warm-up
    seconds = []
    for i in range(passes):
        prompts = token_ids(workload, i)
        start = time.perf_counter()
        generate(prompts, max_tokens)
        seconds.append(time.perf_counter() - start)
    best = min(seconds)
    tokens = n * (max_tokens if counted == "output" else len(token_ids(workload, 0)[0]))
    return {"seconds": seconds, "best_s": best, "tok_per_s": tokens / best, "counted": counted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--vllm-python", type=Path, default=None, help="default: vllm_venv.py's")
    ap.add_argument("--out", type=Path, default=RESULTS / "offline_vs_vllm.json")
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "WORKLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from pagedserve.worker.model_store import resolve_model

        args.model = str(resolve_model("default"))
    if args.child:
        result = run_child(args.child[0], args.model, args.child[1], args.passes)
        print("RESULT " + json.dumps(result), flush=True)
        return
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    if args.vllm_python is None:
        args.vllm_python = ensure_vllm_venv()
    pythons = {"pagedserve": Path(sys.executable), "vllm": args.vllm_python}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    runs: dict[str, dict[str, list[float]]] = {w: {s: [] for s in pythons} for w in workloads}
    for rnd in range(args.rounds):
        for workload in workloads:
            order = list(pythons) if rnd % 2 == 0 else list(reversed(pythons))
            for system in order:
                # vLLM starts from a folder other than the repository root (its python -m
                # and transformers would otherwise import the repository's folders).
                done = subprocess.run(
                    [str(pythons[system]), str(Path(__file__).resolve()), "--model", args.model,
                     "--passes", str(args.passes), "--child", system, workload],
                    cwd="/tmp", env=env, capture_output=True, text=True, timeout=1800,
                    check=False,
                )  # fmt: skip
                line = next(
                    (ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None
                )
                if line is None:
                    raise SystemExit(f"{system} {workload} failed:\n{done.stderr[-3000:]}")
                rate = json.loads(line[len("RESULT ") :])["tok_per_s"]
                runs[workload][system].append(rate)
                print(f"round {rnd + 1} {workload} {system}: {rate:.1f} tok/s", flush=True)
    print("\n| workload | pagedserve (tok/s) | vLLM (tok/s) | pagedserve / vLLM |")
    print("|---|---|---|---|")
    table = {}
    for workload in workloads:
        ours = statistics.median(runs[workload]["pagedserve"])
        theirs = statistics.median(runs[workload]["vllm"])
        table[workload] = {"pagedserve": ours, "vllm": theirs, "ratio": ours / theirs}
        print(f"| {workload} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
        cwd=ROOT,
    ).stdout.strip()  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": commit,
                "rounds": args.rounds,
                "passes": args.passes,
                "runs": runs,
                "medians": table,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
