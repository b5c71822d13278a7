"""The linear layers of a decode / prefill step in bf16 on CPU: which GEMM, at which M.

For SmolLM2-135M's four matmuls of a decoder layer (fused qkv 576->960, o 576->576, fused
gate/up 576->3072, down 1536->576), at each M (token rows) it times, per layer (the four
summed), with fp32 activations in and fp32 out as the model's CPU path has them:

* ``fp32 packed``: the fp32 packed GEMM (``pagedserve/kernels/csrc/cpu_gemm.c``), today's CPU path;
* ``bf16 packed``: the bf16-pair packed GEMM (``pagedserve/kernels/csrc/cpu_gemm_bf16.c``) on
  AVX512-BF16 (``kernel="avx512"``);
* ``bf16 amx``: the same packed weights on AMX tiles (``kernel="amx"``; left out on a CPU
  without AMX, where the other four run);
* ``F.linear bf16``: torch's ``F.linear`` on a bf16 weight (oneDNN), with the fp32 -> bf16
  cast of x and the bf16 -> fp32 cast of the output;
* ``mkldnn prepacked``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by
  ``_reorder_linear_weight(w, --onednn-hint)`` (what :class:`PackedLinearBf16`'s oneDNN
  branch runs), the same casts included.

The weights rotate over ``--layers`` distinct layers (30 = SmolLM2's, 105 M weights: 420 MB
in fp32, 210 MB in each bf16 form, more than the 4 MiB L2s; each method's pass streams the
other methods' weights in between, so its own come from memory as in a real step). Each
sample is one layer's four matmuls of one method, the methods alternating layer by layer;
the fastest of the ``--layers x --repeats`` samples is kept (the least disturbed by other
load on this shared machine); only ratios within one
run are meaningful on this shared machine. Writes ``benchmarks/results/cpu_gemm_bf16.json``.

Usage::

    .venv/bin/python benchmarks/kernels/cpu_gemm_bf16.py --threads 2
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
from pagedserve.worker.packed_linear_bf16 import ONEDNN_BATCH_HINT

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
METHODS = ("fp32 packed", "bf16 packed", "bf16 amx", "F.linear bf16", "mkldnn prepacked")


def build_layers(count: int, hint: int) -> dict[str, list[list[Callable[[torch.Tensor], object]]]]:
    """Per method, per layer, the four matmuls as callables ``x fp32 [M, K] -> fp32``."""
    gen = torch.Generator().manual_seed(0)
    calls: dict[str, list[list[Callable[[torch.Tensor], object]]]] = {m: [] for m in METHODS}
    for _ in range(count):
        per: dict[str, list[Callable[[torch.Tensor], object]]] = {m: [] for m in METHODS}
        for n, k in SHAPES.values():
            w = torch.randn(n, k, generator=gen) / k**0.5
            wb = w.bfloat16()
            p32 = cpu_native.pack_linear_weight(w)
            p16 = cpu_native.pack_bf16_linear_weight(wb)
            mk = torch.ops.mkldnn._reorder_linear_weight(wb, hint)

            def fp32(x: torch.Tensor, p: torch.Tensor = p32, n: int = n) -> object:
                return cpu_native.linear_packed(x, p, n)

            def bf16(x: torch.Tensor, p: torch.Tensor = p16, n: int = n) -> object:
                return cpu_native.linear_packed_bf16(x, p, n, kernel="avx512")

            def amx(x: torch.Tensor, p: torch.Tensor = p16, n: int = n) -> object:
                return cpu_native.linear_packed_bf16(x, p, n, kernel="amx")

            def flin(x: torch.Tensor, wb: torch.Tensor = wb) -> object:
                return F.linear(x.bfloat16(), wb).float()

            def mkl(x: torch.Tensor, mk: torch.Tensor = mk) -> object:
                return torch.ops.mkldnn._linear_pointwise(
                    x.bfloat16(), mk, None, "none", [], ""
                ).float()

            for method, fn in zip(METHODS, (fp32, bf16, amx, flin, mkl)):
                per[method].append(fn)
        for method in METHODS:
            calls[method].append(per[method])
    return calls


def time_layer(fns: list[Callable[[torch.Tensor], object]], xs: list[torch.Tensor]) -> float:
    """Seconds for one layer's four matmuls."""
    start = time.perf_counter()
    for fn, x in zip(fns, xs):
        fn(x)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--onednn-hint", type=int, default=ONEDNN_BATCH_HINT)
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_gemm_bf16.json")
    args = parser.parse_args()
    if not cpu_native.has_bf16_gemm():
        raise SystemExit("this CPU or compiler has no AVX512-BF16: nothing to compare")
    methods = METHODS if cpu_native.has_amx() else tuple(m for m in METHODS if m != "bf16 amx")
    torch.set_num_threads(args.threads)
    calls = build_layers(args.layers, args.onednn_hint)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, k, generator=gen) for _, k in SHAPES.values()]
        for method in methods:  # warm-up: first-call costs (oneDNN primitive creation)
            time_layer(calls[method][0], xs)
        samples: dict[str, list[float]] = {method: [] for method in methods}
        for rep in range(args.repeats):
            for layer in range(args.layers):
                shift = (rep + layer) % len(methods)
                for method in methods[shift:] + methods[:shift]:
                    samples[method].append(time_layer(calls[method][layer], xs))
        us = {method: min(samples[method]) * 1e6 for method in methods}
        rows.append({"m": m, "us_per_layer": us})
        best = min(us, key=lambda k: us[k])
        print(
            f"M={m:4d} " + " ".join(f"{k}={v:8.0f}" for k, v in us.items()) + f"  best: {best}",
            flush=True,
        )
    print()
    print(
        "| M | "
        + " | ".join(f"{m} (us/layer)" for m in methods)
        + " | oneDNN time / best packed bf16 time | fp32 time / best bf16 time |"
    )
    print("|---|" + "---|" * (len(methods) + 2))
    for row in rows:
        us = row["us_per_layer"]
        best16 = min(us[m] for m in methods[1:])
        packed16 = min(us[m] for m in ("bf16 packed", "bf16 amx") if m in us)
        print(
            f"| {row['m']} | "
            + " | ".join(f"{us[m]:.0f}" for m in methods)
            + f" | {us['mkldnn prepacked'] / packed16:.2f}x | {us['fp32 packed'] / best16:.2f}x |"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": commit,
                "threads": args.threads,
                "layers": args.layers,
                "repeats": args.repeats,
                "onednn_hint": args.onednn_hint,
                "shapes": SHAPES,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
