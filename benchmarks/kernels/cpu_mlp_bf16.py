"""The MLP block of a decoder layer in bf16 on CPU: fused gate/up + SiLU against the chains.

For SmolLM2-135M's MLP (gate/up 576 -> 2 x 1536, SiLU(gate) * up, down 1536 -> 576), at each
M (token rows), per layer, from bf16 rows in (what the RMSNorm before it writes) to the fp32
output, it times:

* ``packed fused``: ``linear_packed_bf16_silu_mul`` (gate/up, SiLU * up and the bf16
  rounding in one call, ``pagedserve/kernels/csrc/cpu_gemm_bf16.c``) then the packed down
  GEMM reading that bf16 product: what serving runs where the fused call applies (on
  AVX512-BF16 from 65 rows; "-" below, where serving runs the three calls);
* ``packed 3 calls``: the packed gate/up GEMM to fp32, ``silu_mul`` in fp32, the packed down
  GEMM (which rounds the product to bf16): the same bits, with the fp32 ``[M, 3072]``
  product and ``[M, 1536]`` activation written and read back
  (``PAGEDSERVE_CPU_FUSED_MLP=0``);
* ``oneDNN bf16``: ``torch.ops.mkldnn._linear_pointwise`` on weights reordered once, gate/up
  with bf16 output, ``silu_mul`` in bf16, down with the output cast to fp32: the chain vLLM's
  CPU backend runs (oneDNN GEMMs, a bf16 ``silu_and_mul`` between them).

The weights rotate over ``--layers`` distinct layers (30 = SmolLM2's: 160 MB of bf16 MLP
weights per method, each method its own copy, more than the L2s and the L3, so each pass
reads them from memory as a real step does), the methods alternating layer by layer, in
an order rotated every repeat (the slot after another method measurably helps at small M); the fastest of the
``--layers x --repeats`` samples of each is kept. Only ratios within one run are meaningful.
Writes ``benchmarks/results/cpu_mlp_bf16.json``.

Usage::

    .venv/bin/python benchmarks/kernels/cpu_mlp_bf16.py
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

from pagedserve.kernels import cpu_native
from pagedserve.worker.packed_linear_bf16 import ONEDNN_BATCH_HINT

RESULTS = Path(__file__).resolve().parents[1] / "results"
HIDDEN, INTER = 576, 1536
METHODS = ("packed fused", "packed 3 calls", "oneDNN bf16")

Block = Callable[[torch.Tensor], torch.Tensor]


class Declined(Exception):
    """The fused call does not apply at this M (serving runs the three calls there)."""


def build_layers(count: int) -> dict[str, list[Block]]:
    """Per method, one MLP block per layer: bf16 ``[M, HIDDEN]`` -> fp32 ``[M, HIDDEN]``."""
    gen = torch.Generator().manual_seed(0)
    blocks: dict[str, list[Block]] = {m: [] for m in METHODS}
    for _ in range(count):
        wgu = (torch.randn(2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16()
        wd = (torch.randn(HIDDEN, INTER, generator=gen) / INTER**0.5).bfloat16()
        pgu = cpu_native.pack_bf16_linear_weight(wgu)
        pd = cpu_native.pack_bf16_linear_weight(wd)
        mgu = torch.ops.mkldnn._reorder_linear_weight(wgu, ONEDNN_BATCH_HINT)
        md = torch.ops.mkldnn._reorder_linear_weight(wd, ONEDNN_BATCH_HINT)

        def fused(x: torch.Tensor, pgu: torch.Tensor = pgu, pd: torch.Tensor = pd) -> torch.Tensor:
            act = cpu_native.linear_packed_bf16_silu_mul(x, pgu, INTER)
            if act is None:
                raise Declined
            return cpu_native.linear_packed_bf16(act, pd, HIDDEN)

        # its own copies: a method must not find the weights the previous one just read
        pgu3, pd3 = pgu.clone(), pd.clone()

        def three(
            x: torch.Tensor, pgu: torch.Tensor = pgu3, pd: torch.Tensor = pd3
        ) -> torch.Tensor:
            gate_up = cpu_native.linear_packed_bf16(x, pgu, 2 * INTER)
            return cpu_native.linear_packed_bf16(cpu_native.silu_mul(gate_up), pd, HIDDEN)

        def onednn(x: torch.Tensor, mgu: torch.Tensor = mgu, md: torch.Tensor = md) -> torch.Tensor:
            pointwise = torch.ops.mkldnn._linear_pointwise
            act = cpu_native.silu_mul(pointwise(x, mgu, None, "none", [], ""))
            return pointwise(act, md, None, "none", [], "").float()

        blocks["packed fused"].append(fused)
        blocks["packed 3 calls"].append(three)
        blocks["oneDNN bf16"].append(onednn)
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64,128,256,512,1024,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(RESULTS / "cpu_mlp_bf16.json"))
    args = ap.parse_args()
    if not cpu_native.has_bf16_gemm():
        raise SystemExit("no AVX512-BF16 packed GEMM on this CPU/build")
    torch.set_num_threads(args.threads)
    blocks = build_layers(args.layers)
    rows_out = []
    print(
        "| M | packed fused (us) | packed 3 calls | oneDNN bf16 | 3 calls / fused "
        "| oneDNN / fused | oneDNN / 3 calls |"
    )
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, HIDDEN).bfloat16()
            best = {name: float("inf") for name in METHODS}
            names = list(METHODS)
            try:  # warm-up: scratch buffers, oneDNN's kernels; drops what declines
                blocks["packed fused"][0](x)
            except Declined:
                names.remove("packed fused")
            for name in names[-2:]:
                blocks[name][0](x)
            for rep in range(args.repeats):
                order = names[rep % len(names) :] + names[: rep % len(names)]  # every slot
                for layer in range(args.layers):
                    for name in order:
                        t0 = time.perf_counter()
                        blocks[name][layer](x)
                        best[name] = min(best[name], time.perf_counter() - t0)
            us = {name: best[name] * 1e6 for name in names}
            three, onednn = us["packed 3 calls"], us["oneDNN bf16"]
            fused = us.get("packed fused")
            cells = (
                (f"{fused:.0f}", f"{three / fused:.2f}x", f"{onednn / fused:.2f}x")
                if fused is not None
                else ("-", "-", "-")
            )
            print(
                f"| {m} | {cells[0]} | {three:.0f} | {onednn:.0f} | {cells[1]} | {cells[2]} | "
                f"{onednn / three:.2f}x |",
                flush=True,
            )
            rows_out.append({"m": m, "us_per_layer": us})
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    out = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "commit": commit,
        "threads": args.threads,
        "layers": args.layers,
        "repeats": args.repeats,
        "rows": rows_out,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
