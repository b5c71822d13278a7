"""Benchmark the paged-attention kernels on a GPU.

Decode: achieved memory bandwidth of :func:`pagedserve.kernels.paged_decode_attention`
(bytes of K/V + Q read and O written, divided by time) for batch 1..256 and context
512..32k, as a fraction of the GPU's peak bandwidth, next to torch SDPA on a contiguous
cache and FlashInfer's paged decode when ``flashinfer`` is importable.
Prefill: TFLOP/s of :func:`pagedserve.kernels.paged_prefill_attention` (causal, full
prefill) next to torch SDPA ``is_causal=True`` on contiguous tensors.

Writes ``benchmarks/results/kernels.json`` and ``benchmarks/results/kernels.png``.
Without CUDA it says so, runs a tiny CPU smoke of the torch backend, and exits 0.

Usage: ``python benchmarks/kernels/kernels.py [--quick] [--dtype fp16|bf16] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve import kernels

# Model shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = [1, 4, 16, 64, 256]
CONTEXTS = [512, 2048, 8192, 32768]
PREFILL_LENS = [512, 1024, 2048, 4096, 8192]
MAX_CACHE_BYTES = 24 * 2**30  # skip decode points whose K+V exceed this
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


def _bench(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median seconds per call (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _peak_bandwidth(device: torch.device) -> tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value, "nominal"
    # Unknown GPU: use a large device-to-device copy (read + write) as the peak.
    buf = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    seconds = _bench(lambda: dst.copy_(buf), warmup=2, iters=10)
    return 2 * buf.numel() / seconds, "measured copy"


def _paged_setup(batch: int, context: int, dtype: torch.dtype, device: torch.device):
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return key_cache, value_cache, block_tables, seq_lens


def _flashinfer_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """A callable running FlashInfer's paged decode on the same cache, or None."""
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
        last = seq_lens - (blocks - 1) * BLOCK_SIZE
        wrapper.plan(
            indptr,
            block_tables.reshape(-1).contiguous(),
            last.to(torch.int32),
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            sm_scale=scale,
            data_type=query.dtype,
        )
        return lambda: wrapper.run(query, (key_cache, value_cache))
    except Exception as exc:  # FlashInfer API differences must not stop the benchmark
        print(f"  flashinfer skipped: {exc!r}")
        return None


def bench_decode(device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    peak, peak_kind = _peak_bandwidth(device)
    elem = torch.finfo(dtype).bits // 8
    scale = HEAD_DIM**-0.5
    rows = []
    batches = BATCHES[::2] if quick else BATCHES
    contexts = CONTEXTS[::2] if quick else CONTEXTS
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
            if kv_bytes > MAX_CACHE_BYTES:
                continue
            kc, vc, tables, lens = _paged_setup(batch, context, dtype, device)
            query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
            io_bytes = kv_bytes + 2 * query.numel() * elem
            ws = kernels.DecodeWorkspace(batch, NUM_HEADS, HEAD_DIM, device=device)
            row = {"batch": batch, "context": context, "bytes": io_bytes}

            def paged(q=query, kc=kc, vc=vc, tables=tables, lens=lens, ws=ws, context=context):
                return kernels.paged_decode_attention(
                    q, kc, vc, tables, lens, scale, max_seq_len=context, workspace=ws
                )

            candidates = {"pagedserve": paged}
            # SDPA baseline: the same K/V already contiguous per sequence.
            k_dense = torch.randn(
                batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device=device
            )
            v_dense = torch.randn_like(k_dense)
            q4 = query.unsqueeze(2)
            candidates["sdpa_contiguous"] = lambda q4=q4, k=k_dense, v=v_dense: (
                F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            )
            fi = _flashinfer_decode(query, kc, vc, tables, lens, scale)
            if fi is not None:
                candidates["flashinfer"] = fi
            for name, fn in candidates.items():
                try:
                    seconds = _bench(fn)
                except Exception as exc:
                    print(f"  {name} failed at batch={batch} context={context}: {exc!r}")
                    continue
                bandwidth = io_bytes / seconds
                row[name] = {
                    "ms": seconds * 1e3,
                    "GBps": bandwidth / 1e9,
                    "fraction_of_peak": bandwidth / peak,
                }
            print(
                f"decode b={batch:4d} ctx={context:6d} "
                + " ".join(
                    f"{n}={row[n]['GBps']:.0f}GB/s({row[n]['fraction_of_peak']:.0%})"
                    for n in candidates
                    if n in row
                )
            )
            rows.append(row)
            del kc, vc, k_dense, v_dense
            torch.cuda.empty_cache()
    for row in rows:
        row["peak_GBps"] = peak / 1e9
        row["peak_kind"] = peak_kind
    return rows


def bench_prefill(device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    scale = HEAD_DIM**-0.5
    rows = []
    for seq_len in PREFILL_LENS[::2] if quick else PREFILL_LENS:
        batch = max(1, 16384 // seq_len)
        kc, vc, tables, lens = _paged_setup(batch, seq_len, dtype, device)
        total = batch * seq_len
        query = torch.randn(total, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
        cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=device)
        # Causal attention: QK^T and PV over the lower triangle, 2 FLOPs per MAC.
        flops = 4 * batch * NUM_HEADS * HEAD_DIM * seq_len * (seq_len + 1) / 2
        q4 = query.view(batch, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        k4 = torch.randn(batch, NUM_KV_HEADS, seq_len, HEAD_DIM, dtype=dtype, device=device)
        v4 = torch.randn_like(k4)
        paged_args = (query, kc, vc, tables, cu, lens, scale)
        candidates = {
            "pagedserve": lambda a=paged_args, n=seq_len: kernels.paged_prefill_attention(
                *a, max_query_len=n
            ),
            "sdpa_contiguous": lambda q=q4, k=k4, v=v4: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            ),
        }
        row = {"batch": batch, "seq_len": seq_len, "flops": flops}
        for name, fn in candidates.items():
            try:
                seconds = _bench(fn, warmup=3, iters=10)
            except Exception as exc:
                print(f"  {name} failed at seq_len={seq_len}: {exc!r}")
                continue
            row[name] = {"ms": seconds * 1e3, "TFLOPs": flops / seconds / 1e12}
        print(
            f"prefill b={batch:3d} len={seq_len:5d} "
            + " ".join(f"{n}={row[n]['TFLOPs']:.1f}TFLOP/s" for n in candidates if n in row)
        )
        rows.append(row)
        del kc, vc, k4, v4
        torch.cuda.empty_cache()
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

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


def cpu_smoke() -> None:
    """A few-ms decode through the torch backend, to show the API works here."""
    kc = torch.randn(64, BLOCK_SIZE, 3, 64)
    vc = torch.randn_like(kc)
    tables = torch.arange(64, dtype=torch.int32).view(4, 16)
    lens = torch.tensor([256, 100, 17, 1], dtype=torch.int32)
    query = torch.randn(4, 9, 64)
    kernels.paged_decode_attention(query, kc, vc, tables, lens, 0.125)  # warm-up
    start = time.perf_counter()
    out = kernels.paged_decode_attention(query, kc, vc, tables, lens, 0.125)
    ms = (time.perf_counter() - start) * 1e3
    print(f"CPU smoke: torch-backend paged decode {tuple(out.shape)} in {ms:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every other grid point")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No GPU present: skipping the kernel benchmark.")
        cpu_smoke()
        return 0
    device = torch.device("cuda")
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    results = {
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "decode": bench_decode(device, dtype, args.quick),
        "prefill": bench_prefill(device, dtype, args.quick),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "kernels.png")
    print(f"wrote {args.out / 'kernels.json'} and {args.out / 'kernels.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
