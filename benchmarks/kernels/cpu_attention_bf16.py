"""Prefill attention on a bf16 KV cache on CPU: bf16 tile products against the fp32-arithmetic kernel.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, block size 16) over
a paged bf16 cache, one layer's call per sample, at each case (chunks x rows over a
context):

* ``amx``: ``paged_attention(amx_min_rows=16)``: chunks of >= 16 rows on AMX tiles, or on
  AVX512-BF16 register tiles where AMX is not chosen
  (``pagedserve/kernels/csrc/cpu_attention_amx.c``: Q and P rounded to bf16, fp32 sums);
* ``exact``: ``paged_attention(amx_min_rows=0)``: the AVX512 kernel (fp32 arithmetic on the
  widened bf16 K/V), the only path before;
* ``sdpa bf16``: torch's ``scaled_dot_product_attention`` on contiguous bf16 Q/K/V of the
  same shape (causal; no paging), a reference point for what oneDNN-level code reaches.

The methods alternate sample by sample; the fastest of ``--repeats`` samples per cell is
kept (the least disturbed on a shared machine; compare within one run). Causal FLOPs
(2 matmuls of 2 * rows * keys_seen * head_dim per query head) give GFLOP/s. Writes
``benchmarks/results/cpu_attention_bf16.json``.

Usage::

    .venv/bin/python benchmarks/kernels/cpu_attention_bf16.py --threads 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from pagedserve.kernels import cpu_native

RESULTS = Path(__file__).resolve().parents[1] / "results"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (chunks, rows per chunk, context before the chunk)
CASES = ((1, 512, 0), (4, 512, 0), (1, 2048, 0), (1, 512, 1536), (16, 64, 0), (32, 16, 256))
METHODS = ("amx", "exact", "sdpa bf16")


def causal_flops(chunks: int, rows: int, context: int) -> float:
    seen = rows * context + rows * (rows + 1) / 2  # keys summed over the chunk's rows
    return chunks * HEADS * 2 * 2 * HEAD_DIM * seen


def build(chunks: int, rows: int, context: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    seq = context + rows
    per_seq = -(-seq // BLOCK)
    num_blocks = chunks * per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, generator=gen)[: chunks * per_seq].to(torch.int32)
    tables = perm.view(chunks, per_seq).contiguous()
    cu = torch.arange(0, chunks * rows + 1, rows, dtype=torch.int32)
    seq_lens = torch.full((chunks,), seq, dtype=torch.int32)
    query = torch.randn(chunks * rows, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    q16 = torch.randn(chunks, HEADS, rows, HEAD_DIM, generator=gen).bfloat16()
    k16 = torch.randn(chunks, HEADS, seq, HEAD_DIM, generator=gen).bfloat16()
    v16 = torch.randn(chunks, HEADS, seq, HEAD_DIM, generator=gen).bfloat16()
    mask = None
    if context:
        mask = torch.ones(rows, seq, dtype=torch.bool).tril(diagonal=context)

    def paged(rows_from: int) -> Callable[[], object]:
        return lambda: cpu_native.paged_attention(
            query, k_cache, v_cache, tables, cu, seq_lens, scale, out=out,
            amx_min_rows=rows_from,
        )  # fmt: skip

    def sdpa() -> object:
        return F.scaled_dot_product_attention(q16, k16, v16, attn_mask=mask, is_causal=mask is None)

    return {"amx": paged(16), "exact": paged(0), "sdpa bf16": sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_attention_bf16.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_native.amx_chosen():
        raise SystemExit("this CPU (or PAGEDSERVE_CPU_AMX) gives no AMX: nothing to compare")
    rows_out = []
    for chunks, rows, context in CASES:
        calls = build(chunks, rows, context)
        best = {m: float("inf") for m in METHODS}
        for fn in calls.values():
            fn()
        for _ in range(args.repeats):
            for m in METHODS:
                t0 = time.perf_counter()
                calls[m]()
                best[m] = min(best[m], time.perf_counter() - t0)
        flops = causal_flops(chunks, rows, context)
        row = {
            "chunks": chunks, "rows": rows, "context": context,
            **{f"{m} ms": round(best[m] * 1e3, 3) for m in METHODS},
            **{f"{m} GFLOP/s": round(flops / best[m] / 1e9, 1) for m in METHODS},
            "exact / amx": round(best["exact"] / best["amx"], 2),
        }  # fmt: skip
        rows_out.append(row)
        print(
            f"{chunks:>3} x {rows:>4} over {context:>4}: "
            + "  ".join(f"{m} {best[m] * 1e3:8.2f} ms" for m in METHODS)
            + f"  exact/amx {row['exact / amx']:.2f}x",
            flush=True,
        )
    print()
    print("| chunks x rows (context) | AMX (ms) | exact kernel (ms) | torch SDPA bf16 (ms) "
          "| AMX GFLOP/s | exact / AMX |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        print(
            f"| {r['chunks']} x {r['rows']} ({r['context']}) | {r['amx ms']} | {r['exact ms']} "
            f"| {r['sdpa bf16 ms']} | {r['amx GFLOP/s']} | {r['exact / amx']}x |"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "commit": commit,
                "threads": args.threads,
                "repeats": args.repeats,
                "shape": {
                    "heads": HEADS,
                    "kv_heads": KV_HEADS,
                    "head_dim": HEAD_DIM,
                    "block_size": BLOCK,
                },
                "rows": rows_out,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
