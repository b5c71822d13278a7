"""Configuration of the scheduler: admission, batching and prefix-caching policy.

A frozen dataclass validated in ``__post_init__`` (``ValueError`` naming the field); Ray
pickles it to the scheduler actor.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
SCHEDULING_POLICIES = ("fcfs", "priority")
ADMISSION_RESERVES = ("none", "max_tokens", "max_model_len")
PREEMPTION_MODES = ("recompute", "swap", "auto")
ADMISSION_POLICIES = ("projected", "fits-now")
PREEMPTION_VICTIMS = ("least-waste", "latest")
SPECULATIVE_METHODS = ("ngram", "draft")
# NOTE: measured on ShareGPT prompts with n-gram proposals (benchmarks/RESULTS.md,
# "Speculative decoding"): TPOT 1.19x / 1.13x / 1.07x at batch 1 / 4 / 16, 0.71x at 64.
# Proposals stop at 32, the doubling between the last batch that did not lose and the
# first that clearly did.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose tokens cheaply, verify them in one model step.

    Each decode of a sequence carries up to ``num_speculative_tokens`` proposed tokens; the
    worker runs the last known token and the proposals as one chunk and keeps the
    proposals its own sampling agrees with, plus one token it samples after them (see
    :mod:`pagedserve.scheduler.proposer` and :mod:`pagedserve.worker.spec_decode`).

    Attributes:
        method: ``"ngram"``: prompt lookup, the continuation of the last earlier
            occurrence of the sequence's trailing n-gram in its prompt and outputs.
            ``"draft"``: a small model with the target's vocabulary proposes, on the
            worker, by K greedy decode steps in its own KV pool
            (:mod:`pagedserve.worker.draft_model`).
        num_speculative_tokens: K, the most tokens proposed per decode (>= 1); each
            decode reserves K lookahead slots and counts K + 1 tokens of the budget.
        ngram_min: shortest n-gram matched (>= 1).
        ngram_max: longest n-gram matched (>= ngram_min); longer ones are tried first.
        disable_by_batch_size: a worker step whose running batch holds at least this many
            sequences proposes nothing (and may be overlapped): verification costs more
            than it saves in a large batch (vLLM's ``speculative_disable_by_batch_size``).
            Default :data:`DEFAULT_DISABLE_BY_BATCH_SIZE` (32, from the batch sweep in
            benchmarks/RESULTS.md); None: always propose.
        draft_model: with ``method="draft"`` (and only then): the draft model, a
            Hugging Face folder or ``"default"``, resolved as the target is
            (:class:`~pagedserve.worker.config.ModelConfig`).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}"
            )
        if not isinstance(self.ngram_min, int) or self.ngram_min < 1:
            raise ValueError(f"ngram_min must be an int >= 1, got {self.ngram_min!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(
                f"disable_by_batch_size must be >= 2 or None, got {self.disable_by_batch_size!r}"
            )
        if not isinstance(self.ngram_max, int) or self.ngram_max < self.ngram_min:
            raise ValueError(
                f"ngram_max must be an int >= ngram_min ({self.ngram_min}), got {self.ngram_max!r}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (--draft-model)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(
                f"draft_model is only used by speculative method 'draft', not {self.method!r}"
            )


# The token budget a step gets by default. CPU: 1,024, measured on the 2-core EPYC VM
# through `vllm bench serve` (benchmarks/RESULTS.md, "The token budget on CPU"): the same
# output tok/s as 2,048 on ShareGPT and 32 x 64 at once, TTFT mean 0.92x / 0.88x (prompts
# finish in more, shorter steps) and ShareGPT TPOT p99 0.78x. Other devices: 2,048.
CPU_MAX_NUM_BATCHED_TOKENS = 1024
MAX_NUM_BATCHED_TOKENS = 2048


def default_max_num_batched_tokens(device: str) -> int:
    """The default step token budget for workers on ``device`` (``"cpu"``, ``"cuda:0"``,
    ...): :data:`CPU_MAX_NUM_BATCHED_TOKENS` on CPU, else :data:`MAX_NUM_BATCHED_TOKENS`."""
    if device.split(":", 1)[0] == "cpu":
        return CPU_MAX_NUM_BATCHED_TOKENS
    return MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batching policy.

    Attributes:
        max_num_seqs: most sequences running on one worker in one step.
        max_num_batched_tokens: token budget of one step (decodes count 1, prefill chunks
            count their length; long prompts are chunked to fit). ``None``: the serving
            default of the workers' device (:func:`default_max_num_batched_tokens`), which
            the launcher fills in once the workers report it (the :class:`Scheduler`
            requires it set); ``pagedserve serve`` passes ``None`` unless told. The
            offline ``LLM`` keeps 2,048 (throughput, not first-token latency; vLLM's
            offline ``LLM`` also takes a larger budget than its server).
        enable_chunked_prefill: split prompts longer than the remaining budget.
        enable_prefix_caching: share full prompt blocks across requests by block hash.
        max_model_len: longest sequence (prompt + output), tokens. ``None`` until the
            launcher fills it in from the workers' model (the :class:`Scheduler` requires
            it set); users set the model's ``max_model_len`` instead.
        routing: how a new request picks its worker: ``prefix`` (longest cached prefix,
            unless that worker is too loaded), ``least-loaded`` or ``round-robin`` (see
            :mod:`pagedserve.scheduler.routing`).
        routing_load_threshold: ``prefix`` routing sends a request to the least-loaded
            worker instead when the prefix-holding worker's load (sequences running or
            queued there) exceeds it by more than this many sequences.
        scheduling_policy: ``fcfs`` (admission and preemption by arrival) or ``priority``
            (by ``SamplingParams.priority``, lower first, then arrival).
        admission_reserve: ``"none"`` (paged: blocks as a sequence grows); or, to measure
            what paging buys (``benchmarks/memory/capacity.py``), admit a sequence only when the
            pool can hold its whole reservation, as pre-paging servers did:
            ``"max_tokens"`` reserves prompt + max_tokens, ``"max_model_len"`` reserves
            max_model_len (both capped at the pool size).
        preemption_mode: how a running sequence gives its blocks back: ``"recompute"``
            (free them; prefill again later), ``"swap"`` (copy them to the host block
            store and back; recompute when the store is full or unreachable) or
            ``"auto"`` (per victim, whichever the cost model estimates cheaper; see
            :mod:`pagedserve.scheduler.swap`). Swap needs a host store (``SwapSpec``).
        admission: ``"projected"`` admits a waiting sequence only while the
            projected peak of the worker's pool, over the steps until its running
            sequences finish, still fits (:mod:`pagedserve.scheduler.admission`);
            ``"fits-now"`` admits whatever fits the free pool now and preempts as
            sequences grow (vLLM v1's rule). Not applied with an ``admission_reserve``.
        admission_growth_ratio: in (0, 1]: the share of each sequence's remaining
            ``max_tokens`` the projection assumes it still generates. 1.0 never admits a
            sequence whose growth would force a preemption later; smaller values admit
            more (sequences that stop early leave room) at the risk of preempting.
        preemption_victim: which running sequence gives its blocks up when one cannot
            grow: ``"least-waste"`` (default: among the least urgent younger ones, the one
            whose preemption discards the fewest computed tokens;
            :mod:`pagedserve.scheduler.preemption`) or ``"latest"`` (the least urgent,
            latest arrival).
        async_scheduling: overlapped scheduling: the scheduler plans and sends a
            worker's step t+1 while step t runs (assuming each decode of t yields one
            token; reconciled when t's answer arrives), so the worker does not idle
            between steps. False: plan each step after the previous answer.
        step_deadline_floor_s: the step deadline's floor, seconds. A step unanswered
            after ``max(step_deadline_floor_s, step_deadline_factor x the worker's
            moving-average step time)`` marks its worker suspect: its sequences are
            requeued as after a death, the late answer is discarded, and the worker
            rejoins when it answers the liveness probe (see
            :mod:`pagedserve.scheduler.engine_loop`). 0 disables the deadline. The
            default is generous: a first step (warm-up, compilation) may be slow.
        step_deadline_factor: the multiple of the moving-average step time (0: the
            floor alone).
        host_prefix_cache: the host tier of the prefix cache
            (:mod:`pagedserve.scheduler.host_prefix`): cached blocks evicted from a
            worker's pool are spilled to its node's host store and loaded back on a hit
            when that beats recomputing them. Runs only with prefix caching and a host
            store (``SwapSpec``).
        host_prefix_cache_fraction: in (0, 1]: the share of each store's host blocks the
            tier may hold; swap preemption may take the tier's blocks too (it evicts the
            tier's least recently used ones when the store is short).
        speculative_config: speculative decoding (:class:`SpeculativeConfig`); None: off.
            Beam-search requests are refused while it is on. Decode steps are then not
            overlapped (:meth:`~pagedserve.scheduler.scheduler.Scheduler.can_plan_past`).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    routing: str = "prefix"
    routing_load_threshold: int = 8
    scheduling_policy: str = "fcfs"
    admission_reserve: str = "none"
    preemption_mode: str = "recompute"
    admission: str = "fits-now"
    admission_growth_ratio: float = 1.0
    preemption_victim: str = "least-waste"
    async_scheduling: bool = True
    step_deadline_floor_s: float = 30.0
    step_deadline_factor: float = 20.0
    host_prefix_cache: bool = True
    host_prefix_cache_fraction: float = 0.5
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.routing_load_threshold < 0:
            raise ValueError(
                f"routing_load_threshold must be >= 0, got {self.routing_load_threshold}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.admission_reserve not in ADMISSION_RESERVES:
            raise ValueError(
                f"admission_reserve must be one of {ADMISSION_RESERVES}, "
                f"got {self.admission_reserve!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}"
            )
        if not 0.0 < self.admission_growth_ratio <= 1.0:
            raise ValueError(
                f"admission_growth_ratio must be in (0, 1], got {self.admission_growth_ratio}"
            )
        if not self.step_deadline_floor_s >= 0.0:
            raise ValueError(
                f"step_deadline_floor_s must be >= 0 (0: no deadline), "
                f"got {self.step_deadline_floor_s}"
            )
        if not self.step_deadline_factor >= 0.0:
            raise ValueError(f"step_deadline_factor must be >= 0, got {self.step_deadline_factor}")
        if not 0.0 < self.host_prefix_cache_fraction <= 1.0:
            raise ValueError(
                f"host_prefix_cache_fraction must be in (0, 1], "
                f"got {self.host_prefix_cache_fraction}"
            )
        if self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            raise ValueError(
                "speculative_config must be a SpeculativeConfig or None, "
                f"got {type(self.speculative_config).__name__}"
            )
        if self.preemption_victim not in PREEMPTION_VICTIMS:
            raise ValueError(
                f"preemption_victim must be one of {PREEMPTION_VICTIMS}, "
                f"got {self.preemption_victim!r}"
            )
