"""Benchmark the paged-attention kernels on a GPU.

Decode: achieved memory bandwidth of :func:`pagedserve.kernels.paged_decode_attention`
(bytes of K/V + Q read and O written, divided by time) for batch 1..256 and context
512..32k, as a fraction of the GPU's peak bandwidth, next to torch SDPA on a contiguous
cache and FlashInfer's paged decode when ``flashinfer`` is importable. A point whose
working set would fit in L2 is timed over enough distinct copies of its tensors that at
least twice the L2 size is read from one use of a copy to its next (:func:`rotation_count`), so
its figure is HBM bandwidth, not L2 bandwidth; each row records its working set, the
rotation and ``l2_resident`` (true only if the rotation could not reach that). Each decode
point also records the kernel's largest error against the torch reference on its first
sequences. Prefill: TFLOP/s of :func:`pagedserve.kernels.paged_prefill_attention` (causal,
full prefill) next to torch SDPA ``is_causal=True`` on contiguous tensors.

Writes ``benchmarks/results/kernels.json``, and ``kernels.png`` where matplotlib is
installed (the bare GPU image has none: the JSON is written either way).

``--cpu-smoke`` runs the same code paths on CPU tensors with tiny shapes: the Triton
kernels under the interpreter (``TRITON_INTERPRET=1``, set here when unset), wall-clock
timing, and a nominal 64 KiB "L2" so the rotation runs. Under the interpreter bf16 operands
are upcast to fp32 before ``tl.dot`` (``compute_in_fp32``); the native 16-bit dot runs
there only for fp16, and the native bf16 dot only on a GPU (``native_16bit_dot`` in the
JSON says which ran). Without CUDA and without ``--cpu-smoke`` it says so and exits 0.

Usage: ``python benchmarks/kernels/kernels.py [--quick] [--dtype fp16|bf16] [--cpu-smoke]
[--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.kernels import reference


@dataclass(frozen=True)
class Grid:
    """The shapes one run sweeps.

    Attributes:
        num_heads, num_kv_heads, head_dim, block_size: the attention layer's shape.
        batches, contexts: decode batch sizes and context lengths (tokens).
        prefill_lens: prompt lengths (tokens); each prefill batch holds about
            ``prefill_tokens`` tokens.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    prefill_tokens: int

    def __post_init__(self) -> None:
        if min(self.num_heads, self.num_kv_heads, self.head_dim, self.block_size) < 1:
            raise ValueError(f"Grid sizes must be >= 1, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


# Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128).
GPU_GRID = Grid(32, 8, 128, 16, (1, 4, 16, 64, 256), (512, 2048, 8192, 32768),
                (512, 1024, 2048, 4096, 8192), 16384)  # fmt: skip
# Interpreter-sized: a few seconds per point; GQA group 2, several blocks per sequence.
SMOKE_GRID = Grid(4, 2, 32, 16, (1, 3), (40, 96), (24, 48), 48)
MAX_CACHE_BYTES = 24 * 2**30  # skip decode points whose K+V exceed this
# Bytes read between two uses of one copy of a working set, as a multiple of L2.
L2_MULTIPLE = 2
# L2 bytes by device-name fragment (first match wins), used where torch does not report
# it. H100 and H200 (GH100): 50 MB (NVIDIA Hopper Tuning Guide, "L2 Cache"); A100 40 MB
# (NVIDIA Ampere Tuning Guide); rounded up to MiB so the rotation errs long.
L2_BYTES = {"H200": 50 << 20, "H100": 50 << 20, "A100": 40 << 20, "L40S": 96 << 20,
            "L4": 48 << 20, "RTX 4090": 72 << 20, "A10": 6 << 20}  # fmt: skip
UNKNOWN_L2_BYTES = 128 << 20
SMOKE_L2_BYTES = 64 << 10  # nominal, so the CPU smoke exercises the rotation
# Nominal HBM bandwidth in bytes/s by device-name fragment (first match wins).
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10": 0.6e12,
    "RTX 4090": 1.008e12,
}
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"


@dataclass(frozen=True)
class Target:
    """Where a run executes: the device, the kernel backend and the timing budget."""

    device: torch.device
    backend: str  # "auto" on CUDA; "triton" (the interpreter) for the CPU smoke
    l2_bytes: int
    warmup: int
    iters: int


def rotation_count(working_set_bytes: int, l2_bytes: int) -> int:
    """Copies of a working set to cycle through so no use of one finds it in L2.

    Cycling over ``n`` copies reads ``n * working_set_bytes`` between two reads of any one
    byte; the smallest ``n`` making that at least ``L2_MULTIPLE * l2_bytes`` is returned
    (1 for a working set that large on its own). A cyclic sweep over twice an LRU-like
    cache finds none of it resident.

    Raises:
        ValueError: a non-positive size.
    """
    if working_set_bytes < 1 or l2_bytes < 1:
        raise ValueError(f"sizes must be >= 1, got {working_set_bytes} and {l2_bytes}")
    return max(1, math.ceil(L2_MULTIPLE * l2_bytes / working_set_bytes))


def cycle(calls: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """A callable running ``calls[0]``, ``calls[1]``, ... in turn, one per call."""
    state = {"next": 0}

    def run() -> Any:
        fn = calls[state["next"] % len(calls)]
        state["next"] += 1
        return fn()

    return run


def _bench(fn: Callable[[], Any], target: Target) -> float:
    """Median seconds per call (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(target.warmup):
        fn()
    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(target.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes: torch's report, else :data:`L2_BYTES` by name."""
    props = torch.cuda.get_device_properties(device)
    reported = getattr(props, "L2_cache_size", 0)
    if reported:
        return int(reported)
    for key, value in L2_BYTES.items():
        if key in props.name:
            return value
    return UNKNOWN_L2_BYTES


def _peak_bandwidth(target: Target) -> tuple[float | None, str]:
    if target.device.type != "cuda":
        return None, "none (CPU smoke)"
    name = torch.cuda.get_device_name(target.device)
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value, "nominal"
    # Unknown GPU: use a large device-to-device copy (read + write) as the peak.
    buf = torch.empty(2**30, dtype=torch.uint8, device=target.device)
    dst = torch.empty_like(buf)
    seconds = _bench(lambda: dst.copy_(buf), target)
    return 2 * buf.numel() / seconds, "measured copy"


def _paged_setup(grid: Grid, batch: int, context: int, dtype: torch.dtype, device: torch.device):
    blocks_per_seq = math.ceil(context / grid.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, grid.block_size, grid.num_kv_heads, grid.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return key_cache, value_cache, block_tables, seq_lens


def _flashinfer_decode(grid, query, key_cache, value_cache, block_tables, seq_lens, scale):
    """A ``run(query, key_cache, value_cache)`` for FlashInfer's paged decode, or None."""
    if query.device.type != "cuda":
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    try:
        batch, blocks = block_tables.shape
        device = query.device
        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr = torch.arange(0, (batch + 1) * blocks, blocks, dtype=torch.int32, device=device)
        last = seq_lens - (blocks - 1) * grid.block_size
        wrapper.plan(
            indptr,
            block_tables.reshape(-1).contiguous(),
            last.to(torch.int32),
            grid.num_heads,
            grid.num_kv_heads,
            grid.head_dim,
            grid.block_size,
            sm_scale=scale,
            data_type=query.dtype,
        )
        return lambda q, kc, vc: wrapper.run(q, (kc, vc))
    except Exception as exc:  # FlashInfer API differences must not stop the benchmark
        print(f"  flashinfer skipped: {exc!r}")
        return None


def _reference_error(grid, target, query, kc, vc, tables, lens, scale) -> float:
    """Largest |pagedserve - torch reference| over the first (up to) two sequences."""
    n = min(2, query.shape[0])
    args = (query[:n], kc, vc, tables[:n], lens[:n], scale)
    got = kernels.paged_decode_attention(*args, backend=target.backend)
    want = reference.paged_decode_attention(*args)
    return float((got.float() - want.float()).abs().max())


def _percent(fraction: float | None) -> str:
    return "no peak" if fraction is None else f"{fraction:.0%}"


def bench_decode(grid: Grid, target: Target, dtype: torch.dtype, quick: bool) -> list[dict]:
    device = target.device
    peak, peak_kind = _peak_bandwidth(target)
    elem = torch.finfo(dtype).bits // 8
    scale = grid.head_dim**-0.5
    rows = []
    batches = grid.batches[::2] if quick else grid.batches
    contexts = grid.contexts[::2] if quick else grid.contexts
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * grid.num_kv_heads * grid.head_dim * elem
            if kv_bytes > MAX_CACHE_BYTES:
                continue
            io_bytes = kv_bytes + 2 * batch * grid.num_heads * grid.head_dim * elem
            copies = rotation_count(io_bytes, target.l2_bytes)
            # Distinct caches and queries; the block table and lengths are shared (small).
            tensors = [_paged_setup(grid, batch, context, dtype, device) for _ in range(copies)]
            tables, lens = tensors[0][2], tensors[0][3]
            caches = [(kc, vc) for kc, vc, _, _ in tensors]
            queries = [
                torch.randn(batch, grid.num_heads, grid.head_dim, dtype=dtype, device=device)
                for _ in range(copies)
            ]
            ws = kernels.DecodeWorkspace(batch, grid.num_heads, grid.head_dim, device=device)
            between = copies * io_bytes  # read between two reads of one byte
            row: dict[str, Any] = {
                "batch": batch, "context": context, "bytes": io_bytes,
                "working_set_bytes": io_bytes, "rotation": copies,
                "bytes_between_reuse": between, "l2_bytes": target.l2_bytes,
                "l2_resident": between < L2_MULTIPLE * target.l2_bytes,
                "max_abs_err_vs_reference": _reference_error(
                    grid, target, queries[0], *caches[0], tables, lens, scale
                ),
            }  # fmt: skip

            def paged(q, kc, vc, tables=tables, lens=lens, ws=ws, context=context):
                return kernels.paged_decode_attention(
                    q, kc, vc, tables, lens, scale, target.backend,
                    max_seq_len=context, workspace=ws,
                )  # fmt: skip

            calls = {"pagedserve": [lambda p=paged, q=q, c=c: p(q, *c)
                                    for q, c in zip(queries, caches)]}  # fmt: skip
            # SDPA baseline: the same amount of K/V already contiguous per sequence.
            dense = []
            for q in queries:
                k = torch.randn(batch, grid.num_kv_heads, context, grid.head_dim,
                                dtype=dtype, device=device)  # fmt: skip
                dense.append((q.unsqueeze(2), k, torch.randn_like(k)))
            calls["sdpa_contiguous"] = [
                lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(
                    q4, k, v, scale=scale, enable_gqa=True
                )
                for q4, k, v in dense
            ]
            fi = _flashinfer_decode(grid, queries[0], *caches[0], tables, lens, scale)
            if fi is not None:
                calls["flashinfer"] = [
                    lambda q=q, c=c, fi=fi: fi(q, *c) for q, c in zip(queries, caches)
                ]
            for name, fns in calls.items():
                try:
                    seconds = _bench(cycle(fns), target)
                except Exception as exc:
                    print(f"  {name} failed at batch={batch} context={context}: {exc!r}")
                    continue
                bandwidth = io_bytes / seconds
                row[name] = {
                    "ms": seconds * 1e3,
                    "GBps": bandwidth / 1e9,
                    "fraction_of_peak": None if peak is None else bandwidth / peak,
                }
            print(
                f"decode b={batch:4d} ctx={context:6d} x{copies} "
                + ("(L2-resident) " if row["l2_resident"] else "")
                + " ".join(
                    f"{n}={row[n]['GBps']:.3g}GB/s({_percent(row[n]['fraction_of_peak'])})"
                    for n in calls
                    if n in row
                )
                + f" err={row['max_abs_err_vs_reference']:.2e}"
            )
            rows.append(row)
            del tensors, caches, queries, dense
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row in rows:
        row["peak_GBps"] = None if peak is None else peak / 1e9
        row["peak_kind"] = peak_kind
    return rows


def bench_prefill(grid: Grid, target: Target, dtype: torch.dtype, quick: bool) -> list[dict]:
    """Causal prefill TFLOP/s (compute-bound: timed without rotation; ``l2_resident`` says
    whether one call's K/V + Q + O would fit in L2)."""
    device = target.device
    elem = torch.finfo(dtype).bits // 8
    scale = grid.head_dim**-0.5
    rows = []
    for seq_len in grid.prefill_lens[::2] if quick else grid.prefill_lens:
        batch = max(1, grid.prefill_tokens // seq_len)
        kc, vc, tables, lens = _paged_setup(grid, batch, seq_len, dtype, device)
        total = batch * seq_len
        query = torch.randn(total, grid.num_heads, grid.head_dim, dtype=dtype, device=device)
        cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=device)
        # Causal attention: QK^T and PV over the lower triangle, 2 FLOPs per MAC.
        flops = 4 * batch * grid.num_heads * grid.head_dim * seq_len * (seq_len + 1) / 2
        q4 = query.view(batch, seq_len, grid.num_heads, grid.head_dim).transpose(1, 2)
        q4 = q4.contiguous()
        k4 = torch.randn(batch, grid.num_kv_heads, seq_len, grid.head_dim, dtype=dtype,
                         device=device)  # fmt: skip
        v4 = torch.randn_like(k4)
        paged_args = (query, kc, vc, tables, cu, lens, scale)
        candidates = {
            "pagedserve": lambda a=paged_args, n=seq_len: kernels.paged_prefill_attention(
                *a, target.backend, max_query_len=n
            ),
            "sdpa_contiguous": lambda q=q4, k=k4, v=v4: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            ),
        }
        working_set = (kc.numel() + vc.numel() + 2 * query.numel()) * elem
        row: dict[str, Any] = {"batch": batch, "seq_len": seq_len, "flops": flops,
                               "working_set_bytes": working_set,
                               "l2_resident": working_set < target.l2_bytes}  # fmt: skip
        for name, fn in candidates.items():
            try:
                seconds = _bench(fn, target)
            except Exception as exc:
                print(f"  {name} failed at seq_len={seq_len}: {exc!r}")
                continue
            row[name] = {"ms": seconds * 1e3, "TFLOPs": flops / seconds / 1e12}
        print(
            f"prefill b={batch:3d} len={seq_len:5d} "
            + " ".join(f"{n}={row[n]['TFLOPs']:.3g}TFLOP/s" for n in candidates if n in row)
        )
        rows.append(row)
        del kc, vc, k4, v4
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot(results: dict, path: Path) -> bool:
    """Draw ``results`` to ``path``; False (and nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    decode = results["decode"]
    for batch in sorted({r["batch"] for r in decode}):
        pts = [r for r in decode if r["batch"] == batch]
        for name, style in (("pagedserve", "-o"), ("sdpa_contiguous", "--x"), ("flashinfer", ":s")):
            xs = [r["context"] for r in pts if name in r]
            ys = [r[name]["fraction_of_peak"] for r in pts if name in r]
            if xs:
                ax1.plot(xs, ys, style, label=f"{name} b={batch}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("context length (tokens)")
    ax1.set_ylabel("fraction of peak memory bandwidth")
    ax1.set_title("paged decode")
    ax1.legend(fontsize=6, ncol=2)
    prefill = results["prefill"]
    for name, style in (("pagedserve", "-o"), ("sdpa_contiguous", "--x")):
        xs = [r["seq_len"] for r in prefill if name in r]
        ys = [r[name]["TFLOPs"] for r in prefill if name in r]
        if xs:
            ax2.plot(xs, ys, style, label=name)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("prompt length (tokens, ~16k tokens per batch)")
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("causal prefill")
    ax2.legend()
    fig.suptitle(results["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every other grid point")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU tensors, Triton under the interpreter")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    if args.cpu_smoke:
        # Read when the Triton kernels are first imported (the first Triton call, below).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        grid = SMOKE_GRID
        target = Target(torch.device("cpu"), "triton", SMOKE_L2_BYTES, warmup=1, iters=1)
        device_name = "cpu (Triton interpreter)"
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        grid = GPU_GRID
        target = Target(device, "auto", l2_bytes(device), warmup=5, iters=20)
        device_name = torch.cuda.get_device_name(device)
    else:
        print("No GPU present: skipping the kernel benchmark (--cpu-smoke runs it on CPU).")
        return 0
    from pagedserve.kernels.common_triton import compute_in_fp32

    results = {
        "device": device_name,
        "dtype": args.dtype,
        "backend": target.backend,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        # False: the kernels upcast to fp32 before tl.dot (the interpreter's bf16 path).
        "native_16bit_dot": not compute_in_fp32(dtype),
        "l2_bytes": target.l2_bytes,
        "shape": {
            "num_heads": grid.num_heads,
            "num_kv_heads": grid.num_kv_heads,
            "head_dim": grid.head_dim,
            "block_size": grid.block_size,
        },
        "decode": bench_decode(grid, target, dtype, args.quick),
        "prefill": bench_prefill(grid, target, dtype, args.quick),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "kernels.png"
    results["plot"] = str(png) if plot(results, png) else None
    (args.out / "kernels.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out / 'kernels.json'}"
          + (f" and {png}" if results["plot"] else " (no plot: matplotlib not installed)"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
