"""Step-by-step replay of a workload through the paged or the contiguous KV allocator.

Both allocators get the same memory, ``num_slots`` KV token slots (paged: ``num_slots //
block_size`` blocks). One step = one iteration of continuous batching (Orca-style, vLLM paper
§2.3, §4.5):

1. Requests whose ``arrival_step`` has come join the back of the waiting queue.
2. Decode: every running request, oldest first, writes the KV of its newest token in each
   sample and generates one more token. When the paged pool is dry, the newest running
   request is preempted by recompute (all its blocks freed, put back at the head of the
   queue, its outputs kept and re-prefilled with the prompt on resumption, §4.5), then the
   write is retried. The contiguous baseline reserved the maximum upfront, so never preempts.
3. Admission, strictly first-come-first-served and skipped in a step that preempted: the
   head of the queue is admitted while its memory fits (paged: the prompt's blocks, minus
   prefix-cache hits, plus one block per sample for the first output token; contiguous: a
   free run of the full reservation per sample). Its prefill writes the prompt's KV and
   generates its first token.
4. Measurement (see :class:`SimReport`), then requests that generated ``output_len`` tokens
   finish and release their memory.

Pure Python; no torch. Deterministic for a given workload and config.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pagedserve.sim.backends import (
    MAX_SAMPLES,
    ContiguousBackend,
    Group,
    PagedBackend,
)
from pagedserve.sim.contiguous import RESERVE_MODES
from pagedserve.sim.workload import WorkloadRequest

ALLOCATORS = ("paged", "contiguous")


@dataclass(frozen=True)
class SimConfig:
    """One simulation.

    Attributes:
        allocator: ``"paged"`` or ``"contiguous"``.
        num_slots: KV token slots of the pool (>= 1).
        block_size: tokens per block (paged only; >= 1, <= num_slots).
        max_model_len: longest prompt + output (tokens, >= 2, < 2**24).
        reserve: contiguous reservation, ``"max_model_len"`` or ``"max_tokens"``.
        enable_prefix_caching: paged prefix sharing by block hash.
        check_every: run the allocator's integrity check every this many steps (0: only at
            the end, where every block/slot must also be free).
        snapshot_step: step at which to record a slot map (None: none).
        max_steps: safety bound on simulated steps.

    Raises:
        ValueError: on an invalid field, naming it.
    """

    allocator: str = "paged"
    num_slots: int = 65536
    block_size: int = 16
    max_model_len: int = 2048
    reserve: str = "max_model_len"
    enable_prefix_caching: bool = True
    check_every: int = 0
    snapshot_step: int | None = None
    max_steps: int = 10_000_000

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if not 1 <= self.block_size <= self.num_slots:
            raise ValueError(
                f"need 1 <= block_size <= num_slots, got {self.block_size}, {self.num_slots}"
            )
        if not 2 <= self.max_model_len < 1 << 24:
            raise ValueError(f"max_model_len must be in [2, 2**24), got {self.max_model_len}")
        if self.reserve not in RESERVE_MODES:
            raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {self.reserve!r}")
        if self.check_every < 0 or self.max_steps < 1:
            raise ValueError("check_every must be >= 0 and max_steps >= 1")


@dataclass(frozen=True)
class SimReport:
    """Figures of one simulation. Per-step quantities are sampled in step phase 4 (after
    admission, before completions), so a request counts in every step it runs.

    Attributes:
        allocator, block_size, num_slots, reserve: the configuration (``block_size`` is
            meaningful for paged only, ``reserve`` for contiguous only).
        steps: steps until the last request finished.
        completed: requests finished (all of them, unless ``max_steps`` cut the run).
        preemptions: recompute preemptions (paged only).
        utilisation: mean over steps with held memory of ``live / held``, where ``live`` =
            distinct slots holding written KV (a shared block counts once) and ``held`` =
            slots held by running requests (paged: blocks with ``ref_count > 0`` times
            ``block_size``; contiguous: reserved runs). The vLLM paper's "token states"
            share of used KV memory (§2.3, Fig. 2; §3).
        internal_waste: the same mean of ``(held - live) / held``: reserved-but-unwritten
            slots (paged: the unwritten tail of each last block; contiguous: the unwritten
            rest of each run). Equals ``1 - utilisation``.
        external_fragmentation: mean, over steps in which the head of the queue was left
            waiting, of free slots lying in runs too short for the head's reservation,
            as a fraction of ``num_slots``. 0 for paged: any free block is usable.
            (Relative to all free slots this would be 1 in every such step, since the head
            was blocked exactly because no run was long enough.)
        frag_blocked_steps: steps in which the head waited although the pool had enough
            free slots in total (so fragmentation alone blocked it). 0 for paged.
        mean_occupancy: mean over steps of ``held / num_slots`` (KV cache usage).
        mean_running, max_running: running requests per step (a request with n samples
            counts once); mean over all steps, and the peak.
        mean_running_seqs: running sequences (samples) per step, mean over all steps.
        tokens_per_step: output tokens generated (all samples; recomputed ones not counted
            twice) / steps.
        mean_tail_waste: mean over (step, running sequence) of its unwritten slots: paged
            ``-w mod block_size`` for ``w`` written tokens (expected ``(block_size - 1) / 2``
            for lengths uniform modulo the block size, the paper's "block_size / 2"),
            contiguous the unwritten rest of its run.
        mean_block_table_len: mean over (step, running sequence) of ``ceil(w / block_size)``
            (paged; 1.0 for contiguous, one run).
        prefix_hit_tokens: tokens served from the prefix cache at admission (paged): shared
            prefixes, and a resumed request's own blocks still cached since its preemption.
    """

    allocator: str
    block_size: int
    num_slots: int
    reserve: str
    steps: int
    completed: int
    preemptions: int
    utilisation: float
    internal_waste: float
    external_fragmentation: float
    frag_blocked_steps: int
    mean_occupancy: float
    mean_running: float
    max_running: int
    mean_running_seqs: float
    tokens_per_step: float
    mean_tail_waste: float
    mean_block_table_len: float
    prefix_hit_tokens: int

    def to_dict(self) -> dict[str, float | int | str]:
        """The report as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class SimResult:
    """A report plus per-step series for plots.

    Attributes:
        report: the figures.
        running: running requests at each step.
        held: slots held at each step.
        live: slots holding written KV at each step.
        snapshot: slot map at ``config.snapshot_step`` (one int per slot: the owning request's
            workload index, ``RESERVED`` or ``FREE`` from :mod:`.backends`), or None.
    """

    report: SimReport
    running: tuple[int, ...]
    held: tuple[int, ...]
    live: tuple[int, ...]
    snapshot: tuple[int, ...] | None


def _validate(workload: Sequence[WorkloadRequest], cfg: SimConfig) -> None:
    for i, r in enumerate(workload):
        if r.prompt_len + r.output_len > cfg.max_model_len:
            raise ValueError(
                f"request {i}: prompt_len + output_len = {r.prompt_len + r.output_len} "
                f"exceeds max_model_len {cfg.max_model_len}"
            )
        if r.n > MAX_SAMPLES:
            raise ValueError(f"request {i}: n must be <= {MAX_SAMPLES}, got {r.n}")


def simulate(workload: Sequence[WorkloadRequest], config: SimConfig) -> SimResult:
    """Replay ``workload`` (sorted by arrival_step) through one allocator.

    Returns:
        The :class:`SimResult`.

    Raises:
        ValueError: invalid workload (length over ``max_model_len``, n too large), or a
            request that cannot fit even into an empty pool (it would wait forever).
        AssertionError: an allocator integrity check failed (a bug).
    """
    cfg = config
    _validate(workload, cfg)
    if cfg.allocator == "paged":
        be: PagedBackend | ContiguousBackend = PagedBackend(
            cfg.num_slots, cfg.block_size, cfg.enable_prefix_caching
        )
    else:
        be = ContiguousBackend(cfg.num_slots, cfg.max_model_len, cfg.reserve)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_step)
    pending = deque(Group(i, workload[i]) for i in order)
    waiting: deque[Group] = deque()
    running: list[Group] = []
    s_running: list[int] = []
    s_held: list[int] = []
    s_live: list[int] = []
    snapshot = None
    util_sum = util_n = 0.0
    ext_sum = 0.0
    ext_n = frag_blocked = 0
    seq_steps = tail_sum = table_sum = 0
    preemptions = completed = tokens = 0
    step = 0
    bs = cfg.block_size
    while pending or waiting or running:
        if step >= cfg.max_steps:
            break
        while pending and pending[0].req.arrival_step <= step:
            waiting.append(pending.popleft())
        # 2. decode, preempting the newest request while the pool is dry
        preempted = False
        i = 0
        while i < len(running):
            g = running[i]
            k = 0
            while k < g.req.n:
                if be.grow(g, k):
                    k += 1
                    continue
                victim = running.pop()
                be.release(victim)
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is g:
                    break
            else:
                for k in range(g.req.n):
                    be.append_token(g, k)
                g.generated += 1
                i += 1
        # 3. FCFS admission
        if not preempted:
            while waiting and be.try_admit(waiting[0]):
                g = waiting.popleft()
                for k in range(g.req.n):
                    be.append_token(g, k)
                g.generated += 1
                running.append(g)
            if waiting and not running:
                raise ValueError(
                    f"request {waiting[0].index} does not fit into an empty {cfg.allocator} "
                    f"pool of {cfg.num_slots} slots"
                )
        # 4. measure
        held = be.held_slots()
        live = held - be.unwritten_slots(running)
        s_running.append(len(running))
        s_held.append(held)
        s_live.append(live)
        if held:
            util_sum += live / held
            util_n += 1
        for g in running:
            n, w = g.req.n, g.written
            seq_steps += n
            if isinstance(be, PagedBackend):
                tail_sum += n * (-w % bs)
                table_sum += n * -(-w // bs)
            else:
                tail_sum += n * (be.reservation(g) - w)
                table_sum += n
        if waiting:
            head = waiting[0]
            if isinstance(be, ContiguousBackend):
                need = be.reservation(head)
                ext_sum += be.alloc.unusable_free_slots(need) / cfg.num_slots
                frag_blocked += be.alloc.num_free_slots >= need * head.req.n
            ext_n += 1
        if step == cfg.snapshot_step:
            snapshot = tuple(be.snapshot(running))
        # 5. completions
        still: list[Group] = []
        for g in running:
            g.forked_now = False
            if g.generated >= g.req.output_len:
                be.release(g)
                completed += 1
                tokens += g.req.n * g.req.output_len
            else:
                still.append(g)
        running = still
        step += 1
        if cfg.check_every and step % cfg.check_every == 0:
            be.check()
    be.check(final=not (pending or waiting or running))
    report = SimReport(
        allocator=cfg.allocator,
        block_size=bs,
        num_slots=cfg.num_slots,
        reserve=cfg.reserve,
        steps=step,
        completed=completed,
        preemptions=preemptions,
        utilisation=util_sum / util_n if util_n else 0.0,
        internal_waste=1.0 - util_sum / util_n if util_n else 0.0,
        external_fragmentation=ext_sum / ext_n if ext_n else 0.0,
        frag_blocked_steps=frag_blocked,
        mean_occupancy=sum(s_held) / (step * cfg.num_slots) if step else 0.0,
        mean_running=sum(s_running) / step if step else 0.0,
        max_running=max(s_running, default=0),
        mean_running_seqs=seq_steps / step if step else 0.0,
        tokens_per_step=tokens / step if step else 0.0,
        mean_tail_waste=tail_sum / seq_steps if seq_steps else 0.0,
        mean_block_table_len=table_sum / seq_steps if seq_steps else 0.0,
        prefix_hit_tokens=be.prefix_hit_tokens,
    )
    return SimResult(report, tuple(s_running), tuple(s_held), tuple(s_live), snapshot)


def sweep_block_sizes(
    workload: Sequence[WorkloadRequest], block_sizes: Sequence[int], config: SimConfig
) -> tuple[SimReport, ...]:
    """Run the paged allocator once per block size (other fields from ``config``).

    Expected shape (block-size trade-off, vLLM paper §7.2): internal waste per sequence grows as
    ``~block_size / 2`` tokens while the block table shrinks as ``1 / block_size``.

    Raises:
        ValueError: as :func:`simulate`, or an empty ``block_sizes``.
    """
    if not block_sizes:
        raise ValueError("block_sizes must not be empty")
    out = []
    for bs in block_sizes:
        cfg = SimConfig(
            allocator="paged",
            num_slots=config.num_slots,
            block_size=bs,
            max_model_len=config.max_model_len,
            reserve=config.reserve,
            enable_prefix_caching=config.enable_prefix_caching,
            check_every=config.check_every,
            max_steps=config.max_steps,
        )
        out.append(simulate(workload, cfg).report)
    return tuple(out)
