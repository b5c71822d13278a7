"""Swap or recompute? Time both for one preempted sequence, by context length.

For each model and context length L this measures, on the real worker code:

* swap: pack the sequence's ceil(L / block_size) blocks (``kernels.gather_blocks``), stream
  them to a host block store running as its own process (``pagedserve host-store``, gRPC
  on loopback), stream them back and scatter them (``kernels.scatter_blocks``): swap-out +
  swap-in, what a swap preemption costs;
* recompute: one prefill of L tokens (what a recompute preemption costs when the sequence
  resumes).

It plots both against L, marks the crossover, and measures gRPC loopback bandwidth against
a plain in-process copy of the same bytes, by chunk size. Models: SmolLM2-135M-Instruct
(the default model) and a synthetic Llama with Llama-2-7B's layer shape (hidden 4096, 32
heads, MHA, head_dim 128, MLP 11008) but 2 layers and a 4096-token vocabulary, random
weights: the per-layer ratio of KV bytes to prefill FLOPs of a 7B model.

Usage::

    .venv/bin/python benchmarks/memory/preemption.py                      # full sweep
    .venv/bin/python benchmarks/memory/preemption.py --lengths 64,256,1024 --models smollm2

Writes ``benchmarks/results/preemption.json`` and ``preemption.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.swap_client import HostStoreClient
from pagedserve.worker.worker import Worker

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK_SIZE = 16


def synthetic_llama(folder: Path, max_len: int) -> Path:
    """A random Llama with Llama-2-7B's layer shape, 2 layers (fp32 safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=max(max_len + 16, 4096),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().save_pretrained(folder, safe_serialization=True)
    return folder


def start_store(swap_gib: float) -> tuple[subprocess.Popen, str]:
    """``pagedserve host-store`` in its own process on a free loopback port."""
    cmd = [sys.executable, "-m", "pagedserve.cluster.cli", "host-store", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--swap-space", str(swap_gib)], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    return proc, line.split(" on ")[1].split(",")[0]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_model(name: str, model_dir: str, lengths: list[int], address: str, repeats: int):
    max_len = max(lengths)
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=model_dir, max_model_len=max_len + 1),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=-(-max_len // BLOCK_SIZE) + 1),
            device="cpu",
            num_threads=os.cpu_count() or 1,
        )
    )
    worker.connect_host_store(address)
    runner = worker.runner
    swapper, client = runner.swapper, runner.swapper.client
    assert client is not None
    block_bytes = worker.get_info().block_bytes
    rows = []
    for length in lengths:
        n = -(-length // BLOCK_SIZE)
        ids = list(range(n))

        def swap_out() -> None:
            client.swap_out(f"out-{length}", swapper.pack(ids), ids)  # noqa: B023

        def swap_in() -> None:
            buf = swapper.host_buffer(n)  # noqa: B023
            client.swap_in(f"in-{length}", ids, buf)  # noqa: B023
            swapper.unpack(ids, buf)  # noqa: B023

        out_s = median_time(swap_out, repeats)
        in_s = median_time(swap_in, repeats)
        client.free(ids)
        prefill = statistics.median(
            runner.measure_prefill_s_per_token(length) * length for _ in range(repeats)
        )
        row = {
            "model": name,
            "context_len": length,
            "num_blocks": n,
            "swap_bytes": n * block_bytes,
            "swap_out_s": out_s,
            "swap_in_s": in_s,
            "swap_s": out_s + in_s,
            "recompute_s": prefill,
        }
        rows.append(row)
        print(
            f"{name:>10} L={length:5d}: swap {row['swap_s'] * 1e3:8.1f} ms "
            f"({n * block_bytes / 2**20:6.1f} MiB)  recompute {prefill * 1e3:8.1f} ms",
            flush=True,
        )
    return rows, block_bytes


def crossover(rows: list[dict]) -> float | None:
    """The context length where swap and recompute cost the same (log-log interpolation
    between the two measured lengths around the first sign change), or None."""
    for a, b in itertools.pairwise(rows):
        da = math.log(a["swap_s"]) - math.log(a["recompute_s"])
        db = math.log(b["swap_s"]) - math.log(b["recompute_s"])
        if da == 0:
            return float(a["context_len"])
        if (da > 0) != (db > 0):
            t = da / (da - db)
            la, lb = math.log(a["context_len"]), math.log(b["context_len"])
            return math.exp(la + t * (lb - la))
    return None


def bandwidth(address: str, num_bytes: int, chunks: list[int], repeats: int) -> list[dict]:
    """gRPC loopback swap-out / swap-in bandwidth by chunk size vs an in-process copy."""
    per_block = 64 << 10
    n = num_bytes // per_block
    src = torch.randn(n, 1, 2, 16, 8, 64)  # 64 KiB fp32 blocks
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), repeats)
    out = []
    ids = list(range(n))
    for chunk in chunks:
        with HostStoreClient(address, max_chunk_bytes=chunk) as client:
            out_s = median_time(lambda c=client: c.swap_out("bw", src, ids), repeats)
            in_s = median_time(lambda c=client: c.swap_in("bw", ids, dst), repeats)
            client.free(ids)
        row = {
            "chunk_bytes": chunk,
            "payload_bytes": n * per_block,
            "swap_out_gbps": n * per_block / out_s / 1e9,
            "swap_in_gbps": n * per_block / in_s / 1e9,
            "copy_gbps": n * per_block / copy_s / 1e9,
        }
        row["ratio_out"] = row["swap_out_gbps"] / row["copy_gbps"]
        row["ratio_in"] = row["swap_in_gbps"] / row["copy_gbps"]
        out.append(row)
        print(
            f"chunk {chunk >> 10:6d} KiB: out {row['swap_out_gbps']:.2f} GB/s, in "
            f"{row['swap_in_gbps']:.2f} GB/s, copy {row['copy_gbps']:.2f} GB/s "
            f"({row['ratio_out']:.0%} / {row['ratio_in']:.0%})",
            flush=True,
        )
    return out


def plot(rows: list[dict], crossings: dict[str, float | None], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"smollm2": "tab:blue", "llama7b-2l": "tab:red"}
    notes = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        xs = [r["context_len"] for r in mine]
        c = colors.get(model)
        ax.plot(xs, [r["swap_s"] for r in mine], "o-", color=c, label=f"{model}: swap out + in")
        ax.plot(xs, [r["recompute_s"] for r in mine], "s--", color=c, label=f"{model}: recompute")
        x = crossings.get(model)
        if x is None:
            cheaper = "swap" if mine[0]["swap_s"] < mine[0]["recompute_s"] else "recompute"
            notes.append(f"{model}: no crossover in range ({cheaper} cheaper throughout)")
        else:
            ax.axvline(x, color=c, alpha=0.4, linestyle=":")
            ax.annotate(f"crossover ~{x:.0f}", (x, ax.get_ylim()[0]), color=c, rotation=90,
                        va="bottom", ha="right")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("seconds per preempted sequence")
    ax.set_title("Preemption cost: swap to host over gRPC vs recompute (CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if notes:
        ax.text(0.99, 0.02, "\n".join(notes), transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--models", default="smollm2,llama7b-2l")
    ap.add_argument(
        "--synthetic-lengths", default=None, help="lengths for llama7b-2l (default: --lengths)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-mib", type=int, default=64)
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads((RESULTS / "preemption.json").read_text())
        plot(saved["rows"], saved["crossover_context_len"], RESULTS / "preemption.png")
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    RESULTS.mkdir(exist_ok=True)
    proc, address = start_store(swap_gib=4.0)
    try:
        bw = bandwidth(address, args.bandwidth_mib << 20, [64 << 10, 1 << 20, 8 << 20], 3)
        rows: list[dict] = []
        block_bytes = {}
        with tempfile.TemporaryDirectory() as tmp:
            for model in args.models.split(","):
                mine = lengths
                if model == "smollm2":
                    folder = str(resolve_model("default", progress=False))
                else:
                    if args.synthetic_lengths:
                        mine = [int(x) for x in args.synthetic_lengths.split(",")]
                    folder = str(synthetic_llama(Path(tmp) / model, max(mine)))
                r, bb = measure_model(model, folder, mine, address, args.repeats)
                rows += r
                block_bytes[model] = bb
    finally:
        proc.terminate()
        proc.wait(30)
    crossings = {
        m: crossover([r for r in rows if r["model"] == m]) for m in dict.fromkeys(block_bytes)
    }
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu_count": os.cpu_count(),
        "block_size": BLOCK_SIZE,
        "block_bytes": block_bytes,
        "rows": rows,
        "crossover_context_len": crossings,
        "bandwidth": bw,
    }
    (RESULTS / "preemption.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, crossings, RESULTS / "preemption.png")
    print("\n| model | context | KV MiB | swap out + in (ms) | recompute (ms) | cheaper |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cheaper = "swap" if r["swap_s"] < r["recompute_s"] else "recompute"
        print(
            f"| {r['model']} | {r['context_len']} | {r['swap_bytes'] / 2**20:.1f} | "
            f"{r['swap_s'] * 1e3:.1f} | {r['recompute_s'] * 1e3:.1f} | {cheaper} |"
        )
    print(f"\ncrossover: {crossings}")


if __name__ == "__main__":
    main()
