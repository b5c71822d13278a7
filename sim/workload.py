"""Synthetic and file-based request workloads for the KV-cache allocator simulator.

A workload is a tuple of :class:`WorkloadRequest` records, in arrival order. Time is measured
in scheduler steps (one decode token per running sequence per step), lengths in tokens.

The default workload (:func:`default_workload`) mimics the ShareGPT conversation traces used
in the vLLM paper's evaluation (Kwon et al., SOSP 2023, §6.1 and Fig. 11: long-tailed prompt
and output lengths, inputs averaging roughly 160 tokens and outputs roughly 340): log-normal
lengths (most generations short, a few long), Poisson arrivals, and a power-of-two
``max_tokens`` cap like the paper's Orca (Pow2) baseline, which reserves up to twice the
true output length. See :class:`WorkloadSpec` for every parameter.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

_FIELDS = ("arrival_step", "prompt_len", "output_len", "n", "prefix_id", "prefix_len", "max_tokens")
_REQUIRED = ("arrival_step", "prompt_len", "output_len")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        arrival_step: step at which the request joins the waiting queue (>= 0).
        prompt_len: prompt tokens (>= 1).
        output_len: tokens each of its ``n`` samples generates before finishing (>= 1).
        n: parallel samples (>= 1); they share the prompt (fork / copy-on-write when paged).
        prefix_id: requests with the same id share their first ``prefix_len`` prompt tokens
            (e.g. a system prompt); ``None`` for no shared prefix.
        prefix_len: tokens of the prompt that belong to the shared prefix
            (``0 <= prefix_len <= prompt_len``; 0 when ``prefix_id`` is None). Two requests
            with the same ``prefix_id`` share ``min`` of their two ``prefix_len`` tokens.
        max_tokens: the client's cap on output tokens (``>= output_len``), used by the
            contiguous allocator's ``reserve="max_tokens"`` mode; ``None`` means no cap (the
            output may run to ``max_model_len``).

    Raises:
        ValueError: on an out-of-range field, naming it.
    """

    arrival_step: int
    prompt_len: int
    output_len: int
    n: int = 1
    prefix_id: int | None = None
    prefix_len: int = 0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("arrival_step", "prompt_len", "output_len", "n", "prefix_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.arrival_step < 0:
            raise ValueError(f"arrival_step must be >= 0, got {self.arrival_step}")
        for name in ("prompt_len", "output_len", "n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_id is not None and (
            not isinstance(self.prefix_id, int) or isinstance(self.prefix_id, bool)
        ):
            raise ValueError(f"prefix_id must be an integer or null, got {self.prefix_id!r}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(
                f"prefix_len must be in [0, prompt_len={self.prompt_len}], got {self.prefix_len}"
            )
        if self.prefix_id is None and self.prefix_len:
            raise ValueError("prefix_len > 0 needs a prefix_id")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
                raise ValueError(f"max_tokens must be an integer or null, got {self.max_tokens!r}")
            if self.max_tokens < self.output_len:
                raise ValueError(
                    f"max_tokens ({self.max_tokens}) must be >= output_len ({self.output_len})"
                )

    def to_dict(self) -> dict[str, int | None]:
        """The record as a JSON-ready dict (the JSONL line format)."""
        return asdict(self)


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of the synthetic ShareGPT-like workload (all lengths in tokens).

    Prompt and output lengths are independent log-normals, ``L = round(exp(N(mu, sigma)))``
    with ``mu = ln(median)``, clipped to ``[1, max_model_len - 1]`` and then the output to
    ``max_model_len - prompt_len``. With the defaults the unclipped means are
    ``median * exp(sigma**2 / 2)`` = 98 * 1.65 = 162 (prompt) and 164 * 2.05 = 337 (output),
    ShareGPT's averages in the vLLM paper (§6.1, Fig. 11). Clipping to ``max_model_len = 2048``
    lowers the drawn output mean to ~306; the median output (~161) is about half the mean
    (mostly short generations) and ~6.5% of outputs exceed 1000 tokens (a few long ones).

    Arrivals are a Poisson process of ``arrival_rate`` requests per step (exponential gaps,
    floored to whole steps). The default rate offers more work than a 65,536-slot pool can
    serve under either allocator, so a queue builds: the regime where memory efficiency sets
    throughput (the vLLM paper's high request rates, §6.2).

    ``max_tokens`` is the smallest power of two >= the output length (at least
    ``min_max_tokens``), capped at ``max_model_len - prompt_len``: Orca (Pow2) (§6.1).

    Attributes:
        num_requests: records to draw (>= 1).
        seed: seed of the private ``random.Random`` (same seed, same workload).
        max_model_len: longest prompt + output (>= 2).
        arrival_rate: mean arrivals per step (> 0).
        prompt_median, prompt_sigma: log-normal prompt length parameters.
        output_median, output_sigma: log-normal output length parameters.
        min_max_tokens: floor of the power-of-two ``max_tokens`` cap.
        parallel_fraction: probability that a request asks for ``parallel_n`` samples.
        parallel_n: samples of a parallel request (>= 2).
        prefix_fraction: probability that a request starts with one of ``num_prefixes``
            shared system prompts of ``prefix_len`` tokens (added to its prompt).
        num_prefixes, prefix_len: the shared system prompts.
    """

    num_requests: int = 1000
    seed: int = 0
    max_model_len: int = 2048
    arrival_rate: float = 0.5
    prompt_median: float = 98.0
    prompt_sigma: float = 1.0
    output_median: float = 164.0
    output_sigma: float = 1.2
    min_max_tokens: int = 16
    parallel_fraction: float = 0.0
    parallel_n: int = 4
    prefix_fraction: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 256

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0, got {self.arrival_rate}")
        for name in ("prompt_median", "output_median", "prompt_sigma", "output_sigma"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("parallel_fraction", "prefix_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.parallel_n < 2:
            raise ValueError(f"parallel_n must be >= 2, got {self.parallel_n}")
        if self.num_prefixes < 1 or not 1 <= self.prefix_len < self.max_model_len - 1:
            raise ValueError("need num_prefixes >= 1 and 1 <= prefix_len < max_model_len - 1")
        if self.min_max_tokens < 1:
            raise ValueError(f"min_max_tokens must be >= 1, got {self.min_max_tokens}")


def _lognormal_len(rng: random.Random, median: float, sigma: float, hi: int) -> int:
    return max(1, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def default_workload(spec: WorkloadSpec | None = None) -> tuple[WorkloadRequest, ...]:
    """Draw the ShareGPT-like workload described by ``spec`` (defaults: :class:`WorkloadSpec`).

    Deterministic for a given spec (a private ``random.Random(spec.seed)``; no global state).
    """
    spec = spec or WorkloadSpec()
    rng = random.Random(spec.seed)
    mml = spec.max_model_len
    out: list[WorkloadRequest] = []
    t = 0.0
    for _ in range(spec.num_requests):
        t += rng.expovariate(spec.arrival_rate)
        prompt = _lognormal_len(rng, spec.prompt_median, spec.prompt_sigma, mml - 1)
        prefix_id, prefix_len = None, 0
        if rng.random() < spec.prefix_fraction:
            prefix_id = rng.randrange(spec.num_prefixes)
            prefix_len = spec.prefix_len
            prompt = min(mml - 1, prompt + prefix_len)
        output = _lognormal_len(rng, spec.output_median, spec.output_sigma, mml - prompt)
        n = spec.parallel_n if rng.random() < spec.parallel_fraction else 1
        cap = max(spec.min_max_tokens, 1 << (output - 1).bit_length())
        max_tokens = max(output, min(cap, mml - prompt))
        out.append(WorkloadRequest(int(t), prompt, output, n, prefix_id, prefix_len, max_tokens))
    return tuple(out)


def load_workload(path: str | Path) -> tuple[WorkloadRequest, ...]:
    """Read a workload from a JSONL file: one JSON object per line, blank lines ignored.

    Each object has ``arrival_step``, ``prompt_len`` and ``output_len`` (integers) and
    optionally ``n`` (default 1), ``prefix_id`` (int or null), ``prefix_len`` (default 0) and
    ``max_tokens`` (int or null). Records are returned sorted by ``arrival_step`` (stable).

    Raises:
        FileNotFoundError: missing file.
        ValueError: ``"{path}:{line}: ..."`` for invalid JSON, a non-object, a missing or
            unknown field, or an out-of-range value; also for a file with no records.
    """
    path = Path(path)
    records: list[WorkloadRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in _REQUIRED if k not in obj]
            if missing:
                raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
            unknown = sorted(set(obj) - set(_FIELDS))
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
            try:
                records.append(WorkloadRequest(**obj))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    if not records:
        raise ValueError(f"{path}: no records")
    return tuple(sorted(records, key=lambda r: r.arrival_step))


def save_workload(path: str | Path, workload: tuple[WorkloadRequest, ...]) -> None:
    """Write ``workload`` as JSONL (the format :func:`load_workload` reads)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in workload:
            f.write(json.dumps(r.to_dict()) + "\n")
