"""Capacity and throughput under KV pressure at one ``--kv-cache-memory``: fp32 vs bf16 KV.

One KV memory budget (default: what ``--ref-blocks 96`` fp32 blocks of the model take at
``--block-size 16``; bytes per block ``2 * layers * block_size * kv_heads * head_dim *
itemsize``, from the model's config.json) is given to ``pagedserve serve
--kv-cache-memory BYTES`` once per ``--kv-cache-dtypes`` entry, with the same ``--dtype``
(each of ``--dtypes``), and the seeded pressure workload of ``pressure.py`` (prompts of
10..200 ids, 4..64 greedy output tokens, 30% cancelled) runs against each server,
interleaved (round 1: fp32, bf16; round 2: fp32, bf16; ...). Per run: the server's
``num_blocks`` (checked against ``BYTES // bytes_per_block``: bf16 must hold exactly 2x the
fp32 blocks), peak and mean requests running (GetStats sampled every ``--sample-s``),
preemptions and recomputed tokens, output tokens/s, TTFT p50/p99 and pressure.py's leak
check. Ratios bf16 / fp32 are per round (adjacent runs), so a busy machine skews them less
than the absolute figures. Writes ``benchmarks/results/kv_dtype.json`` (or ``--out``) and
``kv_dtype.png`` beside it when matplotlib imports. Flags after ``--`` go to ``pagedserve
serve``.

Usage::

    .venv/bin/python benchmarks/memory/kv_dtype.py                      # fp32 model, 2 rounds
    .venv/bin/python benchmarks/memory/kv_dtype.py --dtypes float32,bfloat16
    .venv/bin/python benchmarks/memory/kv_dtype.py --kv-cache-dtypes bfloat16,fp8,int8
    .venv/bin/python benchmarks/memory/kv_dtype.py --num-requests 64 --concurrency 32  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pressure.py
from pressure import RESULTS, make_workload, run_workload, server

from pagedserve.cluster.client import Client

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
# int8 stores each (token, KV head) vector's fp32 scale after its head_dim elements.
SCALE_BYTES = {"int8": 4}


@dataclass(frozen=True)
class KVShape:
    """The per-token KV shape of a model: layers, KV heads and head size (from config.json)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KVShape:
        """From an HF config dict (``head_dim`` when given, else ``hidden_size // heads``).

        Raises:
            KeyError: when the config lacks the layer or head counts.
        """
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
        )


def bytes_per_block(shape: KVShape, block_size: int, kv_dtype: str) -> int:
    """Bytes of one KV block over all layers, K and V: ``2 * L * bs * Hkv * D * itemsize``
    (``D * 1 + 4`` per head vector for int8: its scale; the worker's ``kv_pool.bytes_per_block``).

    Raises:
        ValueError: for a ``kv_dtype`` not in ``ITEMSIZE`` or ``block_size < 1``.
    """
    if kv_dtype not in ITEMSIZE:
        raise ValueError(f"kv_dtype must be one of {sorted(ITEMSIZE)}, got {kv_dtype!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    head = shape.head_dim * ITEMSIZE[kv_dtype] + SCALE_BYTES.get(kv_dtype, 0)
    per_token = shape.num_layers * shape.num_kv_heads * head
    return 2 * block_size * per_token


def expected_blocks(budget: int, shape: KVShape, block_size: int, kv_dtype: str) -> int:
    """Blocks a ``budget``-byte pool holds: ``budget // bytes_per_block``."""
    return budget // bytes_per_block(shape, block_size, kv_dtype)


def run_order(model_dtypes: list[str], kv_dtypes: list[str], rounds: int) -> list[tuple]:
    """``(model_dtype, round, kv_dtype)`` in run order: per model dtype, the KV dtypes
    alternate within each round so that every bf16 run sits next to an fp32 one."""
    return [(m, r, kv) for m in model_dtypes for r in range(rounds) for kv in kv_dtypes]


def serve_flags(budget: int, model_dtype: str, kv_dtype: str, extra: list[str]) -> list[str]:
    """``pagedserve serve`` flags of one run (the pool sized by bytes, not blocks)."""
    return [
        "--kv-cache-memory", str(budget),
        "--dtype", model_dtype,
        "--kv-cache-dtype", kv_dtype,
        *extra,
    ]  # fmt: skip


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    for t in items:
        if t not in ITEMSIZE:
            raise argparse.ArgumentTypeError(f"not a dtype: {t!r} (one of {sorted(ITEMSIZE)})")
    return items


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--model-config", default=None, help="config.json (default: the cached SmolLM2)"
    )
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: ref-blocks)")
    ap.add_argument("--ref-blocks", type=int, default=96, help="budget = this many fp32 blocks")
    ap.add_argument("--kv-cache-dtypes", type=_csv, default=["float32", "bfloat16"])
    ap.add_argument("--dtypes", type=_csv, default=["float32"], help="model --dtype per run set")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--sample-s", type=float, default=0.25, help="GetStats sampling period")
    ap.add_argument("--server-log", default="/tmp/pagedserve-kv-dtype-server.log")
    ap.add_argument("--out", default=str(RESULTS / "kv_dtype.json"))
    return ap


def resolve_budget(args: argparse.Namespace, shape: KVShape) -> int:
    """``--kv-cache-memory``, else ``--ref-blocks`` fp32 blocks' bytes.

    Raises:
        ValueError: when the budget holds no block of some requested KV dtype.
    """
    budget = args.kv_cache_memory
    if budget is None:
        budget = args.ref_blocks * bytes_per_block(shape, args.block_size, "float32")
    for kv in args.kv_cache_dtypes:
        if expected_blocks(budget, shape, args.block_size, kv) < 1:
            raise ValueError(f"{budget} bytes hold no {kv} block of {args.block_size} tokens")
    return int(budget)


def _sample_running(address: str, period_s: float, stop: threading.Event, out: list) -> None:
    with Client(address, timeout_s=30) as c:
        while not stop.is_set():
            s = c.stats()
            out.append((s["num_requests_running"], s["num_requests_waiting"]))
            stop.wait(period_s)


def one_run(
    args: argparse.Namespace, flags: list[str], reqs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Start a server with ``flags``, warm it up, run the workload while sampling GetStats."""
    sargs = argparse.Namespace(**{**vars(args), "num_blocks": None})
    with server(sargs, flags) as address:
        with Client(address, timeout_s=600) as c:
            c.generate(token_ids=reqs[0]["prompt_ids"][:16], max_tokens=4, temperature=0)
            worker = c.stats()["workers"][0]
        samples: list[tuple[int, int]] = []
        stop = threading.Event()
        th = threading.Thread(
            target=_sample_running, args=(address, args.sample_s, stop, samples), daemon=True
        )
        th.start()
        try:
            res = run_workload(address, reqs, args.concurrency)
        finally:
            stop.set()
            th.join(timeout=30)
    running = [r for r, _ in samples]
    res.update(
        {
            "num_blocks": worker["num_blocks"],
            "server_dtype": worker["dtype"],
            "server_kv_cache_dtype": worker["kv_cache_dtype"],
            "running_peak": max(running) if running else None,
            "running_mean": statistics.fmean(running) if running else None,
            "waiting_mean": statistics.fmean(w for _, w in samples) if samples else None,
            "num_samples": len(samples),
        }
    )
    return res


RATIO_KEYS = ("num_blocks", "running_peak", "running_mean", "output_tokens_per_s")


def summarize(runs: list[dict[str, Any]], base: str, other: str) -> list[dict[str, Any]]:
    """Per (model dtype, round): ``other / base`` of ``RATIO_KEYS`` and TTFT p50."""
    out = []
    key = {(r["dtype"], r["round"], r["kv_cache_dtype"]): r for r in runs}
    for (m, rnd, kv), b in key.items():
        o = key.get((m, rnd, other))
        if kv != base or o is None:
            continue
        row: dict[str, Any] = {"dtype": m, "round": rnd}
        for k in (*RATIO_KEYS, "ttft_p50_s"):
            bv, ov = b["result"].get(k), o["result"].get(k)
            row[f"{k}_ratio"] = ov / bv if bv and ov is not None else None
        out.append(row)
    return out


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result["runs"]
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    labels = [f"{short[r['dtype']]}/{short[r['kv_cache_dtype']]} r{r['round'] + 1}" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (k, title) in zip(
        axes,
        [
            ("num_blocks", "KV blocks"),
            ("running_mean", "mean requests running"),
            ("output_tokens_per_s", "output tok/s"),
        ],
        strict=True,
    ):
        colors = ["C0" if r["kv_cache_dtype"] == "float32" else "C1" for r in runs]
        ax.bar(range(len(runs)), [r["result"][k] or 0 for r in runs], color=colors)
        ax.set_xticks(range(len(runs)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(title)
    fig.suptitle(f"--kv-cache-memory {result['kv_cache_memory']} B (model/KV dtype, round)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    args = build_parser().parse_args(argv)
    cfg_path = args.model_config
    if cfg_path is None:
        from pagedserve.worker.model_store import fetch_default_model

        cfg_path = str(fetch_default_model() / "config.json")
    shape = KVShape.from_config(json.loads(Path(cfg_path).read_text()))
    budget = resolve_budget(args, shape)
    reqs = make_workload(args.num_requests, args.seed, args.cancel_share)
    result: dict[str, Any] = {
        "args": vars(args),
        "server_flags": extra,
        "kv_shape": vars(shape),
        "kv_cache_memory": budget,
        "bytes_per_block": {
            kv: bytes_per_block(shape, args.block_size, kv) for kv in args.kv_cache_dtypes
        },
        "expected_blocks": {
            kv: expected_blocks(budget, shape, args.block_size, kv) for kv in args.kv_cache_dtypes
        },
        "load_avg_before": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "runs": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for m, rnd, kv in run_order(args.dtypes, args.kv_cache_dtypes, args.rounds):
        res = one_run(args, serve_flags(budget, m, kv, extra), reqs)
        res["num_blocks_expected"] = result["expected_blocks"][kv]
        run = {"dtype": m, "round": rnd, "kv_cache_dtype": kv, "result": res}
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        out.write_text(json.dumps(result, indent=2))  # partial results survive a timeout
    result["blocks_match_expected"] = all(
        r["result"]["num_blocks"] == r["result"]["num_blocks_expected"] for r in result["runs"]
    )
    result["leak_free"] = all(r["result"]["leak_free"] for r in result["runs"])
    if len(args.kv_cache_dtypes) >= 2:
        base, other = args.kv_cache_dtypes[0], args.kv_cache_dtypes[1]
        result["ratios"] = {
            "of": f"{other} / {base}",
            "rows": summarize(result["runs"], base, other),
        }
    result["load_avg_after"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=2))
    if plot(result, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.png')}")
    print(json.dumps(result.get("ratios"), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
