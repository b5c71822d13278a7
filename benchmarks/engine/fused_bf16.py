"""Decode steps of a bf16 model on the fused CPU forward (all layers in one C call) against
the per-layer forward (``PAGEDSERVE_FUSED_LAYERS=0``), with the fp32 model's fused forward
alongside, interleaved in one process (timings on a shared machine swing: only same-run
ratios mean something).

Three in-process engines (the real :class:`Scheduler` and :class:`Worker`, as
``ceiling.py``'s :class:`DecodeEngine`), each holding ``B`` greedy requests of
``--prompt-len`` random tokens, prefilled first; then ``--rounds`` rounds of ``--steps``
timed decode steps each (schedule + execute + update; median per round), engine after
engine. KV caches in each model's own dtype (``auto``: bf16 for the bf16 model). Decode
steps of ``B <= 32`` rows run below the oneDNN crossover (16 rows) only for ``B < 16``: at
``B >= 16`` the fused forward hands the step to the per-layer path (``runs_fused``), so the
two bf16 columns should then agree. A fourth engine runs the bf16 fused call on every
step (``per_layer_from=None``: the packed kernel at every M, as once oneDNN is dropped).

Writes ``benchmarks/results/fused_bf16.json``.

Usage::

    .venv/bin/python benchmarks/engine/fused_bf16.py --batches 1,16,32 --prompt-len 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

from ceiling import DecodeEngine, time_call

from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.worker import Worker

RESULTS = Path(__file__).resolve().parents[1] / "results"


def make_worker(
    model_dir: str, dtype: str, fused: bool, threads: int, max_len: int, blocks: int
) -> Worker:
    """A CPU worker for sequences of up to ``max_len`` tokens; ``fused=False`` builds it
    under ``PAGEDSERVE_FUSED_LAYERS=0``."""
    saved = os.environ.get("PAGEDSERVE_FUSED_LAYERS")
    os.environ["PAGEDSERVE_FUSED_LAYERS"] = "1" if fused else "0"
    try:
        return Worker(
            WorkerConfig(
                model=ModelConfig(model=model_dir, dtype=dtype, max_model_len=max_len),
                cache=CacheConfig(num_blocks=blocks),
                device="cpu",
                num_threads=threads,
            )
        )
    finally:
        if saved is None:
            del os.environ["PAGEDSERVE_FUSED_LAYERS"]
        else:
            os.environ["PAGEDSERVE_FUSED_LAYERS"] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "fused_bf16.json"))
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model, progress=False))
    batches = [int(b) for b in args.batches.split(",")]
    # Sequences as long as the prompt and every decode step (the scheduler reserves a
    # request's whole length); blocks of 16 tokens for the largest batch.
    max_len = args.prompt_len + (args.rounds + 1) * args.steps + 8
    blocks = max(batches) * -(-max_len // 16) + 16
    configs = {
        "bf16_fused": ("bfloat16", True),
        "bf16_layers": ("bfloat16", False),
        "fp32_fused": ("float32", True),
    }
    workers = {
        name: make_worker(model_dir, dtype, fused, args.threads, max_len, blocks)
        for name, (dtype, fused) in configs.items()
    }
    # The fused forward on every step, large ones included (per_layer_from=None): the packed
    # kernel where oneDNN would run, what remains once oneDNN is dropped.
    always = make_worker(model_dir, "bfloat16", True, args.threads, max_len, blocks)
    model = always.runner.model
    model.use_forward(dataclasses.replace(model.model_forward, per_layer_from=None))
    workers["bf16_fused_always"] = always
    forwards = {name: w.runner.model.model_forward.name for name, w in workers.items()}
    kv = {name: str(w.runner.kv_pool.dtype) for name, w in workers.items()}
    print("forwards:", forwards, "kv:", kv)
    rows = []
    for batch in batches:
        engines = {name: DecodeEngine(w, batch, args.prompt_len) for name, w in workers.items()}
        for engine in engines.values():
            engine.step()  # warm up
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(time_call(engine.step, args.steps))
        for engine in engines.values():
            engine.close()
        ms = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
        row = {
            "batch": batch,
            **{f"{name}_ms": value for name, value in ms.items()},
            "bf16_layers_over_fused": round(ms["bf16_layers"] / ms["bf16_fused"], 3),
            "fp32_fused_over_bf16_fused": round(ms["fp32_fused"] / ms["bf16_fused"], 3),
            "bf16_layers_over_fused_always": round(ms["bf16_layers"] / ms["bf16_fused_always"], 3),
        }
        rows.append(row)
        print(
            f"batch {batch:>3}: bf16 fused {ms['bf16_fused']:7.2f} ms, bf16 per-layer "
            f"{ms['bf16_layers']:7.2f} ms ({row['bf16_layers_over_fused']:.3f}x), fp32 fused "
            f"{ms['fp32_fused']:7.2f} ms ({row['fp32_fused_over_bf16_fused']:.3f}x), bf16 "
            f"fused on every step {ms['bf16_fused_always']:7.2f} ms "
            f"({row['bf16_layers_over_fused_always']:.3f}x)",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "forwards": forwards, "kv_dtypes": kv, "rows": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
