"""Prometheus export of the scheduler's own metrics (``GET /metrics``).

At each scrape the frontend pulls one :class:`~pagedserve.scheduler.metrics.MetricsSnapshot`
from the scheduler actor and a custom collector turns it into metric families: gauges for
the state now (queues, KV usage per worker), counters and histograms for what happened since
the scheduler started. Every value is the scheduler's own count; the exporter computes
nothing but the cumulative bucket counts Prometheus expects.

Names follow vLLM's meanings with a ``pagedserve:`` prefix (docs/operations.md,
"Monitoring", maps each to vLLM's name); every series carries ``model_name``, per-worker gauges also ``worker`` (one
series per worker). Each exporter owns its :class:`CollectorRegistry`: prometheus-client's
global default registry is never used.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pagedserve.scheduler.metrics import HistogramSnapshot, MetricsSnapshot

PREFIX = "pagedserve:"
# The classic text format every Prometheus 2.x reads (prometheus-client's "latest" is 1.0.0).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Histogram name (without prefix) -> help text (units in the name).
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token (arrival -> first output token), seconds.",
    "inter_token_latency_seconds": "Time between consecutive output tokens of a sequence, seconds.",
    "request_time_per_output_token_seconds": "Mean time per output token after the first, per sequence, seconds.",
    "e2e_request_latency_seconds": "End-to-end latency (arrival -> finish) per sequence, seconds.",
    "request_queue_time_seconds": "Time waiting before first admission (WAITING), seconds.",
    "request_inference_time_seconds": "Time from first admission to last token (RUNNING), seconds.",
    "request_prefill_time_seconds": "Time from first admission to first token (PREFILL), seconds.",
    "request_decode_time_seconds": "Time from first to last token (DECODE), seconds.",
    "request_prompt_tokens": "Prompt length per finished sequence, tokens.",
    "request_generation_tokens": "Output tokens per finished sequence, tokens.",
    "iteration_tokens_total": "Tokens computed per worker step (prefill chunks + decodes).",
    "worker_step_gap_seconds": "Idle time of a busy worker between two steps, seconds.",
}


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _histogram(
    name: str, doc: str, labels: list[str], values: list[str], h: HistogramSnapshot
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    bounds = [*h.buckets, math.inf]
    fam.add_metric(values, list(zip(map(_le, bounds), h.cumulative())), sum_value=h.sum)
    return fam


def snapshot_families(snap: MetricsSnapshot, model_name: str) -> list[Metric]:
    """The metric families of one snapshot (see the metrics table in docs/operations.md)."""
    st = snap.stats
    m = ["model_name"]
    mw = ["model_name", "worker"]
    fams: list[Metric] = []

    def gauge(name: str, doc: str, labels: list[str] = m) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        fams.append(fam)
        return fam

    def counter(name: str, doc: str, labels: list[str] = m) -> CounterMetricFamily:
        fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        fams.append(fam)
        return fam

    running = gauge("num_requests_running", "Sequences in the worker's running batch.", mw)
    usage = gauge(
        "kv_cache_usage_perc", "KV-cache usage of the worker: used / total blocks, 0..1.", mw
    )
    used = gauge("kv_cache_used_blocks", "KV blocks held by sequences (ref_count > 0).", mw)
    info = gauge(
        "cache_config_info",
        "KV cache configuration of the worker (value 1; the facts are labels).",
        [
            *mw,
            "block_size",
            "num_blocks",
            "cache_dtype",
            "model_dtype",
            "preemption_mode",
            "enable_prefix_caching",
        ],
    )
    for w in st.workers:
        wl = [model_name, str(w.worker_id)]
        num_used = w.num_blocks - w.num_free_blocks
        running.add_metric(wl, w.num_running)
        usage.add_metric(wl, num_used / w.num_blocks if w.num_blocks else 0.0)
        used.add_metric(wl, num_used)
        info.add_metric(
            [
                *wl,
                str(w.block_size),
                str(w.num_blocks),
                w.kv_cache_dtype,
                w.dtype,
                snap.preemption_mode,
                str(snap.enable_prefix_caching).lower(),
            ],
            1,
        )
    gauge("num_requests_waiting", "Sequences waiting for admission (new or preempted).").add_metric(
        [model_name], st.num_waiting
    )
    gauge("num_requests_swapped", "Sequences swapped out to host memory.").add_metric(
        [model_name], snap.num_requests_swapped
    )

    sw = st.swap
    gauge(
        "host_kv_cache_usage_perc",
        "Host block store usage: host blocks held / total, 0..1 (0 without a store).",
    ).add_metric(
        [model_name],
        1 - sw.host_blocks_free / sw.host_blocks_total if sw.host_blocks_total else 0.0,
    )
    swap_bytes = counter(
        "swap_bytes", "KV bytes moved by finished swap transfers, by direction.", [*m, "direction"]
    )
    swap_bytes.add_metric([model_name, "out"], sw.swap_out_bytes)
    swap_bytes.add_metric([model_name, "in"], sw.swap_in_bytes)
    counter(
        "swap_failures", "Swap transfers that failed (their sequences were recomputed)."
    ).add_metric([model_name], sw.num_swap_failures)
    hp = sw.host_prefix
    counter(
        "host_prefix_cache_hits",
        "Prompt tokens loaded from the host tier of the prefix cache instead of recomputed.",
    ).add_metric([model_name], hp.num_hit_tokens)
    counter(
        "host_prefix_cache_spills", "KV blocks spilled from KV pools to the host tier, blocks."
    ).add_metric([model_name], hp.num_spills)
    tier_bytes = counter(
        "host_prefix_cache_bytes",
        "KV bytes moved by the host tier, by direction.",
        [*m, "direction"],
    )
    tier_bytes.add_metric([model_name, "spill"], hp.spill_bytes)
    tier_bytes.add_metric([model_name, "load"], hp.load_bytes)
    tier_s = counter(
        "host_prefix_cache_seconds",
        "Workers' time spent in host-tier transfers, by direction, s.",
        [*m, "direction"],
    )
    tier_s.add_metric([model_name, "spill"], hp.spill_seconds)
    tier_s.add_metric([model_name, "load"], hp.load_seconds)
    gauge(
        "host_prefix_cache_blocks", "Host blocks the host tier of the prefix cache holds now."
    ).add_metric([model_name], hp.num_blocks)
    pre = counter("num_preemptions", "Preemptions by mode.", [*m, "mode"])
    for mode, n in sorted(snap.num_preemptions.items()):
        pre.add_metric([model_name, mode], n)
    recomputed = counter(
        "num_recomputed_tokens",
        "Tokens computed again after a preemption discarded their KV, tokens.",
        mw,
    )
    for w in st.workers:
        recomputed.add_metric([model_name, str(w.worker_id)], w.num_recomputed_tokens)
    counter(
        "prefix_cache_queries", "Prompt tokens looked up in the prefix cache, tokens."
    ).add_metric([model_name], st.prefix_cache_queries)
    counter("prefix_cache_hits", "Prompt tokens found in the prefix cache, tokens.").add_metric(
        [model_name], st.prefix_cache_hits
    )
    counter(
        "prompt_tokens", "Prompt tokens of sequences that produced a first token, tokens."
    ).add_metric([model_name], snap.prompt_tokens)
    counter("generation_tokens", "Output tokens generated, tokens.").add_metric(
        [model_name], snap.generation_tokens
    )
    sd = st.spec_decode
    counter(
        "spec_decode_num_drafts", "Sequence-steps that verified speculative proposals."
    ).add_metric([model_name], sd.num_drafts)
    counter("spec_decode_num_draft_tokens", "Speculative tokens proposed, tokens.").add_metric(
        [model_name], sd.num_draft_tokens
    )
    counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted, tokens.").add_metric(
        [model_name], sd.num_accepted_tokens
    )
    ok = counter("request_success", "Finished sequences by reason.", [*m, "finished_reason"])
    for reason, n in sorted(snap.request_success.items()):
        ok.add_metric([model_name, reason], n)

    for name, doc in HISTOGRAMS.items():
        if name in snap.histograms:
            fams.append(_histogram(name, doc, m, [model_name], snap.histograms[name]))
    return fams


class _SnapshotCollector(Collector):
    """Yields the families of the snapshot set just before the registry is rendered."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: MetricsSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is not None:
            yield from snapshot_families(self.snapshot, self.model_name)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names depend on the snapshot: no registration-time checks


class MetricsExporter:
    """Renders ``/metrics`` from the scheduler actor's snapshot.

    Args:
        scheduler: the SchedulerActor handle (``get_metrics``).
        model_name: the ``model_name`` label value.

    Attributes:
        registry: this exporter's own registry; other collectors (e.g. of the HTTP API)
            may be registered on it.
    """

    def __init__(self, scheduler: Any, model_name: str) -> None:
        self._scheduler = scheduler
        self._collector = _SnapshotCollector(model_name)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._collector)

    def render_snapshot(self, snapshot: MetricsSnapshot) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of ``snapshot``."""
        # Set and render in one synchronous call: no other scrape can interleave.
        self._collector.snapshot = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self._collector.snapshot = None

    async def render(self, timeout_s: float = 10.0) -> bytes:
        """Pull a snapshot from the scheduler and render it.

        Raises:
            TimeoutError: the scheduler did not answer within ``timeout_s`` seconds.
            ray.exceptions.RayActorError: the scheduler is gone.
        """
        import asyncio

        snapshot = await asyncio.wait_for(self._scheduler.get_metrics.remote(), timeout_s)
        return self.render_snapshot(snapshot)
