"""Decode attention on a bf16 KV cache: pagedserve's CPU kernel against vLLM's, side by side.

What it answers: how fast each system's paged decode-attention kernel reads a bf16 KV cache
that does not fit in the caches (the regime of a decode step at a large batch: the KV of
every layer is read once per step, from DRAM), at each block size the system takes.

Method. ``--batch`` sequences of ``--context`` cached tokens each, one decode query row per
sequence, SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64) unless
told. ``--layers`` separate caches per block size (one random layer copied, so every layer
has its own addresses and the set exceeds the L3), blocks placed by a random permutation.
One timed call reads every layer's cache once (as a step does); the figure is ms per layer
and the KV bytes read per second (``batch x context x kv_heads x head_dim x 2 (K, V) x 2
bytes``). pagedserve: :func:`pagedserve.kernels.cpu_native.paged_attention` on its layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` (``--block-sizes``, default 16 32 64
128). vLLM: ``torch.ops._C.cpu_attention_with_kv_cache`` of vLLM's CPU build (0.32, the
``benchmarks/.venv-vllm`` venv) on its layout ``[num_blocks, num_kv_heads, 2 x block_size,
head_dim]`` (K then V per block and head), ISA ``amx`` where the CPU has AMX (vLLM's choice
for bf16 with a block size that is a multiple of 32; its default CPU block size is 128),
``vec`` otherwise; block sizes that are multiples of 32 only. vLLM runs in a child process
(its own torch) that waits for a command per round, so the two systems alternate round by
round on the same machine; each figure is the median over ``--rounds``. Both use
``--threads`` threads. The query values are random (timing does not depend on them).

Usage::

    .venv/bin/python benchmarks/kernels/decode_attention_vllm.py
    .venv/bin/python benchmarks/kernels/decode_attention_vllm.py --batch 32 --context 2048

Writes ``benchmarks/results/decode_attention_vllm.json`` (and a plot where matplotlib
imports).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from vllm_venv import ensure_vllm_venv

from pagedserve.kernels import cpu_native

RESULTS = Path(__file__).resolve().parents[1] / "results"

# The child: builds vLLM-layout caches per block size, then times one pass over all layers
# per "run" line on stdin, answering one JSON line {block_size: ms_per_layer}.
VLLM_CHILD = r"""
import json, sys, time, torch
import vllm._custom_ops as ops
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
amx = torch.cpu._is_amx_tile_supported()
if amx:
    torch._C._cpu._init_amx()
isa = "amx" if amx else "vec"
B, C, H, KVH, D, L = (cfg[k] for k in ("batch", "context", "heads", "kv_heads", "head_dim", "layers"))
gen = torch.Generator().manual_seed(cfg["seed"])
cases = {}
for bs in cfg["block_sizes"]:
    per = -(-C // bs)
    nb = B * per
    one = torch.randn(nb, KVH, 2 * bs, D, generator=gen).bfloat16()
    caches = [one.clone() for _ in range(L)]
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(B, per).contiguous()
    lens = torch.full((B,), C, dtype=torch.int32)
    qsl = torch.arange(0, B + 1, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=gen).bfloat16()
    out = torch.empty_like(q)
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=B, num_heads=H, num_kv_heads=KVH, head_dim=D, seq_lens=lens,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)
    cases[bs] = (caches, table, lens, qsl, q, out, md)

def one_pass(bs):
    caches, table, lens, qsl, q, out, md = cases[bs]
    start = time.perf_counter()
    for c in caches:
        k, v = c.chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=k, value_cache=v, output=out, query_start_loc=qsl,
            seq_lens=lens, scale=D ** -0.5, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=md,
            s_aux=None)
    return 1e3 * (time.perf_counter() - start) / len(caches)

for bs in cases:
    one_pass(bs)  # warm-up
print(json.dumps({"ready": True, "isa": isa}), flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    print(json.dumps({str(bs): one_pass(bs) for bs in cases}), flush=True)
"""


def paged_cases(args: argparse.Namespace) -> dict[int, tuple]:
    """pagedserve-layout caches, tables, lengths and queries per block size."""
    gen = torch.Generator().manual_seed(args.seed)
    out = {}
    for bs in args.block_sizes:
        per = -(-args.context // bs)
        nb = args.batch * per
        one = torch.randn(nb, bs, args.kv_heads, args.head_dim, generator=gen).bfloat16()
        keys = [one.clone() for _ in range(args.layers)]
        values = [one.clone() for _ in range(args.layers)]
        table = torch.randperm(nb, generator=gen).to(torch.int32).view(args.batch, per)
        lens = torch.full((args.batch,), args.context, dtype=torch.int32)
        cu = torch.arange(0, args.batch + 1, dtype=torch.int32)
        q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen)
        out[bs] = (keys, values, table.contiguous(), lens, cu, q)
    return out


def paged_pass(case: tuple, scale: float) -> float:
    """ms per layer of one decode-attention call per layer."""
    keys, values, table, lens, cu, q = case
    start = time.perf_counter()
    for k, v in zip(keys, values):
        cpu_native.paged_attention(q, k, v, table, cu, lens, scale)
    return 1e3 * (time.perf_counter() - start) / len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16, 32, 64, 128])  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "decode_attention_vllm.json"))
    args = ap.parse_args()
    if not cpu_native.available():
        sys.exit("the CPU kernels are not available (cpu_native.load)")
    torch.set_num_threads(args.threads)
    kv_bytes = args.batch * args.context * args.kv_heads * args.head_dim * 2 * 2
    ours = paged_cases(args)
    vllm_sizes = [bs for bs in args.block_sizes if bs % 32 == 0]
    child_cfg = {k: getattr(args, k) for k in ("batch", "context", "heads", "kv_heads",
                                               "head_dim", "layers", "threads", "seed")}  # fmt: skip
    child_cfg["block_sizes"] = vllm_sizes
    child = subprocess.Popen(
        [str(ensure_vllm_venv()), "-c", VLLM_CHILD, json.dumps(child_cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    hello = json.loads(child.stdout.readline())
    scale = args.head_dim**-0.5
    for case in ours.values():
        paged_pass(case, scale)  # warm-up (and the kernel build)
    times: dict[str, dict[int, list[float]]] = {"pagedserve": {}, "vllm": {}}
    for r in range(args.rounds):
        for bs, case in ours.items():
            times["pagedserve"].setdefault(bs, []).append(paged_pass(case, scale))
        child.stdin.write("run\n")
        child.stdin.flush()
        for bs, ms in json.loads(child.stdout.readline()).items():
            times["vllm"].setdefault(int(bs), []).append(ms)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    child.stdin.write("stop\n")
    child.stdin.flush()
    child.wait(timeout=60)
    rows = []
    for system, per_bs in times.items():
        for bs, ms in sorted(per_bs.items()):
            med = statistics.median(ms)
            rows.append({"system": system, "block_size": bs, "ms_per_layer": round(med, 3),
                         "kv_gb_per_s": round(kv_bytes / med / 1e6, 2),
                         "rounds_ms": [round(x, 3) for x in ms]})  # fmt: skip
    best_ours = min(r["ms_per_layer"] for r in rows if r["system"] == "pagedserve")
    print(f"batch {args.batch} x context {args.context}, {args.layers} layers, "
          f"{args.threads} threads, vLLM ISA {hello['isa']}")  # fmt: skip
    for row in rows:
        print(f"{row['system']:>10} block {row['block_size']:>3}: {row['ms_per_layer']:6.2f} "
              f"ms/layer  {row['kv_gb_per_s']:5.1f} GB/s of KV  "
              f"({best_ours / row['ms_per_layer']:.2f}x pagedserve's best)")  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args),
              "vllm_isa": hello["isa"], "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for system in times:
        pts = [(r["block_size"], r["kv_gb_per_s"]) for r in rows if r["system"] == system]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("GB/s of bf16 KV read")
    ax.set_title(f"decode attention, batch {args.batch} x {args.context} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
