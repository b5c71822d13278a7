"""Prefill throughput by token budget (chunk size): which ``--max-num-batched-tokens`` a
prefill-heavy load wants on this CPU.

One process holds one ``pagedserve.LLM`` per budget ``C`` (its defaults otherwise: bf16
weights and KV where the CPU has native bf16; prefix caching off so every prompt is
computed), and runs the same workload on each in turn, ``--rounds`` times interleaved (this
VM's speed drifts by up to 2x between minutes; only same-run, interleaved ratios mean
anything): ``--num-requests`` random prompts of ``--prompt-len`` tokens submitted at once,
greedy, ``--max-tokens`` each (1: prefill alone; more: the prefills' chunks share steps with
decodes, as in serving). It reports prompt tokens/s (prefill alone) or output tokens/s, and
with decodes the p99 of the steps' execute time while decodes were running (what a
decoding client sees as TPOT when prefills are chunked in). The fused gate_up + SiLU
epilogue is on unless ``PAGEDSERVE_CPU_FUSED_MLP=0`` is in the environment.

Writes ``benchmarks/results/prefill_chunk.json``.

Usage::

    .venv/bin/python benchmarks/engine/prefill_chunk.py --budgets 512,1024,2048 \\
        --num-requests 16 --prompt-len 512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run_once(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> dict[str, float]:
    """One pass of the workload on ``llm``; its figures."""
    from pagedserve import SamplingParams

    step_s: list[float] = []
    decode_step_s: list[float] = []

    def on_step(worker_id: int, so: Any, ro: Any) -> None:
        step_s.append(ro.execute_time_s)
        if any(n == 1 for n in so.num_scheduled_tokens.values()):
            decode_step_s.append(ro.execute_time_s)

    llm._engine._on_step = on_step
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, sampling)
    wall = time.perf_counter() - start
    llm._engine._on_step = None
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    output_tokens = sum(o.num_output_tokens for o in outs)
    q = statistics.quantiles(decode_step_s, n=100) if len(decode_step_s) >= 2 else [0.0] * 99
    return {
        "wall_s": wall,
        "prompt_tok_s": prompt_tokens / wall,
        "output_tok_s": output_tokens / wall,
        "steps": len(step_s),
        "execute_s": sum(step_s),
        "decode_steps": len(decode_step_s),
        "decode_step_p99_ms": q[98] * 1e3,
        "decode_step_mean_ms": 1e3 * statistics.fmean(decode_step_s) if decode_step_s else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--budgets", default="512,1024,2048,4096")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=0, help="per engine; 0: enough for all")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_chunk.json")
    args = ap.parse_args()
    import torch

    from pagedserve import LLM, SamplingParams

    budgets = [int(b) for b in args.budgets.split(",")]
    per_seq = -(-(args.prompt_len + args.max_tokens) // 16) + 1
    blocks = args.num_blocks or per_seq * args.num_requests + 16
    engines = {
        b: LLM(
            args.model,
            device="cpu",
            num_threads=args.threads,
            max_num_batched_tokens=b,
            max_model_len=max(2048, args.prompt_len + args.max_tokens),
            num_blocks=blocks,
            enable_prefix_caching=False,
        )
        for b in budgets
    }
    vocab = next(iter(engines.values())).info.vocab_size
    gen = torch.Generator().manual_seed(0)
    for llm in engines.values():  # warm each engine's kernels and caches
        llm.generate([{"prompt_token_ids": list(range(100, 164))}], SamplingParams(max_tokens=2))
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in budgets}
    for r in range(args.rounds):
        prompts = [
            {"prompt_token_ids": torch.randint(100, vocab - 100, (args.prompt_len,), generator=gen).tolist()}
            for _ in range(args.num_requests)
        ]  # fmt: skip
        for b in budgets if r % 2 == 0 else budgets[::-1]:
            fig = run_once(engines[b], prompts, args.max_tokens)
            runs[b].append(fig)
            print(
                f"round {r} budget {b:5d}: {fig['prompt_tok_s']:7.1f} prompt tok/s, "
                f"{fig['output_tok_s']:6.1f} output tok/s, {fig['steps']} steps "
                f"(decode steps p99 {fig['decode_step_p99_ms']:.0f} ms)",
                flush=True,
            )
    for llm in engines.values():
        llm.close()
    keys = ("prompt_tok_s", "output_tok_s", "wall_s", "decode_step_p99_ms", "decode_step_mean_ms")
    summary = {
        b: {f"{k}_median": statistics.median(x[k] for x in v) for k in keys} | {"steps": v[0]["steps"]}
        for b, v in runs.items()
    }  # fmt: skip
    base = summary[budgets[-1]]
    print(f"\nmedians over {args.rounds} interleaved rounds (ratio: to budget {budgets[-1]})")
    for b, s in summary.items():
        print(
            f"  budget {b:5d}: {s['prompt_tok_s_median']:7.1f} prompt tok/s "
            f"({s['prompt_tok_s_median'] / base['prompt_tok_s_median']:.2f}x), "
            f"{s['output_tok_s_median']:6.1f} output tok/s, decode steps mean "
            f"{s['decode_step_mean_ms_median']:.0f} / p99 {s['decode_step_p99_ms_median']:.0f} ms, "
            f"{s['steps']} steps"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta["fused_mlp"] = os.environ.get("PAGEDSERVE_CPU_FUSED_MLP", "on")
    args.out.write_text(json.dumps({"args": meta, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
