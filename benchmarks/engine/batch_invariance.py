"""What moves a sequence's logits when its batch changes, and what batch-invariant mode costs.

1. GEMM alone: one row of activations times a weight of the model's shape, computed inside
   ``F.linear`` calls of M = 1..64 rows: how many M give a different result for that row,
   and the largest difference (the library picks kernels and blocking by M); the same for
   :func:`pagedserve.worker.batch_invariant.invariant_linear`.
2. The whole model (real scheduler + worker in process, no Ray): the goldfish request
   (n=64, seed 5, 32 tokens, temperature 1, logprobs 20) on a roomy pool and on 12 blocks
   with max_model_len 256 (preemption, other batch sizes), default and batch-invariant:
   choices with equal token ids, and the largest difference of the top-20 logprobs (the
   log-softmax of the raw logits) over positions where the choices agree so far.
3. Cost: 32 greedy requests x 32 tokens decode throughput, both modes.

Writes ``benchmarks/results/batch_invariance.json``.

Usage::

    .venv/bin/python benchmarks/engine/batch_invariance.py [--model default] [--skip-goldfish]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.batch_invariant import invariant_linear
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.worker import Worker

GOLDFISH = "A list of names for a pet goldfish:"
RESULTS = Path(__file__).resolve().parents[1] / "results"


def gemm_check(k: int, n: int, max_m: int = 64) -> dict:
    torch.manual_seed(0)
    x = torch.randn(max_m, k)
    w = torch.randn(n, k) * 0.05
    out = {}
    for name, fn in (("F.linear", F.linear), ("invariant_linear", invariant_linear)):
        ref = fn(x[:1], w)[0]
        diffs = [float((fn(x[:m], w)[0] - ref).abs().max()) for m in range(1, max_m + 1)]
        out[name] = {
            "batch_sizes_differing": sum(d > 0 for d in diffs),
            "max_abs_diff": max(diffs),
        }
    return out


def engine(model_dir: str, requests, num_blocks: int, batch_invariant: bool,
           max_model_len: int | None = None, threads: int = 0):  # fmt: skip
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(
                model=model_dir, batch_invariant=batch_invariant, max_model_len=max_model_len
            ),
            cache=CacheConfig(num_blocks=num_blocks),
            device="cpu",
            num_threads=threads,
        )
    )
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(max_model_len=info.max_model_len, async_scheduling=False),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    for rid, ids, sampling in requests:
        sched.add_request(EngineRequest(rid, ids, sampling, info.eos_token_ids))
    out: dict = {}
    tokens = 0

    def collect(outputs: list) -> None:
        nonlocal tokens
        for o in outputs:
            ids, lps = out.setdefault((o.request_id, o.choice_index), ([], []))
            ids.extend(o.new_token_ids)
            lps.extend(dict(lp.top) for lp in o.logprobs)
            tokens += len(o.new_token_ids)

    start = time.perf_counter()
    asyncio.run(
        EngineLoop(sched, {0: InlineWorker(worker.execute_model)}, collect).run_until_idle()
    )
    return out, tokens / (time.perf_counter() - start), sched.num_preemptions


def goldfish(model_dir: str, tok, batch_invariant: bool) -> dict:
    ids = tok(GOLDFISH)["input_ids"]
    sp = SamplingParams(max_tokens=32, temperature=1.0, seed=5, n=64, ignore_eos=True, logprobs=20)
    roomy, _, _ = engine(model_dir, [("g", ids, sp)], 512, batch_invariant)
    small, _, preempted = engine(model_dir, [("g", ids, sp)], 12, batch_invariant, 256)
    equal = 0
    max_diff = 0.0
    for c in range(64):
        a_ids, a_lp = roomy[("g", c)]
        b_ids, b_lp = small[("g", c)]
        equal += a_ids == b_ids
        for pos in range(len(a_ids)):
            for tid in set(a_lp[pos]) & set(b_lp[pos]):
                max_diff = max(max_diff, abs(a_lp[pos][tid] - b_lp[pos][tid]))
            if a_ids[pos] != b_ids[pos]:
                break
    return {"equal_choices": equal, "of": 64, "max_logprob_diff": max_diff,
            "preemptions_small_pool": preempted}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--skip-goldfish", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = str(resolve_model(args.model, progress=False))
    tok = AutoTokenizer.from_pretrained(model_dir)
    report: dict = {"model": model_dir, "threads": torch.get_num_threads()}
    report["gemm"] = {
        f"{k}x{n}": gemm_check(k, n) for k, n in ((576, 960), (576, 576), (576, 3072), (1536, 576))
    }
    print(json.dumps(report["gemm"], indent=1), flush=True)
    if not args.skip_goldfish:
        for mode in (False, True):
            key = "batch_invariant" if mode else "default"
            report[f"goldfish_{key}"] = goldfish(model_dir, tok, mode)
            print(key, report[f"goldfish_{key}"], flush=True)
    chats = [f"Question {i}: name a colour, a fruit and an animal." for i in range(32)]
    reqs = [
        (
            f"r{i}",
            tok(c)["input_ids"],
            SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
        )
        for i, c in enumerate(chats)
    ]
    for mode in (False, True):
        _, tps, _ = engine(model_dir, reqs, 1024, mode, threads=args.threads)
        report[f"tokens_per_s_{'batch_invariant' if mode else 'default'}"] = round(tps, 1)
        print("batch_invariant" if mode else "default", "tok/s", round(tps, 1), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_invariance.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
