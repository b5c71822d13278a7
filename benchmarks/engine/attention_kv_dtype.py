"""The CPU paged-attention kernel alone, fp32 vs bf16 (and fp8, int8) KV caches, side by side.

For each (batch, context) point: ``batch`` sequences of ``context`` cached tokens in a
shuffled paged cache (SmolLM2-135M's attention shape by default: 9 query heads, 3 KV heads,
head_dim 64, block size 16), one decode query row per sequence (``--prefill``: one chunk of
``context`` rows of a single sequence instead), through ``cpu_native.paged_attention`` on
the fp32 cache and on the same cache rounded to bf16 (``--kv-dtypes`` adds fp8 e4m3 at scale
1 and int8 with its per-(token, head) scales in the block). They are timed interleaved,
``--rounds`` times, and the minimum per call is kept (this machine's load only adds time).
The figure is for one layer; a step runs it once per layer.

Usage::

    .venv/bin/python benchmarks/engine/attention_kv_dtype.py --points 1x512,32x512,32x2048
    .venv/bin/python benchmarks/engine/attention_kv_dtype.py --points 1x512 --prefill
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from pagedserve.kernels import cpu_native, fp8, int8

RESULTS = Path(__file__).resolve().parents[1] / "results"


def case(batch: int, context: int, args: argparse.Namespace, q_len: int):
    """fp32 caches, tables, lengths and a query for ``batch`` sequences of ``context``."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // args.block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    query = torch.randn(batch * q_len, args.heads, args.head_dim, generator=gen)
    return query, k, v, tables.contiguous(), cu, lens


def best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="1x512,32x512,32x2048", help="BATCHxCONTEXT,...")
    ap.add_argument("--prefill", action="store_true", help="a chunk of CONTEXT rows per seq")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-dtypes", default="float32,bfloat16", help="of float32,bfloat16,fp8,int8")
    ap.add_argument("--out", default=str(RESULTS / "attention_kv_dtype.json"))
    args = ap.parse_args()
    rows = []
    for point in args.points.split(","):
        batch, context = (int(x) for x in point.split("x"))
        query, k, v, tables, cu, lens = case(batch, context, args, context if args.prefill else 1)
        every = {
            "float32": lambda t: t,
            "bfloat16": lambda t: t.to(torch.bfloat16),
            "fp8": lambda t: fp8.quantize(t),
            "int8": lambda t: int8.quantize(t),
        }
        names = [
            "float32",
            "bfloat16",
            *(n for n in args.kv_dtypes.split(",") if n not in ("float32", "bfloat16")),
        ]
        caches = {name: (every[name](k), every[name](v)) for name in names}
        scale = args.head_dim**-0.5
        calls = {
            name: functools.partial(
                cpu_native.paged_attention, query, kc, vc, tables, cu, lens, scale
            )
            for name, (kc, vc) in caches.items()
        }
        times = {name: float("inf") for name in calls}
        for _ in range(args.rounds):  # interleaved
            for name, fn in calls.items():
                times[name] = min(times[name], best_ms(fn, args.reps))
        row = {"batch": batch, "context": context, "prefill": args.prefill,
               "fp32_kv_ms": round(times["float32"], 3), "bf16_kv_ms": round(times["bfloat16"], 3),
               "speedup": round(times["float32"] / times["bfloat16"], 3)}  # fmt: skip
        for name in names[2:]:
            row[f"{name}_kv_ms"] = round(times[name], 3)
        rows.append(row)
        print(f"batch {batch:>3} context {context:>5}{' prefill' if args.prefill else ''}: "
              f"fp32 KV {row['fp32_kv_ms']:8.3f} ms  bf16 KV {row['bf16_kv_ms']:8.3f} ms  "
              f"({row['speedup']:.2f}x)"
              + "".join(f"  {n} KV {row[f'{n}_kv_ms']:8.3f} ms" for n in names[2:]),
              flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
            "shape": [args.heads, args.kv_heads, args.head_dim, args.block_size], "rows": rows}  # fmt: skip
    out.write_text(json.dumps(meta, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
