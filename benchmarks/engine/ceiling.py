"""The matmul ceiling: pagedserve's decode throughput as a fraction of its GEMMs alone.

For each batch size B, two things are timed in the same process, interleaved and repeated
(this machine's timings swing with other load, so only same-run ratios are meaningful):

* **ceiling**: the model's matmuls alone for one decode step: for every layer the fused
  qkv, o, fused gate/up and down projections, plus the LM head, as ``F.linear`` on the
  model's own weights with ``B`` rows (``torch``, the same thread count). ``B / time`` is
  the most tokens/s a decode step of this model can reach with these GEMMs;
* **packed ceiling**: the same matmuls on the engine's own packed GEMM
  (:mod:`pagedserve.worker.packed_linear`; absent when the engine runs on ``F.linear``),
  the ceiling of the engine as built;
* **engine**: real decode steps of the in-process engine (the real :class:`Scheduler` and
  :class:`Worker`, no Ray/gRPC): ``B`` greedy requests of ``--prompt-len`` random tokens,
  prefilled first, then ``--steps`` decode steps timed (schedule + execute + update);
* **bf16-KV engine** (``--kv-cache-dtype both``): the same engine with a bf16 KV cache
  (fp32 weights), its decode steps timed in the same rounds as the fp32 engine's.

Reports tokens/s of each and the engine's fraction of each ceiling, and writes
``benchmarks/results/ceiling.json``.

Usage::

    .venv/bin/python benchmarks/engine/ceiling.py --batches 1,2,4,8,16,32,64
    .venv/bin/python benchmarks/engine/ceiling.py --batches 1,32 --prompt-len 512 \
        --kv-cache-dtype both
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model import LlamaForCausalLM
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.packed_linear import PackedLinear, packed_logits
from pagedserve.worker.weights import load_model
from pagedserve.worker.worker import Worker

RESULTS = Path(__file__).resolve().parents[1] / "results"


def linear_weights(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight [out, in], bias)`` of every matmul of one decode step, in model order."""
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            out.append((lin.weight, lin.bias))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    out.append((head, None))
    return out


def matmul_step(
    weights: list[tuple[torch.Tensor, torch.Tensor | None]], batch: int
) -> Callable[[], None]:
    """A closure running every matmul of one decode step on ``batch`` random rows."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w, _ in weights}

    @torch.inference_mode()
    def run() -> None:
        for w, b in weights:
            F.linear(inputs[w.shape[1]], w, b)

    return run


def packed_step(model: LlamaForCausalLM, batch: int) -> Callable[[], None] | None:
    """A closure running the packed matmuls of one decode step on ``batch`` random rows,
    or ``None`` when ``model`` is not packed."""
    layers: list[PackedLinear] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    if not all(isinstance(lin, PackedLinear) for lin in layers):
        return None
    inputs = {lin.in_features: torch.randn(batch, lin.in_features) for lin in layers}
    hidden = torch.randn(batch, model.arch.hidden_size)

    @torch.inference_mode()
    def run() -> None:
        for lin in layers:
            lin(inputs[lin.in_features])
        if model.packed_head is not None:
            packed_logits(hidden, model.packed_head, model.arch.vocab_size)
        else:
            model.lm_head(hidden)

    return run


class DecodeEngine:
    """The in-process engine holding ``batch`` decoding requests (see module docstring)."""

    def __init__(self, worker: Worker, batch: int, prompt_len: int, seed: int = 0) -> None:
        info = worker.get_info()
        self.worker = worker
        self.sched = Scheduler(
            SchedulerConfig(
                max_model_len=info.max_model_len,
                max_num_seqs=max(batch, 1),
                max_num_batched_tokens=max(2048, batch * prompt_len),
                async_scheduling=False,
            ),
            [WorkerSpec(0, info.num_blocks, info.block_size)],
        )
        self.steps = self.tokens = 0
        self.engine = EngineLoop(
            self.sched, {0: InlineWorker(worker.execute_model)}, self._count, on_step=self._stepped
        )
        self.aio = asyncio.new_event_loop()
        rng = random.Random(seed)
        sampling = SamplingParams(max_tokens=info.max_model_len - prompt_len, ignore_eos=True,
                                  temperature=0)  # fmt: skip
        for i in range(batch):
            prompt = [rng.randrange(3, info.vocab_size) for _ in range(prompt_len)]
            self.sched.add_request(
                EngineRequest(f"b{batch}-{i}", prompt, sampling, info.eos_token_ids)
            )
        while any(s.num_computed_tokens == 0 for s in self.sched.sequences.values()):
            self.step()  # prefill

    def _count(self, outputs: list) -> None:
        self.tokens += len(outputs)

    def _stepped(self, worker_id: int, so: object, ro: object) -> None:
        self.steps += 1

    def step(self) -> int:
        """One step of the engine loop; returns the number of tokens it produced."""
        target, before = self.steps + 1, self.tokens
        self.aio.run_until_complete(self.engine.run_until_idle(lambda: self.steps >= target))
        return self.tokens - before

    def close(self) -> None:
        for rid in list(self.sched.requests):
            self.sched.abort_request(rid)
        self.step()  # sends the finished ids so the worker forgets them
        self.aio.close()


def time_call(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "both"),
                    help="both: also time an engine with a bf16 KV cache")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "ceiling.json"))
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model, progress=False))

    def make_worker(kv_cache_dtype: str) -> Worker:
        return Worker(
            WorkerConfig(
                model=ModelConfig(model=model_dir),
                cache=CacheConfig(num_blocks=2048, kv_cache_dtype=kv_cache_dtype),
                device="cpu",
                num_threads=args.threads,
            )
        )

    worker = make_worker("float32")
    bf16_worker = make_worker("bfloat16") if args.kv_cache_dtype == "both" else None
    runner = worker.runner
    # The torch ceiling needs the row-major weights, which a packed engine no longer holds.
    plain = load_model(runner.model_path, runner.arch, runner.max_model_len, torch.float32,
                       torch.device("cpu"))  # fmt: skip
    weights = linear_weights(plain)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        mm = matmul_step(weights, batch)
        packed = packed_step(runner.model, batch)
        engine = DecodeEngine(worker, batch, args.prompt_len)
        bf16 = None if bf16_worker is None else DecodeEngine(bf16_worker, batch, args.prompt_len)
        mm_s, pk_s, eng_s, bf16_s = [], [], [], []
        mm()
        if packed is not None:
            packed()
        engine.step()
        if bf16 is not None:
            bf16.step()
        for _ in range(args.rounds):  # interleaved: ceilings, engine, ceilings, engine, ...
            mm_s.append(time_call(mm, args.steps))
            if packed is not None:
                pk_s.append(time_call(packed, args.steps))
            eng_s.append(time_call(engine.step, args.steps))
            if bf16 is not None:
                bf16_s.append(time_call(bf16.step, args.steps))
        engine.close()
        if bf16 is not None:
            bf16.close()
        ceiling = batch / statistics.median(mm_s)
        decode = batch / statistics.median(eng_s)
        row = {
            "batch": batch,
            "matmul_ms": round(1e3 * statistics.median(mm_s), 2),
            "step_ms": round(1e3 * statistics.median(eng_s), 2),
            "ceiling_tok_s": round(ceiling, 1),
            "decode_tok_s": round(decode, 1),
            "fraction": round(decode / ceiling, 3),
        }
        line = f"batch {batch:>3}: torch matmuls {row['matmul_ms']:7.1f} ms ({ceiling:7.1f} tok/s)"
        if pk_s:
            pk_ceiling = batch / statistics.median(pk_s)
            row.update(
                packed_matmul_ms=round(1e3 * statistics.median(pk_s), 2),
                packed_ceiling_tok_s=round(pk_ceiling, 1),
                packed_fraction=round(decode / pk_ceiling, 3),
            )
            line += f"  packed {row['packed_matmul_ms']:7.1f} ms ({pk_ceiling:7.1f} tok/s)"
        line += f"  decode step {row['step_ms']:7.1f} ms ({decode:7.1f} tok/s)"
        line += f" = {100 * row['fraction']:.0f}% of torch's ceiling"
        if pk_s:
            line += f", {100 * row['packed_fraction']:.0f}% of the packed one"
        if bf16_s:
            row["bf16kv_step_ms"] = round(1e3 * statistics.median(bf16_s), 2)
            row["bf16kv_speedup"] = round(row["step_ms"] / row["bf16kv_step_ms"], 3)
            line += f"; bf16 KV step {row['bf16kv_step_ms']:7.1f} ms"
            line += f" ({row['bf16kv_speedup']:.2f}x the fp32-KV step)"
        rows.append(row)
        print(line, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": args.model,
        "threads": args.threads,
        "torch": torch.__version__,
        "prompt_len": args.prompt_len,
        "load_avg": os.getloadavg(),
        "rows": rows,
    }
    out.write_text(json.dumps(meta, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
