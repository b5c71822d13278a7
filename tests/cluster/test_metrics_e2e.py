"""/metrics of the real server: exact counts of a known workload, and a real Prometheus.

The session cluster (tests/cluster/conftest.py: one CPU worker, 192 blocks of 16) serves
HTTP on a free port. Counters are compared as deltas around the workload, since other
tests of the session use the same cluster.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 192  # must match tests/cluster/conftest.py
BLOCK_SIZE = 16
PROMETHEUS_HINT = (
    "the Prometheus server is not installed: on Debian/Ubuntu `apt-get install -y "
    "--no-install-recommends prometheus` (.ci/run does this when apt is usable)"
)


def scrape(http_address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def wait_idle(address: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    with Client(address, timeout_s=30) as c:
        while True:
            st = c.stats()
            w = st["workers"][0]
            if (
                st["num_requests_running"] == 0
                and st["num_requests_waiting"] == 0
                and w["num_free_blocks"] == w["num_blocks"]
            ):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not idle: {st}")
            time.sleep(0.1)


def test_health_endpoint(cluster):
    handle, _ = cluster
    with urllib.request.urlopen(f"http://{handle.http_address}/health", timeout=30) as r:
        assert r.status == 200


def test_known_workload_gives_exact_counts(cluster):
    handle, _ = cluster
    wait_idle(handle.address)
    before = scrape(handle.http_address)
    # Token-id prompts no other test uses (nothing cached), each 5 greedy tokens.
    p1 = list(range(30000, 30020))  # 20 tokens
    p2 = list(range(31000, 31033))  # 33 tokens
    p3 = list(range(32000, 32007))  # 7 tokens
    prompts = [p1, p2, p3, p1]  # the repeat of p1 hits its first full block (16 tokens)
    max_tokens = 5
    with Client(handle.address, timeout_s=300) as c:
        for p in prompts:  # one at a time: every step holds exactly one sequence
            r = c.generate(token_ids=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            assert r.choices[0].finish_reason == "length"
    stats = wait_idle(handle.address)
    after = scrape(handle.http_address)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    n_prompt = sum(map(len, prompts))  # 80
    hits = BLOCK_SIZE  # p1 again: block 0 full; never the last prompt token
    assert delta("pagedserve:prompt_tokens_total") == n_prompt
    assert delta("pagedserve:generation_tokens_total") == 4 * max_tokens
    assert delta("pagedserve:request_success_total", finished_reason="length") == 4
    assert delta("pagedserve:request_success_total", finished_reason="abort") == 0
    assert delta("pagedserve:prefix_cache_queries_total") == n_prompt
    assert delta("pagedserve:prefix_cache_hits_total") == hits
    assert delta("pagedserve:num_preemptions_total", mode="recompute") == 0
    # Steps: one prefill (prompt minus cached) and 4 decodes per request.
    assert delta("pagedserve:iteration_tokens_total_count") == 4 * max_tokens
    assert delta("pagedserve:iteration_tokens_total_sum") == n_prompt - hits + 4 * (max_tokens - 1)
    assert delta("pagedserve:time_to_first_token_seconds_count") == 4
    assert delta("pagedserve:inter_token_latency_seconds_count") == 4 * (max_tokens - 1)
    assert delta("pagedserve:e2e_request_latency_seconds_count") == 4
    assert delta("pagedserve:request_prompt_tokens_sum") == n_prompt
    assert delta("pagedserve:request_generation_tokens_sum") == 4 * max_tokens
    # Histogram buckets are cumulative and end at the count.
    assert value(after, "pagedserve:request_prompt_tokens_bucket", le="+Inf") == value(
        after, "pagedserve:request_prompt_tokens_count"
    )
    # Gauges at rest equal the scheduler's own report (GetStats).
    w = stats["workers"][0]
    assert value(after, "pagedserve:kv_cache_used_blocks", worker="0") == 0
    assert value(after, "pagedserve:kv_cache_usage_perc", worker="0") == 0.0
    assert value(after, "pagedserve:num_requests_running", worker="0") == 0
    assert value(after, "pagedserve:num_requests_waiting") == stats["num_requests_waiting"] == 0
    assert value(after, "pagedserve:num_requests_swapped") == 0
    assert (
        value(after, "pagedserve:num_preemptions_total", mode="recompute")
        == stats["num_preemptions"]
    )
    info = [k for k in after if k[0] == "pagedserve:cache_config_info"]
    assert len(info) == 1
    labels = dict(info[0][1])
    assert labels["num_blocks"] == str(NUM_BLOCKS) == str(w["num_blocks"])
    assert labels["block_size"] == str(BLOCK_SIZE) and labels["worker"] == "0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prom_query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture()
def prometheus(cluster, tmp_path):
    """A real Prometheus on 127.0.0.1 scraping the session cluster with deploy/prometheus.yml."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(PROMETHEUS_HINT)
    handle, _ = cluster
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [handle.http_address]}]
    cfg_path = tmp_path / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={cfg_path}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "w"),  # noqa: SIM115
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (tmp_path / "prometheus.log").read_text()[-2000:]
                    pytest.fail(f"prometheus did not become ready: {log}")
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_prometheus_scrapes_the_schedulers_values(cluster, prometheus):
    handle, lt = cluster
    with Client(handle.address, timeout_s=300) as c:
        c.generate(token_ids=[33000, 33001, 33002], max_tokens=3, temperature=0, ignore_eos=True)
    wait_idle(handle.address)
    snap = lt.run(_get_metrics(handle.scheduler), timeout=30)  # the scheduler's own numbers
    expected = {
        "pagedserve:generation_tokens_total": snap.generation_tokens,
        "pagedserve:prompt_tokens_total": snap.prompt_tokens,
        'sum(pagedserve:request_success_total{finished_reason="length"})': snap.request_success[
            "length"
        ],
        "sum(pagedserve:kv_cache_usage_perc)": 0,
        "pagedserve:time_to_first_token_seconds_count": snap.histograms[
            "time_to_first_token_seconds"
        ].count,
    }
    deadline = time.monotonic() + 30
    while True:
        got = {}
        for expr in expected:
            result = _prom_query(prometheus, expr)
            got[expr] = float(result[0]["value"][1]) if result else None
        if got == {k: float(v) for k, v in expected.items()}:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus answered {got}, the scheduler reports {expected}")
        time.sleep(0.5)
    (up,) = _prom_query(prometheus, 'up{job="pagedserve"}')
    assert up["value"][1] == "1"


async def _get_metrics(scheduler):
    return await scheduler.get_metrics.remote()


def test_metrics_scrape_is_quick(cluster):
    handle, _ = cluster
    t0 = time.perf_counter()
    for _ in range(5):
        scrape(handle.http_address)
    assert (time.perf_counter() - t0) / 5 < 1.0, "a scrape should take well under a second"
