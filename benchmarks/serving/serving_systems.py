"""One serving system under load, in its own process: the worker side of ``serving.py``.

``serving.py`` writes a spec (the model folder, the requests as token ids, the scenarios'
arrival times) and starts this script once per system, under the interpreter that system
needs (vLLM runs from its own venv), so that memory and threads are the system's alone:

    python benchmarks/serving/serving_systems.py SYSTEM SPEC.json OUT.json

SYSTEM is ``pagedserve`` (the real gRPC server, embedded Ray, one worker), ``hf-cb``
(transformers' continuous batching manager, the engine behind ``generate_batch``, with a
``max_new_tokens`` per request), ``hf-static`` (``generate`` on static batches in arrival
order, left-padded; offline only) or ``vllm`` (``AsyncLLM`` of vLLM's CPU build; its
settings come from the environment: ``VLLM_CPU_KVCACHE_SPACE``,
``VLLM_CPU_NUM_OF_RESERVED_CPU``).

Every request is greedy with ``ignore_eos`` semantics (an EOS token is emitted and
generation goes on), so each produces exactly its ``max_tokens``. For each scenario
(offline: all arrivals at 0; online: Poisson arrivals) and each repeat, OUT.json records
per request: arrival, the time of every output token (seconds from the scenario's start,
a delta carrying k tokens stamps all k with its arrival time), the finish time and the
token ids. Only the standard library is imported at module level.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

Record = dict[str, Any]

# This folder holds kernels.py, and transformers probes for a PyPI package named "kernels":
# keep the script's own folder off the import path so that probe does not find ours.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _record(req: dict[str, Any], arrival: float) -> Record:
    return {"id": req["id"], "arrival": arrival, "times": [], "token_ids": [], "finish": None}


def _warmup_request(spec: dict[str, Any]) -> dict[str, Any]:
    return {"id": "warmup", "prompt_ids": spec["requests"][0]["prompt_ids"][:32], "max_tokens": 4}


# ---------------------------------------------------------------------- pagedserve
def run_pagedserve(spec: dict[str, Any]) -> dict[str, Any]:
    """The real gRPC server (embedded Ray, one worker with all cores), streamed to an
    :class:`AsyncClient` (one channel) on the frontend's event loop."""
    import asyncio

    from pagedserve.cluster.client import AsyncClient, Client
    from pagedserve.cluster.config import (
        CacheConfig,
        ClusterConfig,
        ModelConfig,
        SchedulerConfig,
        ServerConfig,
    )
    from pagedserve.cluster.launcher import RAY_ENV, start_cluster

    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=spec["model_dir"], max_model_len=spec["max_model_len"]),
        cache=CacheConfig(kv_cache_memory=spec["kv_cache_bytes"]),
        scheduler=SchedulerConfig(),
        server=ServerConfig(port=0),
        cpus_per_worker=os.cpu_count() or 1,
    )
    t_load = time.perf_counter()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    handle = asyncio.run_coroutine_threadsafe(start_cluster(config), loop).result()
    address = handle.address

    async def one(c: AsyncClient, req: dict[str, Any], rec: Record, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + rec["arrival"] - time.perf_counter()))
        async for d in c.stream(
            token_ids=req["prompt_ids"],
            max_tokens=req["max_tokens"],
            temperature=0,
            ignore_eos=True,
        ):
            now = time.perf_counter() - t0
            rec["times"].extend([now] * len(d.token_ids))
            rec["token_ids"].extend(d.token_ids)
        rec["finish"] = time.perf_counter() - t0

    async def run_all(reqs: list[dict[str, Any]], recs: list[Record], t0: float) -> None:
        # One channel for all streams, on the frontend's own event loop: like vLLM's
        # AsyncLLM below, the load generator costs no thread per request.
        async with AsyncClient(address, timeout_s=3600) as c:
            await asyncio.gather(*(one(c, q, r, t0) for q, r in zip(reqs, recs, strict=True)))

    def scenario(reqs: list[Any], arrivals: list[float]) -> tuple[list[Record], dict[str, Any]]:
        recs = [_record(r, a) for r, a in zip(reqs, arrivals, strict=True)]
        usage: list[float] = []
        running: list[int] = []
        done = threading.Event()

        def poll() -> None:
            with Client(address, timeout_s=30) as c:
                while not done.wait(0.5):
                    st = c.stats()
                    w = st["workers"][0]
                    usage.append(1 - w["num_free_blocks"] / w["num_blocks"])
                    running.append(st["num_requests_running"])

        poller = threading.Thread(target=poll, daemon=True)
        t0 = time.perf_counter()
        poller.start()
        asyncio.run_coroutine_threadsafe(run_all(reqs, recs, t0), loop).result()
        done.set()
        poller.join(timeout=10)
        kv = {
            "kv_usage_mean": sum(usage) / len(usage) if usage else 0.0,
            "kv_usage_peak": max(usage, default=0.0),
            "running_mean": sum(running) / len(running) if running else 0.0,
            "running_peak": max(running, default=0),
        }
        return recs, kv

    def reset() -> None:
        # Blocks of the last run's requests are freed a step after their last output.
        deadline = time.perf_counter() + 30
        while not asyncio.run_coroutine_threadsafe(_reset_prefix_cache(), loop).result(30):
            if time.perf_counter() > deadline:
                raise RuntimeError("the prefix cache could not be reset: blocks still in use")
            time.sleep(0.05)

    async def _reset_prefix_cache() -> bool:
        return bool(await handle.scheduler.reset_prefix_cache.remote())

    try:
        w = _warmup_request(spec)
        with Client(address, timeout_s=600) as c:
            c.generate(token_ids=w["prompt_ids"], max_tokens=w["max_tokens"], temperature=0)
        load_s = time.perf_counter() - t_load
        return _run_scenarios(spec, scenario, load_s, reset)
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)


# ---------------------------------------------------------------------- HF transformers
def _hf_model(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    return model.eval()


def run_hf_cb(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers' ContinuousBatchingManager (what ``generate_batch`` drives)."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    t_load = time.perf_counter()
    model = _hf_model(spec)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(spec["max_tokens_all"]))
    # Its default takes 90% of free memory for KV; give it the others' KV budget instead
    # (a block is page_size tokens of every layer's K and V).
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    cb = ContinuousBatchingConfig()
    cb.num_blocks = max(1, spec["kv_cache_bytes"] // (cb.page_size * per_token))
    managers = [
        model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    ]
    managers[0].start()

    def reset() -> None:
        # It shares prompt blocks between requests and has no call that forgets them: a
        # fresh manager (a new KV cache) per run, so no run reuses an earlier run's prompts.
        managers[0].stop(block=True, timeout=30)
        managers[0] = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb
        )
        managers[0].start()

    def submit(req: dict[str, Any], rid: str) -> None:
        managers[0].add_request(
            req["prompt_ids"],
            request_id=rid,
            max_new_tokens=req["max_tokens"],
            record_timestamps=True,
            eos_token_id=-1,  # ignore EOS: generate exactly max_new_tokens
        )

    def collect(n: int, deadline_s: float) -> dict[str, Any]:
        results: dict[str, Any] = {}
        end = time.perf_counter() + deadline_s
        while len(results) < n and time.perf_counter() < end:
            out = managers[0].get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
        return results

    w = _warmup_request(spec)
    submit(w, "warmup")
    collect(1, 600)
    load_s = time.perf_counter() - t_load
    counter = [0]

    def scenario(reqs: list[Any], arrivals: list[float]) -> tuple[list[Record], dict[str, Any]]:
        counter[0] += 1
        recs = [_record(r, a) for r, a in zip(reqs, arrivals, strict=True)]
        ids = [f"s{counter[0]}-{r['id']}" for r in reqs]
        t0 = time.perf_counter()

        def submitter() -> None:
            for req, rec, rid in zip(reqs, recs, ids, strict=True):
                time.sleep(max(0.0, t0 + rec["arrival"] - time.perf_counter()))
                submit(req, rid)

        th = threading.Thread(target=submitter, daemon=True)
        th.start()
        results = collect(len(recs), spec["timeout_s"])
        th.join(timeout=10)
        for rec, rid in zip(recs, ids, strict=True):
            out = results.get(rid)
            if out is None:
                continue
            rec["token_ids"] = list(out.generated_tokens)
            rec["times"] = [t - t0 for t in (out.timestamps or [])]
            rec["finish"] = rec["times"][-1] if rec["times"] else None
        return recs, {}

    try:
        return _run_scenarios(spec, scenario, load_s, reset)
    finally:
        managers[0].stop(block=True, timeout=30)


def run_hf_static(spec: dict[str, Any]) -> dict[str, Any]:
    """``generate`` on static batches of ``hf_batch_size`` in arrival order (left padding).

    A batch decodes until its longest member is done; each request keeps its own
    ``max_tokens`` (the rest is the waste static batching pays). Offline only.
    """
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    t_load = time.perf_counter()
    model = _hf_model(spec)
    pad = spec["pad_token_id"]

    class StepClock(StoppingCriteria):
        """Records the time of every decode step; never stops generation."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(batch: list[dict[str, Any]]) -> tuple[list[list[int]], list[float]]:
        width = max(len(r["prompt_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["prompt_ids"])
            ids[i, width - n :] = torch.tensor(r["prompt_ids"])
            mask[i, width - n :] = 1
        clock = StepClock()
        n_new = max(r["max_tokens"] for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n_new,
                eos_token_id=None,  # ignore EOS: decode n_new tokens
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        toks = out[:, width:].tolist()
        return [t[: r["max_tokens"]] for t, r in zip(toks, batch, strict=True)], clock.times

    model.generation_config.eos_token_id = None
    generate([_warmup_request(spec)])
    load_s = time.perf_counter() - t_load
    bs = spec["hf_batch_size"]

    def scenario(reqs: list[Any], arrivals: list[float]) -> tuple[list[Record], dict[str, Any]]:
        if any(a > 0 for a in arrivals):
            raise ValueError("hf-static runs the offline scenario only")
        recs = [_record(r, a) for r, a in zip(reqs, arrivals, strict=True)]
        t0 = time.perf_counter()
        for i in range(0, len(recs), bs):
            batch = reqs[i : i + bs]
            toks, times = generate(batch)
            for rec, t, req in zip(recs[i : i + bs], toks, batch, strict=True):
                rec["token_ids"] = t
                rec["times"] = [x - t0 for x in times[: req["max_tokens"]]]
                # The batch ends together: a short request's answer returns with the batch.
                rec["finish"] = times[-1] - t0
        return recs, {}

    return _run_scenarios(spec, scenario, load_s)


# ---------------------------------------------------------------------- vLLM
def run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's CPU build through ``AsyncLLM`` (engine core in its own process)."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    t_load = time.perf_counter()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=spec["model_dir"],
            dtype="float32",
            max_model_len=spec["max_model_len"],
            seed=0,
            disable_log_stats=True,
        )
    )
    loop = asyncio.new_event_loop()
    counter = [0]

    async def one(req: dict[str, Any], rec: Record, rid: str, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + rec["arrival"] - time.perf_counter()))
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=req["max_tokens"],
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            detokenize=True,
        )
        async for out in engine.generate({"prompt_token_ids": req["prompt_ids"]}, sp, rid):
            now = time.perf_counter() - t0
            new = list(out.outputs[0].token_ids)
            rec["times"].extend([now] * len(new))
            rec["token_ids"].extend(new)
        rec["finish"] = time.perf_counter() - t0

    async def run_all(reqs: list[dict[str, Any]], recs: list[Record]) -> None:
        counter[0] += 1
        t0 = time.perf_counter()
        await asyncio.gather(
            *(one(q, r, f"s{counter[0]}-{q['id']}", t0) for q, r in zip(reqs, recs, strict=True))
        )

    def scenario(reqs: list[Any], arrivals: list[float]) -> tuple[list[Record], dict[str, Any]]:
        recs = [_record(r, a) for r, a in zip(reqs, arrivals, strict=True)]
        loop.run_until_complete(asyncio.wait_for(run_all(reqs, recs), spec["timeout_s"]))
        return recs, {}

    def reset() -> None:
        if not loop.run_until_complete(engine.reset_prefix_cache()):
            raise RuntimeError("vLLM refused to reset its prefix cache")

    try:
        w = _warmup_request(spec)
        loop.run_until_complete(run_all([w], [_record(w, 0.0)]))
        load_s = time.perf_counter() - t_load
        return _run_scenarios(spec, scenario, load_s, reset)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- driver
def _run_scenarios(
    spec: dict[str, Any], scenario: Any, load_s: float, reset: Any = None
) -> dict[str, Any]:
    """Run each scenario ``repeats`` times (offline) or once (online); collect records.

    ``reset()`` (systems with a prefix cache) runs before every run, so that no run reuses
    the KV blocks of an earlier one's prompts (the scenarios share prompts).
    """
    out: dict[str, Any] = {"load_s": load_s, "scenarios": {}}
    for sc in spec["scenarios"]:
        runs = []
        for _ in range(sc.get("repeats", 1)):
            if reset is not None:
                reset()
            recs, extra = scenario(sc["requests"], sc["arrivals"])
            runs.append({"records": recs, **extra})
            print(f"[{spec['system']}] {sc['name']} done", file=sys.stderr, flush=True)
        out["scenarios"][sc["name"]] = runs
    return out


RUNNERS = {
    "pagedserve": run_pagedserve,
    "hf-cb": run_hf_cb,
    "hf-static": run_hf_static,
    "vllm": run_vllm,
}


def main() -> None:
    """``serving_systems.py SYSTEM SPEC.json OUT.json``."""
    if len(sys.argv) != 4 or sys.argv[1] not in RUNNERS:
        print(f"usage: serving_systems.py {{{','.join(RUNNERS)}}} SPEC.json OUT.json\n\n"
              f"{__doc__.splitlines()[0]} (serving.py starts it)")  # fmt: skip
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    system, spec_path, out_path = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    spec["system"] = system
    result = RUNNERS[system](spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
    # vLLM and Ray leave non-daemon threads behind: end the process once the file is out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
