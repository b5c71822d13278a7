"""Where one engine step's time goes: scheduling, input preparation, attention, matmuls,
other model ops, sampling, detokenization, and (with ``--ray``) the Ray call.

Runs the real :class:`Scheduler` and :class:`Worker` in process on the serving benchmark's
chat prompts (greedy, ``ignore_eos``), all submitted at once, through the engine loop that
serves (:class:`EngineLoop`) over an :class:`InlineWorker`, serial: each step is scheduled,
executed and applied in turn on this thread, so the parts add up to the step (the
overlapped loop that serves by default runs scheduling beside the forward; this script
measures what each part costs, not what overlap hides). It times each part of every step
with ``perf_counter`` wrappers (on CPU every op is synchronous, so wall time per part is
exact; the wrappers cost ~1 us each):

* ``schedule`` / ``update``: :meth:`Scheduler.schedule` / :meth:`Scheduler.update`;
* ``input_prep``: ``prepare_inputs`` (flattening the step into tensors);
* ``matmuls``: every ``nn.Linear`` (or packed linear) of the model plus the LM head;
* ``attention``: the paged-attention call of every layer (K/V store + attention; with the
  fused CPU kernels, the rotary + K/V store pass and the attention kernel);
* ``other_model``: the rest of the forward (embedding, RMSNorm, rotary, SiLU, adds);
* ``sampling``: the sampler; ``runner_other``: the rest of ``execute_model``;
* ``loop``: the engine loop itself, from the worker's answer to ``update``;
* ``detokenize``: the frontend's incremental detokenizer over the step's new tokens (the
  loop's sink);
* ``ray_call`` (``--ray``): round trip of an actor call carrying this step's
  SchedulerOutput and RunnerOutput, measured apart on a no-op actor.

The model runs its layers one Python call per kernel (``PAGEDSERVE_FUSED_LAYERS=0``, set
here unless given) so the timers see each part; serving calls all layers in one C call,
which saves the Python between the kernels (``other_model`` here over-counts that).

Reports the first (prefill) step and the mean decode step at full batch, writes
``benchmarks/results/profile.json``. ``--backend torch`` builds the worker with
``attention_backend="torch"``: the torch reference forward (the code before the fused CPU
kernels and the packed GEMM, which apply only to ``auto``/``cpu``) for a same-run comparison
with ``auto``; ``PAGEDSERVE_CPU_GEMM=0`` in the environment runs ``auto`` on ``F.linear``.
Each run reports the forward the runner chose (``model.model_forward.name``).
``--kv-cache-dtype both`` runs each backend with an fp32 and a bf16 KV cache (fp32 weights
both times), ``--rounds`` times over, interleaved; ``--prompt-len N`` replaces the chat
prompts by ``N`` random token ids each (a long context: batch 1 with ``N = 512`` makes the
first step one 512-token prefill).

Usage::

    .venv/bin/python benchmarks/engine/profile_step.py --num-requests 32 --max-tokens 64 --backend both
    .venv/bin/python benchmarks/engine/profile_step.py --num-requests 1 --prompt-len 512 \
        --max-tokens 32 --kv-cache-dtype both --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoTokenizer

import pagedserve.worker.cpu_forward as cpu_forward_mod
import pagedserve.worker.model as model_mod
import pagedserve.worker.model_runner as runner_mod
from pagedserve.cluster.detokenizer import IncrementalDetokenizer
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.packed_linear import PackedLinear
from pagedserve.worker.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads.py
from workloads import PROMPTS

RESULTS = Path(__file__).resolve().parents[1] / "results"
PARTS = ("schedule", "input_prep", "matmuls", "attention", "other_model", "sampling",
         "runner_other", "loop", "update", "detokenize")  # fmt: skip


class Timers:
    """Accumulated seconds per part for the current step."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[part] += time.perf_counter() - start

        return timed


def instrument(worker: Worker, timers: Timers) -> None:
    """Install the timing wrappers (see the module docstring) on ``worker``'s runner."""
    runner = worker.runner
    model = runner.model
    runner_mod.prepare_inputs = timers.wrap("input_prep", runner_mod.prepare_inputs)
    model_mod.paged_attention = timers.wrap("attention", model_mod.paged_attention)
    # The CPU forwards (pagedserve.worker.cpu_forward) call the fused kernels through
    # that module's cpu_native: give it a copy with the attention kernels timed.
    native = cpu_forward_mod.cpu_native
    timed_native = SimpleNamespace(
        **{k: getattr(native, k) for k in dir(native) if not k.startswith("__")}
    )
    for name in ("paged_attention", "rope_store"):
        setattr(timed_native, name, timers.wrap("attention", getattr(native, name)))
    cpu_forward_mod.cpu_native = timed_native  # type: ignore[assignment]
    # The LM head is a plain F.linear in the model module: give that module a timed F.
    model_mod.F = SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    model_mod.F.linear = timers.wrap("matmuls", F.linear)
    model_mod.packed_logits = timers.wrap("matmuls", model_mod.packed_logits)
    starts: dict[int, float] = {}

    def pre(mod: nn.Module, _args: Any) -> None:
        starts[id(mod)] = time.perf_counter()

    def post(mod: nn.Module, _args: Any, _out: Any) -> None:
        timers.acc["matmuls"] += time.perf_counter() - starts.pop(id(mod))

    for mod in model.modules():
        if isinstance(mod, (nn.Linear, PackedLinear)):
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
    model.forward = timers.wrap("forward", model.forward)
    runner.sampler = timers.wrap("sampling", runner.sampler)


def prompts(args: argparse.Namespace, tok: Any, vocab_size: int) -> list[list[int]]:
    """The run's prompt ids: the chat prompts, or ``--prompt-len`` random ids each."""
    if args.prompt_len:
        rng = random.Random(0)
        return [
            [rng.randrange(3, vocab_size) for _ in range(args.prompt_len)]
            for _ in range(args.num_requests)
        ]
    out = []
    for i in range(args.num_requests):
        chat = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def run(
    args: argparse.Namespace, backend: str, kv_dtype: str, tok: Any, model_dir: str
) -> dict[str, Any]:
    """Profile one full run with ``backend`` and a ``kv_dtype`` KV cache; returns
    per-phase mean ms per part.

    ``torch`` is the code before the fused CPU kernels and the packed GEMM (``F.linear``).
    """
    torch.manual_seed(0)
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=model_dir),
            cache=CacheConfig(num_blocks=2048, kv_cache_dtype=kv_dtype),
            device="cpu",
            num_threads=args.threads,
            attention_backend=backend,  # the runner picks its forward for it, once
        )
    )
    timers = Timers()
    instrument(worker, timers)
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(max_model_len=info.max_model_len, async_scheduling=False),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    detoks = {}
    for i, ids in enumerate(prompts(args, tok, info.vocab_size)):
        sched.add_request(EngineRequest(f"r{i}", ids, sampling, info.eos_token_ids))
        detoks[f"r{i}"] = IncrementalDetokenizer(tok.backend_tokenizer)
    steps: list[dict[str, float]] = []
    texts: dict[str, list[int]] = defaultdict(list)
    marks: dict[str, float] = {}
    counted = {"tokens": 0}
    schedule, update = sched.schedule, sched.update

    def timed_schedule(wid: int) -> Any:
        timers.acc.clear()
        marks["t0"] = time.perf_counter()  # the step starts when the loop plans it
        try:
            return schedule(wid)
        finally:
            marks["t1"] = time.perf_counter()

    def timed_execute(so: SchedulerOutput) -> RunnerOutput:
        try:
            return worker.execute_model(so)
        finally:
            marks["t2"] = time.perf_counter()

    def timed_update(*a: Any) -> Any:
        marks["t2u"] = time.perf_counter()
        try:
            return update(*a)
        finally:
            marks["t3"] = time.perf_counter()

    def sink(outs: list[SequenceOutput]) -> None:
        for o in outs:
            detoks[o.request_id].step(o.new_token_ids, final=o.finish_reason is not None)
            texts[o.request_id].extend(o.new_token_ids)
        counted["tokens"] += len(outs)

    def stepped(_wid: int, so: SchedulerOutput, _ro: RunnerOutput) -> None:
        t4 = time.perf_counter()  # update applied, its deltas sunk (detokenized)
        t0, t1, t2, t3 = marks["t0"], marks["t1"], marks["t2"], marks["t3"]
        acc = dict(timers.acc)
        forward = acc.pop("forward", 0.0)
        row = {k: acc.get(k, 0.0) for k in PARTS}
        row["other_model"] = forward - row["matmuls"] - row["attention"]
        row["runner_other"] = (t2 - t1) - row["input_prep"] - forward - row["sampling"]
        row["schedule"] = t1 - t0
        row["loop"] = marks["t2u"] - t2  # the engine loop between the answer and update
        row["update"] = t3 - marks["t2u"]
        row["detokenize"] = t4 - t3
        row["step_total"] = t4 - t0
        row["num_tokens"] = so.total_num_scheduled_tokens
        row["num_seqs"] = len(so.num_scheduled_tokens)
        steps.append(row)

    sched.schedule = timed_schedule  # type: ignore[method-assign]
    sched.update = timed_update  # type: ignore[method-assign]
    engine = EngineLoop(sched, {0: InlineWorker(timed_execute)}, sink, on_step=stepped)
    start_all = time.perf_counter()
    asyncio.run(engine.run_until_idle())
    tokens = counted["tokens"]
    wall = time.perf_counter() - start_all
    prefill = steps[0]
    decode = [s for s in steps[1:] if s["num_seqs"] == args.num_requests]

    def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
        out = {k: round(1e3 * statistics.mean(r[k] for r in rows), 3) for k in PARTS}
        out["step_total"] = round(1e3 * statistics.mean(r["step_total"] for r in rows), 3)
        return out

    return {
        "backend": backend,
        "kv_cache_dtype": kv_dtype,
        "model_forward": worker.runner.model.model_forward.name,
        "tokens_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 3),
        "prefill_step_ms": summarize([prefill]),
        "prefill_tokens": prefill["num_tokens"],
        "decode_step_ms": summarize(decode),
        "decode_batch": args.num_requests,
        "decode_steps": len(decode),
        "greedy_tokens": {k: v[:8] for k, v in sorted(texts.items())[:2]},
    }


def ray_round_trip(num_seqs: int, reps: int = 50) -> float:
    """Median ms of an actor call carrying a ``num_seqs`` decode SchedulerOutput both ways."""
    import ray

    from pagedserve.scheduler.outputs import CachedSequenceData, RunnerOutput, SchedulerOutput

    for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    class Echo:
        def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
            return RunnerOutput(so.step_id, {s: 1 for s in so.num_scheduled_tokens}, 0.0)

    actor = ray.remote(Echo).options(num_cpus=0).remote()
    so = SchedulerOutput(
        step_id=1,
        cached_seqs=[CachedSequenceData(f"r{i}/0", 3, [], 40) for i in range(num_seqs)],
        num_scheduled_tokens={f"r{i}/0": 1 for i in range(num_seqs)},
    )
    ray.get(actor.execute_model.remote(so))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        ray.get(actor.execute_model.remote(so))
        times.append(time.perf_counter() - t)
    ray.shutdown()
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "both"))
    ap.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16", "both"))
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=0,
        help="random prompts of this many tokens (0: the chat prompts)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat every configuration")
    ap.add_argument("--ray", action="store_true", help="also time a Ray actor round trip")
    ap.add_argument("--out", default=str(RESULTS / "profile.json"))
    args = ap.parse_args()
    # The timers wrap the per-kernel Python calls, which the one-call layer path
    # (cpu_native.decoder_layers) skips: profile the per-layer path, same kernels and bits.
    os.environ.setdefault("PAGEDSERVE_FUSED_LAYERS", "0")
    model_dir = str(resolve_model(args.model, progress=False))
    tok = AutoTokenizer.from_pretrained(model_dir)
    backends = ("torch", "auto") if args.backend == "both" else (args.backend,)
    kv_dtypes = ("float32", "bfloat16") if args.kv_cache_dtype == "both" else (args.kv_cache_dtype,)
    runs = [
        run(args, b, kv, tok, model_dir)
        for _ in range(args.rounds)
        for b in backends
        for kv in kv_dtypes
    ]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": args.model,
        "threads": args.threads,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "load_avg": os.getloadavg(),
        "runs": runs,
    }
    if args.ray:
        result["ray_call_ms"] = round(ray_round_trip(args.num_requests), 3)
    for r in runs:
        print(f"backend={r['backend']} kv={r['kv_cache_dtype']} (forward: "
              f"{r['model_forward']}): {r['tokens_per_s']} tok/s, prefill "
              f"{r['prefill_tokens']} tokens")  # fmt: skip
        for phase in ("prefill_step_ms", "decode_step_ms"):
            d = r[phase]
            parts = "  ".join(f"{k} {d[k]:.1f}" for k in PARTS)
            print(f"  {phase}: total {d['step_total']:.1f} | {parts}")
    if args.ray:
        print(f"ray call round trip ({args.num_requests} seqs): {result['ray_call_ms']} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
