"""What paging buys in the real engine: requests in flight and throughput at a fixed KV budget.

The real ``Scheduler`` and the real ``Worker`` (SmolLM2 fp32 on CPU, no Ray or gRPC, as
``engine/engine_inprocess.py``) run the same requests with the same number of KV token slots in
three admission modes of the same scheduler (``SchedulerConfig.admission_reserve``, also
``pagedserve serve --reserve``):

* ``none``: paged, blocks as sequences grow, preemption by recompute when the pool runs dry;
* ``max_tokens``: a request is admitted only when prompt + max_tokens fits (reserved);
* ``max_model_len``: it reserves max_model_len (capped at the pool), as the pre-paging
  systems did.

for each block size in ``--block-sizes``. Requests are greedy chat questions and documents
(``serving/serving.py``'s generator, ``common/workloads.py``, seeded) with a client-style ``max_tokens`` cap (``--max-tokens``)
and stop at EOS, so actual outputs are shorter than the cap, as in real traffic. All are
submitted at once; ``--repeats`` runs each mode again and keeps the median. Reported per
run: output tokens/s, steps, requests in flight (running
sequences per step: mean, time-weighted mean and peak), KV pool usage (blocks held) and
utilisation (tokens computed / slots held), blocks reserved (held + owed), preemptions, and
ratios paged / reserve. Writes ``benchmarks/results/capacity.json`` and ``capacity.png``.

Usage::

    .venv/bin/python benchmarks/memory/capacity.py --quick
    .venv/bin/python benchmarks/memory/capacity.py            # budget 4096 slots, block 8/16/32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pagedserve.scheduler.config import ADMISSION_RESERVES, SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads.py
from workloads import serving_workload

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run_one(
    worker: Worker,
    reqs: list[dict[str, Any]],
    reserve: str,
    max_tokens: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    """Serve ``reqs`` to completion in one admission mode; per-step occupancy figures."""
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(
            max_model_len=info.max_model_len,
            max_num_seqs=max_num_seqs,
            admission_reserve=reserve,
            admission="fits-now",  # paged = admit by current need (vLLM's rule), as measured
            enable_prefix_caching=False,  # only the admission policy differs between runs
            async_scheduling=False,
        ),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    ws = sched.workers[0]
    bs, nb = info.block_size, info.num_blocks
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for r in reqs:
        cap = min(max_tokens, info.max_model_len - len(r["prompt_ids"]))
        s = sampling if cap == max_tokens else SamplingParams(max_tokens=cap, temperature=0.0)
        sched.add_request(EngineRequest(r["id"], r["prompt_ids"], s, info.eos_token_ids))
    running, held, reserved, util, dts = [], [], [], [], []
    tokens = 0
    lengths: dict[str, int] = {}
    last = start = time.perf_counter()

    def sink(outs: list) -> None:
        nonlocal tokens
        for o in outs:
            tokens += len(o.new_token_ids)
            if o.finish_reason is not None:
                lengths[o.request_id] = o.num_output_tokens

    def on_step(wid: int, so: Any, ro: Any) -> None:
        """After each step: its time (schedule, execute, update) and the pool's state."""
        nonlocal last
        dts.append(time.perf_counter() - last)
        running.append(len(so.num_scheduled_tokens))
        used = nb - ws.kv.num_free_blocks
        live = sum(s.num_computed_tokens for s in ws.running)
        owed = 0
        if reserve != "none":
            for s in ws.running:
                want = s.max_total_tokens if reserve == "max_tokens" else info.max_model_len
                owed += min(-(-want // bs), nb) - len(ws.kv.get_block_ids(s.seq_id))
        held.append(used / nb)
        reserved.append((used + owed) / nb)
        util.append(live / (used * bs) if used else 0.0)
        last = time.perf_counter()  # the next step's time starts after this bookkeeping

    engine = EngineLoop(sched, {0: InlineWorker(worker.execute_model)}, sink, on_step=on_step)
    asyncio.run(engine.run_until_idle())
    wall = time.perf_counter() - start
    total_dt = sum(dts) or 1.0
    return {
        "reserve": reserve,
        "block_size": bs,
        "num_blocks": nb,
        "steps": len(running),
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "running_mean": round(statistics.mean(running), 2),
        "running_time_weighted": round(sum(r * d for r, d in zip(running, dts)) / total_dt, 2),
        "running_peak": max(running),
        "kv_held_mean": round(statistics.mean(held), 3),
        "kv_reserved_mean": round(statistics.mean(reserved), 3),
        "kv_utilisation_mean": round(statistics.mean(util), 3),
        "preemptions": sched.num_preemptions,
        "output_len_mean": round(statistics.mean(lengths.values()), 1),
        "running_trace": running,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of tok/s and requests in flight per mode and block size; running over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ADMISSION_RESERVES if any(r["reserve"] == m for r in rows)]
    sizes = sorted({r["block_size"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        for ax, key in ((axes[0], "output_tok_s"), (axes[1], "running_time_weighted")):
            vals = [
                next((r[key] for r in rows if r["reserve"] == m and r["block_size"] == b), 0)
                for b in sizes
            ]
            ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=m)
    for ax, title in ((axes[0], "output tokens/s"), (axes[1], "requests in flight (mean)")):
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(sizes))])
        ax.set_xticklabels([f"block {b}" for b in sizes])
        ax.set_title(title)
        ax.legend(title="reserve", fontsize=8)
    mid = sizes[len(sizes) // 2]
    for m in modes:
        r = next(r for r in rows if r["reserve"] == m and r["block_size"] == mid)
        axes[2].plot(r["running_trace"], label=m)
    axes[2].set(xlabel="step", ylabel="running requests", title=f"in flight (block {mid})")
    axes[2].legend(title="reserve", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, block 16")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--kv-slots", type=int, default=4096, help="KV budget in token slots")
    ap.add_argument("--max-tokens", type=int, default=512, help="each request's cap")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--block-sizes", default="8,16,32")
    ap.add_argument("--modes", default=",".join(ADMISSION_RESERVES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode; the median is kept")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "capacity.json"))
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.kv_slots, args.max_tokens = 8, 1024, 64
        args.max_model_len, args.block_sizes = 256, "16"
    from transformers import AutoTokenizer

    model_dir = str(resolve_model(args.model, progress=True))
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = serving_workload(tok, args.num_requests, args.seed, args.max_model_len, quick=True)
    rows = []
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        worker = Worker(
            WorkerConfig(
                model=ModelConfig(model=model_dir, max_model_len=args.max_model_len),
                cache=CacheConfig(block_size=bs, num_blocks=args.kv_slots // bs),
                device="cpu",
                num_threads=args.threads,
            )
        )
        for mode in args.modes.split(","):
            runs = []
            for _ in range(args.repeats):
                runs.append(run_one(worker, reqs, mode, args.max_tokens, args.max_num_seqs))
            # Steps and occupancy repeat exactly; wall time is what a busy machine varies.
            row = sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]
            row["output_tok_s_runs"] = [r["output_tok_s"] for r in runs]
            rows.append(row)
            print(
                f"block {bs:>2} reserve {mode:<13} {row['output_tok_s']:7.1f} tok/s  in flight "
                f"mean {row['running_time_weighted']:5.1f} peak {row['running_peak']:>3}  KV "
                f"held {row['kv_held_mean']:.2f} reserved {row['kv_reserved_mean']:.2f} "
                f"util {row['kv_utilisation_mean']:.2f}  preempt {row['preemptions']:>3}  "
                f"{row['steps']} steps {row['wall_s']} s",
                flush=True,
            )
        del worker
    ratios = {}
    for r in rows:
        if r["reserve"] == "none":
            continue
        paged = next(
            p for p in rows if p["reserve"] == "none" and p["block_size"] == r["block_size"]
        )
        ratios[f"block{r['block_size']}_paged_over_{r['reserve']}"] = {
            "tok_s": round(paged["output_tok_s"] / r["output_tok_s"], 2),
            "in_flight": round(paged["running_time_weighted"] / r["running_time_weighted"], 2),
        }
    for k, v in ratios.items():
        print(f"{k}: throughput x{v['tok_s']}, requests in flight x{v['in_flight']}")
    md = [
        "| block size | reserve | output tok/s | in flight (mean / peak) | KV held | KV reserved "
        "| KV utilisation | preemptions | steps | paged / this (tok/s, in flight) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = f"block{r['block_size']}_paged_over_{r['reserve']}"
        ratio = f"{ratios[k]['tok_s']}x, {ratios[k]['in_flight']}x" if k in ratios else "1x"
        md.append(
            f"| {r['block_size']} | {r['reserve']} | {r['output_tok_s']:.1f} | "
            f"{r['running_time_weighted']:.1f} / {r['running_peak']} | {r['kv_held_mean']:.2f} | "
            f"{r['kv_reserved_mean']:.2f} | {r['kv_utilisation_mean']:.2f} | "
            f"{r['preemptions']} | {r['steps']} | {ratio} |"
        )
    print("\n" + "\n".join(md))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "machine": f"{platform.node()}, {os.cpu_count()} cores, load avg "
                f"{os.getloadavg()[0]:.2f} at the end",
                "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "model": model_dir,
                "settings": {
                    k: getattr(args, k)
                    for k in (
                        "num_requests",
                        "kv_slots",
                        "max_tokens",
                        "max_model_len",
                        "max_num_seqs",
                        "seed",
                        "repeats",
                        "threads",
                    )
                },
                "prompt_tokens": [len(r["prompt_ids"]) for r in reqs],
                "ratios": ratios,
                "markdown": "\n".join(md),
                "rows": rows,
            },
            indent=2,
        )
    )
    png = out.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
