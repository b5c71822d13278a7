"""Serving metrics kept by the scheduler itself: counters and histograms of its own events.

The scheduler sees every event a serving dashboard needs (a sequence admitted, a token
appended, a step computed, a preemption, a finish), so it counts them here, exactly, as
they happen; nothing is sampled or estimated. The frontend pulls a :class:`MetricsSnapshot`
from the scheduler actor at scrape time and exports it in the Prometheus text format
(:mod:`pagedserve.cluster.metrics`). Pure Python: no prometheus or Ray import.

Histograms live here too (bucket counts, sum, count), not in the frontend: one pull per
scrape carries everything, nothing is lost between scrapes, and no event buffer grows
while nobody scrapes. Bucket boundaries are vLLM's (``vllm/v1/metrics/loggers.py``).

Timing follows vLLM v1's ``RequestStateStats`` (seconds on the scheduler's monotonic
clock), per sequence (one choice of a request; a request with ``n`` choices counts ``n``):

- queue time: arrival -> first scheduled; prefill time: first scheduled -> first token;
- decode time: first token -> last token; inference time: first scheduled -> last token;
- TTFT: arrival -> first token; ITL: between consecutive tokens of one sequence;
- TPOT (per request): decode time / (output tokens - 1);
- e2e latency: arrival -> finish.

A token's time is when the scheduler applies the worker's answer (:meth:`Scheduler.update`).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.scheduler.request import FinishReason, Sequence

if TYPE_CHECKING:
    from pagedserve.scheduler.scheduler import SchedulerStats

# vLLM's bucket boundaries (upper bounds; +Inf is implicit).
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
STEP_GAP_BUCKETS_S = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

PREEMPTION_MODES = ("recompute", "swap")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram's state (Prometheus semantics).

    Attributes:
        buckets: upper bounds, ascending (the +Inf bucket is implicit).
        counts: observations per bucket, NOT cumulative; one more entry than ``buckets``
            (the last one is the +Inf bucket's own share).
        sum: sum of observed values (the histogram's unit).
        count: number of observations.
    """

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[int]:
        """Cumulative counts per bucket, +Inf last (what ``_bucket{le=...}`` shows)."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


class Histogram:
    """A fixed-bucket histogram (mutable; owned by :class:`SchedulerMetrics`).

    Raises:
        ValueError: empty or not strictly ascending ``buckets``.
    """

    def __init__(self, buckets: tuple[float, ...]) -> None:
        if not buckets or any(hi <= lo for lo, hi in itertools.pairwise(buckets)):
            raise ValueError(f"buckets must be non-empty and strictly ascending: {buckets}")
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose upper bound is >= it."""
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self._counts), self._sum, sum(self._counts))


@dataclass(slots=True)
class _SeqTimes:
    """Timestamps of one live sequence (seconds, scheduler's monotonic clock)."""

    arrival_s: float
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the metrics exporter needs, taken at one instant.

    Attributes:
        stats: queue lengths and per-worker block pools (gauges).
        num_requests_swapped: sequences whose KV is in the host block store.
        preemption_mode: how this scheduler preempts ("recompute", "swap" or "auto").
        enable_prefix_caching: whether full blocks are shared by hash.
        prompt_tokens: prompt tokens of sequences that produced a first token (each counted
            once, cached ones included; vLLM's ``prompt_tokens``).
        generation_tokens: output tokens appended.
        num_preemptions: preemptions by mode.
        request_success: finished sequences by reason ("stop", "length", "abort").
        histograms: by metric name without prefix (e.g. "time_to_first_token_seconds").
    """

    stats: SchedulerStats
    num_requests_swapped: int
    preemption_mode: str
    enable_prefix_caching: bool
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: dict[str, int]
    request_success: dict[str, int]
    histograms: dict[str, HistogramSnapshot] = field(default_factory=dict)


class SchedulerMetrics:
    """Counters and histograms the :class:`Scheduler` feeds with its own events.

    Args:
        max_model_len: longest sequence (tokens): the top of the token-count buckets.
        clock: seconds, monotonic (tests inject a fake one).
    """

    def __init__(self, max_model_len: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = dict.fromkeys(PREEMPTION_MODES, 0)
        self.request_success = {r.name.lower(): 0 for r in FinishReason}
        token_buckets = tuple(float(b) for b in buckets_1_2_5(max_model_len))
        latency = REQUEST_LATENCY_BUCKETS_S
        self.histograms: dict[str, Histogram] = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS_S),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS_S),
            "request_time_per_output_token_seconds": Histogram(ITL_BUCKETS_S),
            "e2e_request_latency_seconds": Histogram(latency),
            "request_queue_time_seconds": Histogram(latency),
            "request_inference_time_seconds": Histogram(latency),
            "request_prefill_time_seconds": Histogram(latency),
            "request_decode_time_seconds": Histogram(latency),
            "request_prompt_tokens": Histogram(token_buckets),
            "request_generation_tokens": Histogram(token_buckets),
            "iteration_tokens_total": Histogram(tuple(map(float, ITERATION_TOKENS_BUCKETS))),
            "worker_step_gap_seconds": Histogram(STEP_GAP_BUCKETS_S),
        }
        self._ttft = self.histograms["time_to_first_token_seconds"]
        self._itl = self.histograms["inter_token_latency_seconds"]
        self._times: dict[str, _SeqTimes] = {}

    # ------------------------------------------------------------------ events
    @staticmethod
    def _key(seq: Sequence) -> str:
        """Whose timestamps: the sequence's, or for beam search its request's (beams fork
        and are pruned every step; the request is what the client waits for)."""
        return seq.request_id if seq.sampling.beam_width > 1 else seq.seq_id

    def _times_of(self, seq: Sequence) -> _SeqTimes:
        key = self._key(seq)
        times = self._times.get(key)
        if times is None:
            times = self._times[key] = _SeqTimes(arrival_s=seq.arrival_s)
        return times

    def on_scheduled(self, seq: Sequence) -> None:
        """The sequence was admitted to a running batch (only the first time counts)."""
        times = self._times_of(seq)
        if times.scheduled_s is None:
            times.scheduled_s = self.clock()
            self.histograms["request_queue_time_seconds"].observe(
                times.scheduled_s - times.arrival_s
            )

    def on_step(self, num_tokens: int) -> None:
        """A worker computed ``num_tokens`` tokens (prefill chunks + decodes) in one step."""
        if num_tokens > 0:
            self.histograms["iteration_tokens_total"].observe(num_tokens)

    def on_token(self, seq: Sequence, now: float | None = None) -> None:
        """A step appended one output token to ``seq`` (before any finish it causes).

        Args:
            seq: the sequence.
            now: the step's time (:attr:`clock`, seconds), read once by a caller that
                applies many tokens at once; None reads the clock.
        """
        if now is None:
            now = self.clock()
        times = self._times.get(seq.seq_id)
        if times is None:
            times = self._times[seq.seq_id] = _SeqTimes(arrival_s=seq.arrival_s)
        last = times.last_token_s
        if times.first_token_s is None:
            if times.scheduled_s is None:
                times.scheduled_s = now
            times.first_token_s = now
            self.prompt_tokens += len(seq.prompt_token_ids)
            self._ttft.observe(now - times.arrival_s)
        elif last is not None:
            # NOTE: the hot path (every decoded token): Histogram.observe inlined.
            itl = self._itl
            value = now - last
            itl._counts[bisect.bisect_left(itl.buckets, value)] += 1
            itl._sum += value
        times.last_token_s = now
        self.generation_tokens += 1

    def on_beam_request_finished(
        self, seq: Sequence, choices: list[tuple[FinishReason, int]]
    ) -> None:
        """A beam-search request ended: record each of its ``n`` choices as a finished
        sequence, as :meth:`on_finished` does for a sampled choice.

        Beams fork and are pruned every step and are not counted one by one (a pruned
        beam is not a finished sequence, and not an abort); their tokens reach the
        client only at the end, so each choice's time to first token is its end-to-end
        latency, and generation_tokens counts the tokens delivered.

        Args:
            seq: any beam of the request (its arrival, prompt and request id are used).
            choices: ``(finish reason, output tokens)`` per choice returned (``n`` of
                them; an aborted request's choices have 0 tokens).
        """
        now = self.clock()
        times = self._times.pop(seq.request_id, None) or _SeqTimes(arrival_s=seq.arrival_s)
        h = self.histograms
        latency = now - times.arrival_s
        for reason, num_output in choices:
            self.request_success[reason.name.lower()] += 1
            self.generation_tokens += num_output
            h["e2e_request_latency_seconds"].observe(latency)
            h["request_prompt_tokens"].observe(seq.num_prompt_tokens)
            h["request_generation_tokens"].observe(num_output)
            if num_output:
                self.prompt_tokens += seq.num_prompt_tokens
                self._ttft.observe(latency)
            if times.scheduled_s is not None:
                h["request_inference_time_seconds"].observe(now - times.scheduled_s)

    def on_step_gap(self, gap_s: float) -> None:
        """A busy worker idled ``gap_s`` seconds (its clock) between two steps."""
        self.histograms["worker_step_gap_seconds"].observe(max(0.0, gap_s))

    def on_preempted(self, mode: str) -> None:
        """A running sequence was preempted (``mode``: one of PREEMPTION_MODES)."""
        self.num_preemptions[mode] = self.num_preemptions.get(mode, 0) + 1

    def on_finished(self, seq: Sequence, reason: FinishReason) -> None:
        """The sequence ended (any reason, abort included): record its request-level figures."""
        now = self.clock()
        times = self._times.pop(seq.seq_id, None) or _SeqTimes(arrival_s=seq.arrival_s)
        h = self.histograms
        self.request_success[reason.name.lower()] += 1
        h["e2e_request_latency_seconds"].observe(now - times.arrival_s)
        h["request_prompt_tokens"].observe(seq.num_prompt_tokens)
        num_output = len(seq.output_token_ids)
        h["request_generation_tokens"].observe(num_output)
        first, last, scheduled = times.first_token_s, times.last_token_s, times.scheduled_s
        if scheduled is not None and first is not None and last is not None:
            h["request_prefill_time_seconds"].observe(first - scheduled)
            h["request_decode_time_seconds"].observe(last - first)
            h["request_inference_time_seconds"].observe(last - scheduled)
            if num_output > 1:
                h["request_time_per_output_token_seconds"].observe(
                    (last - first) / (num_output - 1)
                )

    # ------------------------------------------------------------------ export
    def snapshot(
        self, stats: SchedulerStats, preemption_mode: str, enable_prefix_caching: bool
    ) -> MetricsSnapshot:
        """Freeze the counters and histograms together with the scheduler's gauges."""
        return MetricsSnapshot(
            stats=stats,
            num_requests_swapped=stats.swap.num_requests_swapped,
            preemption_mode=preemption_mode,
            enable_prefix_caching=enable_prefix_caching,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=dict(self.num_preemptions),
            request_success=dict(self.request_success),
            histograms={name: h.snapshot() for name, h in self.histograms.items()},
        )

    @property
    def num_live_timers(self) -> int:
        """Sequences with timestamps held (unfinished ones); 0 when idle."""
        return len(self._times)
