"""Greedy agreement of fp32, bf16, fp8 and int8 KV caches with HF transformers, and KV capacity.

SmolLM2-135M-Instruct in fp32 weights through the offline LLM API with
``kv_cache_dtype`` in {float32, bfloat16, fp8, int8} (``--kv-cache-dtypes``); HF
transformers greedy (fp32, eager) on the same prompt ids is the reference. Reports per KV
dtype: sequences equal to HF, the first position where each differs, the blocks one
``--kv-cache-memory`` holds and the blocks per GiB. Prints a table and writes JSON.

    .venv/bin/python benchmarks/memory/kv_fp8_accuracy.py --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three prime numbers greater than 100:",
    "Translate to German: The cat sleeps on the mat.",
    "Once upon a time in a small village,",
    "What is 17 times 23? Answer:",
]
KV_DTYPES = ("float32", "bfloat16", "fp8", "int8")
GiB = 1 << 30
RESULTS = Path(__file__).resolve().parents[1] / "results"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (``None``: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_reference(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            t = torch.tensor([ids])
            gen = model.generate(
                t, attention_mask=torch.ones_like(t), max_new_tokens=max_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=0,
            )  # fmt: skip
            out.append(gen[0, len(ids) :].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=int, default=64 << 20)
    ap.add_argument("--kv-cache-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--out", default=str(RESULTS / "kv_fp8_accuracy.json"))
    args = ap.parse_args()
    kv_dtypes = [name for name in args.kv_cache_dtypes.split(",") if name]

    from pagedserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    prompt_ids: list[list[int]] = []
    model_dir = ""
    for kv in kv_dtypes:
        t0 = time.perf_counter()
        with LLM(
            "default", dtype="float32", kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
            device="cpu",
        ) as engine:  # fmt: skip
            outs = engine.generate(PROMPTS, params)
            model_dir = engine.info.model_path
            rows.append(
                {
                    "kv_cache_dtype": engine.info.kv_cache_dtype,
                    "num_blocks": engine.info.num_blocks,
                    "block_bytes": engine.info.block_bytes,
                    "blocks_per_gib": GiB // engine.info.block_bytes,
                    "tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            prompt_ids = [list(o.prompt_token_ids) for o in outs]
    ref = hf_reference(model_dir, prompt_ids, args.max_tokens)
    print(
        f"{'KV dtype':<15} {'blocks':>7} {'B/block':>8} {'blk/GiB':>8} {'= HF':>6}  "
        "first differences"
    )
    for row in rows:
        diffs = [first_difference(t, r) for t, r in zip(row["tokens"], ref)]
        row["equal_to_hf"] = sum(d is None for d in diffs)
        row["first_differences"] = diffs
        shown = ", ".join("-" if d is None else str(d) for d in diffs)
        print(
            f"{row['kv_cache_dtype']:<15} {row['num_blocks']:>7} {row['block_bytes']:>8} "
            f"{row['blocks_per_gib']:>8} {row['equal_to_hf']:>3}/{len(PROMPTS)}  {shown}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    payload = {"max_tokens": args.max_tokens, "kv_cache_memory": args.kv_cache_memory,
               "prompts": PROMPTS, "hf": ref, "runs": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
