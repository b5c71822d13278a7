"""Prometheus export of scheduler snapshots, and the HTTP server (fake scheduler, no Ray)."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request

import pytest
from helpers import ScriptedWorker
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.http_server import HttpServer, create_app
from pagedserve.cluster.metrics import MetricsExporter
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.metrics import TTFT_BUCKETS_S
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec


def two_worker_scheduler() -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=1, max_model_len=128)
    specs = [
        WorkerSpec(0, 8, 4, "bfloat16", "bfloat16"),
        WorkerSpec(1, 16, 4, "float32", "float16"),
    ]
    s = Scheduler(cfg, specs)
    s.add_request(
        EngineRequest("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0), [])
    )
    s.add_request(EngineRequest("b", [7, 8], SamplingParams(max_tokens=9, temperature=0), []))
    w = ScriptedWorker()
    for wid in (0, 1, 0, 0):
        so = s.schedule(wid).output
        s.update(wid, so, w.execute(so))
    return s


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_snapshot_renders_the_schedulers_values():
    s = two_worker_scheduler()
    snap = s.metrics_snapshot()
    text = MetricsExporter(None, "m").render_snapshot(snap).decode()
    got = samples(text)
    m = (("model_name", "m"),)
    # a finished on worker 0 (3 tokens); b runs on worker 1 with 1 token.
    assert got[("pagedserve:generation_tokens_total", m)] == 4
    assert got[("pagedserve:prompt_tokens_total", m)] == 7
    assert got[("pagedserve:request_success_total", (("finished_reason", "length"), *m))] == 1
    assert got[("pagedserve:num_requests_waiting", m)] == 0
    for wid, used, total, running in ((0, 0, 8, 0), (1, 1, 16, 1)):
        wl = (("model_name", "m"), ("worker", str(wid)))
        assert got[("pagedserve:kv_cache_used_blocks", wl)] == used
        assert got[("pagedserve:kv_cache_usage_perc", wl)] == used / total
        assert got[("pagedserve:num_requests_running", wl)] == running
    # Exactly one series per worker for per-worker gauges.
    for name in ("kv_cache_usage_perc", "num_requests_running", "cache_config_info"):
        series = [k for k in got if k[0] == "pagedserve:" + name]
        assert len(series) == 2, series
    info = [dict(k[1]) for k in got if k[0] == "pagedserve:cache_config_info"]
    assert {i["num_blocks"] for i in info} == {"8", "16"}
    assert {i["preemption_mode"] for i in info} == {"recompute"}
    dtypes = {(i["worker"], i["model_dtype"], i["cache_dtype"]) for i in info}
    assert dtypes == {("0", "bfloat16", "bfloat16"), ("1", "float32", "float16")}
    # Histogram: vLLM's bounds, cumulative buckets, +Inf == count.
    ttft = snap.histograms["time_to_first_token_seconds"]
    buckets = [
        (dict(k[1])["le"], v)
        for k, v in got.items()
        if k[0] == "pagedserve:time_to_first_token_seconds_bucket"
    ]
    assert len(buckets) == len(TTFT_BUCKETS_S) + 1
    assert dict(buckets)["+Inf"] == ttft.count == 2
    assert got[("pagedserve:time_to_first_token_seconds_count", m)] == 2
    values = [v for _, v in buckets]
    assert values == sorted(values)
    assert "pagedserve:num_preemptions_total" in text and 'mode="recompute"' in text


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self):
        async def call():
            return self._fn()

        return call()


class FakeScheduler:
    def __init__(self, sched: Scheduler) -> None:
        self.live = 1
        self.get_metrics = _Remote(sched.metrics_snapshot)
        self.num_live_workers = _Remote(lambda: self.live)


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_speculative_decoding_counters_are_exported():
    s = two_worker_scheduler()
    s.spec_decode.on_step(4, 3)
    s.spec_decode.on_step(2, 0)
    s.spec_decode.on_step(0, 0)  # no proposals: not a draft
    got = samples(MetricsExporter(None, "m").render_snapshot(s.metrics_snapshot()).decode())
    m = (("model_name", "m"),)
    assert got[("pagedserve:spec_decode_num_drafts_total", m)] == 2
    assert got[("pagedserve:spec_decode_num_draft_tokens_total", m)] == 6
    assert got[("pagedserve:spec_decode_num_accepted_tokens_total", m)] == 3
    sd = s.stats().spec_decode
    assert sd.acceptance_rate == 0.5 and sd.mean_accepted_length == 2.5


def test_http_server_serves_metrics_and_health_then_stops():
    async def main():
        fake = FakeScheduler(two_worker_scheduler())
        app = create_app(fake, MetricsExporter(fake, "m"))
        server = HttpServer(app, "127.0.0.1", 0)
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
        try:
            status, ctype, body = await asyncio.to_thread(_get, base + "/metrics")
            assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
            assert 'pagedserve:generation_tokens_total{model_name="m"} 4.0' in body
            assert (await asyncio.to_thread(_get, base + "/health"))[0] == 200
            fake.live = 0
            assert (await asyncio.to_thread(_get, base + "/health"))[0] == 503
            assert (await asyncio.to_thread(_get, base + "/nope"))[0] == 404
        finally:
            await server.stop()
        with pytest.raises(OSError):  # closed after stop
            await asyncio.to_thread(_get, base + "/health")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_http_server_refuses_a_taken_port():
    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            fake = FakeScheduler(two_worker_scheduler())
            server = HttpServer(create_app(fake, MetricsExporter(fake, "m")), "127.0.0.1", port)
            with pytest.raises(OSError):
                await server.start()

    asyncio.run(asyncio.wait_for(main(), 30))
