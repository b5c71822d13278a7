"""GetStats through gRPC and ``pagedserve stats``: per-worker preemptions and recomputed
tokens of a real Scheduler (two workers, fake model), without Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

from helpers import ScriptedWorker, drive

from pagedserve.cluster.cli import main
from pagedserve.cluster.client import Client
from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.frontend import GenerationServicer, start_server
from pagedserve.cluster.pipeline import RequestPipeline
from pagedserve.cluster.request_prep import ModelInfo
from pagedserve.scheduler.config import SchedulerConfig, SpeculativeConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.host_prefix import HostPrefixStats
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self):
        async def call():
            return self._fn()

        return call()


class _SchedulerHandle:
    def __init__(self, sched: Scheduler) -> None:
        self.get_stats = _Remote(sched.stats)


class _Tok:
    def get_vocab(self):
        return {"a": 0}


def _preempted_scheduler() -> Scheduler:
    # Worker 1: two 6-token prompts in 4 blocks of 4, admitted whatever fits now: one
    # preemption, 8 tokens recomputed (see test_scheduler_pressure). Worker 0 stays idle:
    # it is out of service while the serial engine loop runs (alive, it would steal the
    # preempted b and recompute it itself), then back with its pool untouched.
    cfg = SchedulerConfig(
        max_model_len=64, admission="fits-now", preemption_victim="latest",
        enable_prefix_caching=False, routing="round-robin", async_scheduling=False,
    )  # fmt: skip
    specs = [WorkerSpec(0, 8, 4, "float32", "bfloat16"), WorkerSpec(1, 4, 4, "float32", "float32")]
    s = Scheduler(cfg, specs)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid in ("x", "a", "y", "b"):
        s.add_request(EngineRequest(rid, [1] * 6 if rid in "ab" else [7], sp))
    for rid in ("x", "y"):
        s.abort_request(rid)
    assert s.mark_worker_dead(0) == []  # nothing was queued or running there
    w = ScriptedWorker()
    drive(s, [w.execute, w.execute], max_steps=100)
    s.revive_worker(0)
    return s


def _with_remote_swap_ins(sched: Scheduler):
    """``sched.stats`` as if worker 1 had pulled 2 groups (300 B) from another node."""

    real = sched.stats

    def stats():
        st = real()
        pulled = dict(num_remote_swap_ins=2, remote_swap_in_bytes=300)
        workers = [
            dataclasses.replace(w, swap=dataclasses.replace(w.swap, **pulled))
            if w.worker_id == 1
            else w
            for w in st.workers
        ]
        tier = HostPrefixStats(True, 64, 5, 3, 48, 7, 700, 0.5, 1, 300, 0.25, 0)
        swap = dataclasses.replace(st.swap, host_prefix=tier, **pulled)
        return dataclasses.replace(st, workers=workers, swap=swap)

    return stats


def test_stats_report_per_worker_preemptions_and_recomputed_tokens(capsys):
    sched = _preempted_scheduler()
    sched.stats = _with_remote_swap_ins(sched)  # type: ignore[method-assign]
    sched.spec_decode.on_step(4, 2)
    info = ModelInfo("m", 64, 1, (1,), 64)
    servicer = GenerationServicer(
        RequestPipeline(scheduler=_SchedulerHandle(sched), tokenizer=_Tok(), info=info)
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(
        start_server(ServerConfig(host="127.0.0.1", port=0), servicer), loop
    ).result(timeout=30)
    try:
        address = f"127.0.0.1:{port}"
        with Client(address, timeout_s=30) as c:
            st = c.stats()
        assert st["num_preemptions"] == 1 and st["num_recomputed_tokens"] == 8
        w0, w1 = st["workers"]
        assert (w0["num_preemptions"], w0["num_recomputed_tokens"]) == (0, 0)
        assert (w1["num_preemptions"], w1["num_recomputed_tokens"]) == (1, 8)
        assert (w0["dtype"], w0["kv_cache_dtype"]) == ("float32", "bfloat16")
        assert (w1["dtype"], w1["kv_cache_dtype"]) == ("float32", "float32")
        assert (w0["num_remote_swap_ins"], w0["remote_swap_in_bytes"]) == (0, 0)
        assert (w1["num_remote_swap_ins"], w1["remote_swap_in_bytes"]) == (2, 300)
        sw = st["swap"]
        assert (sw["num_remote_swap_ins"], sw["remote_swap_in_bytes"]) == (2, 300)
        sd = st["spec_decode"]
        assert (sd["num_drafts"], sd["num_draft_tokens"], sd["num_accepted_tokens"]) == (1, 4, 2)
        assert sd["acceptance_rate"] == 0.5 and sd["mean_accepted_length"] == 3.0
        assert main(["stats", "--address", address, "--output", "json"]) == 0
        assert json.loads(capsys.readouterr().out) == st
        assert main(["stats", "--address", address]) == 0
        text = capsys.readouterr().out
        assert "preemptions 1" in text and "recomputed" in text and "tokens 8" in text
        assert "float32 / bfloat16" in text and "float32 / float32" in text
        assert "from another node 2, 300 B" in text
        hp = sw["host_prefix"]
        assert (hp["num_hit_blocks"], hp["num_hit_tokens"], hp["spill_bytes"]) == (3, 48, 700)
        assert (hp["load_bytes"], hp["load_seconds"], hp["capacity_blocks"]) == (300, 0.25, 64)
        assert "host prefix cache 5 of 64 blocks  hits 3 blocks (48 tokens)" in text
        assert "spills 7 (700 B, 0.500 s)  loads 1 (300 B, 0.250 s)" in text
        assert "acceptance rate 0.500" in text and "mean accepted length 3.00" in text
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_serve_flags_reach_the_configs():
    from pagedserve.cluster.cli import build_parser, serve_config

    args = build_parser().parse_args(
        ["serve", "--admission", "fits-now", "--admission-growth-ratio", "0.5",
         "--preemption-victim", "latest", "--no-async-scheduling", "--no-adaptive-threads",
         "--cpus-per-worker", "2"]
    )  # fmt: skip
    cfg = serve_config(args)
    sc = cfg.scheduler
    assert (sc.admission, sc.admission_growth_ratio, sc.preemption_victim) == (
        "fits-now",
        0.5,
        "latest",
    )
    assert sc.async_scheduling is False
    wc = cfg.worker_config(0)
    assert (wc.num_threads, wc.adaptive_threads) == (2, False)
    assert sc.host_prefix_cache and sc.host_prefix_cache_fraction == 0.5
    off = serve_config(
        build_parser().parse_args(
            ["serve", "--no-host-prefix-cache", "--host-prefix-cache-fraction", "0.25"]
        )
    )
    assert not off.scheduler.host_prefix_cache
    assert off.scheduler.host_prefix_cache_fraction == 0.25
    flags = ["--speculative-method", "ngram", "--num-speculative-tokens", "5"]
    flags += ["--ngram-min", "2", "--ngram-max", "4", "--speculative-disable-by-batch-size", "8"]
    spec = serve_config(build_parser().parse_args(["serve", *flags])).scheduler.speculative_config
    assert spec == SpeculativeConfig("ngram", 5, 2, 4, disable_by_batch_size=8)
    flags = ["--speculative-method", "draft", "--draft-model", "/models/small"]
    flags += ["--speculative-disable-by-batch-size", "0"]
    drafted = serve_config(build_parser().parse_args(["serve", "--dtype", "float32", *flags]))
    spec = drafted.scheduler.speculative_config
    assert spec == SpeculativeConfig(
        "draft", 4, disable_by_batch_size=None, draft_model="/models/small"
    )
    draft = drafted.worker_config(0).draft_model
    assert draft is not None and (draft.model, draft.dtype) == ("/models/small", "float32")
    flags = ["--speculative-method", "ngram"]
    spec = serve_config(build_parser().parse_args(["serve", *flags])).scheduler.speculative_config
    assert spec is not None and spec.disable_by_batch_size == 32
    default = serve_config(build_parser().parse_args(["serve"]))
    assert default.scheduler.speculative_config is None
    assert default.worker_config(0).draft_model is None
    assert default.scheduler.admission == "fits-now" and default.scheduler.async_scheduling
    assert default.worker_config(0).adaptive_threads
