"""Swap-to-host metadata and policy: host block ids, swapped groups, the cost model.

Pure Python (no torch, no gRPC): the scheduler owns *which* host block holds *which*
sequence's KV; the host block store (:mod:`pagedserve.worker.host_store`) holds the bytes,
and the workers move them (``SchedulerOutput.swap_plan``, a :class:`SwapPlan`).

Cost model (``preemption_mode="auto"``): swapping a victim moves its KV bytes out and back
in, ``2 * bytes / bandwidth`` seconds; recomputing it costs a prefill of its computed
tokens, ``tokens * prefill_s_per_token``. Both rates are measured by a worker at startup
(a round trip through the store, a prefill of a few hundred tokens) and refined with an
exponential moving average from observed transfers and steps.

A group resumed by a worker of another store (a remote swap-in: the worker pulls its
host blocks from the store that holds them) moves its bytes once, ``bytes / bandwidth``
with the bandwidth of that (worker, store) pair (``SwapSpec.pull_bandwidth_bytes_per_s``,
measured at startup, refined by the pulls); an unmeasured pair is never pulled from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.host_prefix import HostPrefixStats

_EMA = 0.2  # weight of a new observation
_MIN_STEP_TOKENS = 64  # steps this large are prefill-dominated: they refine s/token


@dataclass(frozen=True)
class SwapSpec:
    """What the scheduler knows about one worker's host block store, measured at startup
    by that worker.

    Attributes:
        num_host_blocks: KV blocks the store holds (``swap_space // block_bytes``).
        block_bytes: bytes of one KV block, all layers, K and V.
        bandwidth_bytes_per_s: measured one-way swap bandwidth between the worker and the
            store (> 0).
        prefill_s_per_token: measured prefill cost of the worker, seconds per token (> 0).
        host_store_address: ``host:port`` of the store, for reconnecting a worker that
            Ray restarted (None: not known).
        store_id: names the store; workers whose specs share it share one host block pool
            (the launcher uses the Ray node id: one store per node).
        remote_address: ``host:port`` where workers of other stores reach this worker's
            store (its node's address); None: they cannot, its groups never move.
        pull_bandwidth_bytes_per_s: ``store_id`` of another store -> measured bytes/s of
            this worker pulling blocks from it (> 0); a store not named is unmeasured and
            never pulled from.
    """

    num_host_blocks: int
    block_bytes: int
    bandwidth_bytes_per_s: float
    prefill_s_per_token: float
    host_store_address: str | None = None
    store_id: str = ""
    remote_address: str | None = None
    pull_bandwidth_bytes_per_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_host_blocks < 0 or self.block_bytes < 1:
            raise ValueError(
                f"num_host_blocks must be >= 0 and block_bytes >= 1, got "
                f"{self.num_host_blocks} and {self.block_bytes}"
            )
        if not (self.bandwidth_bytes_per_s > 0 and self.prefill_s_per_token > 0):
            raise ValueError("bandwidth_bytes_per_s and prefill_s_per_token must be > 0")
        bad = {k: v for k, v in self.pull_bandwidth_bytes_per_s.items() if not v > 0}
        if bad:
            raise ValueError(f"pull_bandwidth_bytes_per_s must be > 0, got {bad}")


def swap_specs(
    swap: SwapSpec | Mapping[int, SwapSpec] | None, worker_ids: Iterable[int]
) -> dict[int, SwapSpec]:
    """Each worker's :class:`SwapSpec`: one spec is every worker's (one shared store); a
    mapping names the workers that may swap (the others preempt by recompute only).

    Raises:
        ValueError: a mapping names an unknown worker, or two specs of one ``store_id``
            disagree on the store's size (``num_host_blocks``, ``block_bytes``).
    """
    ids = list(worker_ids)
    if swap is None:
        return {}
    if isinstance(swap, SwapSpec):
        return dict.fromkeys(ids, swap)
    unknown = sorted(set(swap) - set(ids))
    if unknown:
        raise ValueError(f"swap specs name unknown workers {unknown}")
    sizes: dict[str, tuple[int, int]] = {}
    for wid, spec in swap.items():
        size = (spec.num_host_blocks, spec.block_bytes)
        if sizes.setdefault(spec.store_id, size) != size:
            raise ValueError(
                f"worker {wid}: store {spec.store_id!r} is {size} (blocks, bytes) here and "
                f"{sizes[spec.store_id]} for another worker"
            )
    return dict(swap)


class CostModel:
    """Estimated seconds of swapping vs recomputing a victim (see the module docstring)."""

    def __init__(self, bandwidth_bytes_per_s: float, prefill_s_per_token: float) -> None:
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.prefill_s_per_token = prefill_s_per_token

    def swap_s(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes`` out and back in."""
        return 2.0 * num_bytes / self.bandwidth_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` again."""
        return num_tokens * self.prefill_s_per_token

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        """Refine the bandwidth from one finished transfer."""
        if num_bytes > 0 and seconds > 0:
            bw = num_bytes / seconds
            self.bandwidth_bytes_per_s += _EMA * (bw - self.bandwidth_bytes_per_s)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Refine seconds per prefill token from a large (prefill-dominated) step."""
        if num_tokens >= _MIN_STEP_TOKENS and seconds > 0:
            per = seconds / num_tokens
            self.prefill_s_per_token += _EMA * (per - self.prefill_s_per_token)


class HostBlockPool:
    """Free list of host block ids ``[0, num_blocks)`` (metadata only).

    Raises:
        ValueError: ``num_blocks`` < 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` host block ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for i in out:
            self._is_free[i] = False
        return out

    def free(self, ids: list[int]) -> None:
        """Return ids to the pool.

        Raises:
            IntegrityError: an id is out of range or already free.
        """
        for i in ids:
            if not 0 <= i < self.num_blocks or self._is_free[i]:
                raise IntegrityError(f"host block {i} freed twice or unknown")
            self._is_free[i] = True
            self._free.append(i)


@dataclass
class SwapGroup:
    """Sequences of one request swapped out together (they may share blocks).

    Attributes:
        transfer_id: the swap-out transfer that wrote the group.
        request_id: their request.
        host_tables: seq_id -> host block id per logical block (shared blocks appear in
            several tables under the same id).
        num_tokens: seq_id -> KV slots of its table that hold computed tokens (its table
            may cover more: slots of a step in flight, see ``late``).
        worker_id: the worker that swapped it out (its store holds the group).
        pending: the swap-out is in flight (the group cannot be resumed yet).
        late: overlapped scheduling: seq_id -> ``(step_id, num_tokens)`` of the step that
            was in flight for that member when it was swapped out. The swap-out runs after
            that step on the worker, so its table covers those slots too; when that step's
            answer arrives it is applied to the waiting member (tokens kept, not redone).
        handoff: swapped out by a prefill worker for a decode worker
            (:mod:`pagedserve.scheduler.disagg`): another store's worker pulls it
            whenever it can reach the store, whatever the costs.
    """

    transfer_id: str
    request_id: str
    host_tables: dict[str, list[int]]
    num_tokens: dict[str, int]
    worker_id: int
    pending: bool = True
    late: dict[str, tuple[int, int]] = field(default_factory=dict)
    handoff: bool = False

    def host_ids(self) -> set[int]:
        """Every host block some member's table holds."""
        return {h for table in self.host_tables.values() for h in table}


@dataclass
class InFlight:
    """A transfer sent to a worker whose result is not back yet.

    ``kind``: "out" (swap-out of ``group``), "in" (swap-in of ``group``; ``seq_ids`` are
    its members now running) or "free" (``host_ids`` being freed on the store).
    ``step_id``: the worker step that carries it (its answer resolves it; with overlapped
    scheduling a later step of the same worker may be in flight too).
    ``store_id``: the store whose host blocks ``host_ids`` are (None: the worker's own; a
    remote swap-in names the store it pulls from).
    """

    kind: str
    transfer_id: str
    group: SwapGroup | None
    host_ids: list[int]
    step_id: int
    seq_ids: list[str] = field(default_factory=list)
    store_id: str | None = None


@dataclass(frozen=True)
class WorkerSwapStats:
    """One worker's swap counters since start (``GetStats`` per worker).

    Attributes:
        can_swap: it has a host block store (False: it preempts by recompute only).
        num_swap_outs, num_swap_ins: its finished transfers (groups).
        num_swap_failures: its transfers that failed.
        num_remote_swap_ins: its finished swap-ins pulled from another store (also
            counted in ``num_swap_ins``).
        remote_swap_in_bytes: payload bytes of those pulls.
    """

    can_swap: bool = False
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swap_failures: int = 0
    num_remote_swap_ins: int = 0
    remote_swap_in_bytes: int = 0


@dataclass(frozen=True)
class SwapStats:
    """Swap counters since start (``GetStats``, ``pagedserve stats``, metrics).

    Attributes:
        preemption_mode: recompute, swap or auto.
        num_requests_swapped: sequences whose KV is in the host store now.
        host_blocks_total: host blocks (0 without a store).
        host_blocks_free: host blocks no sequence holds.
        swap_out_bytes, swap_in_bytes: payload bytes moved by finished transfers.
        num_swap_outs, num_swap_ins: finished transfers (groups).
        num_swap_failures: transfers that failed (their sequences were recomputed).
        num_remote_swap_ins, remote_swap_in_bytes: the swap-ins (and their bytes) pulled
            by a worker from another worker's store (included in the totals above).
        bandwidth_bytes_per_s: the cost model's current bandwidth estimate (0 without).
        prefill_s_per_token: its current prefill estimate (0 without).
        preemptions_by_mode: preemptions since start, "recompute" and "swap".
        host_prefix: the host tier of the prefix cache (:class:`HostPrefixStats`).
    """

    preemption_mode: str = "recompute"
    num_requests_swapped: int = 0
    host_blocks_total: int = 0
    host_blocks_free: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swap_failures: int = 0
    num_remote_swap_ins: int = 0
    remote_swap_in_bytes: int = 0
    bandwidth_bytes_per_s: float = 0.0
    prefill_s_per_token: float = 0.0
    preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    host_prefix: HostPrefixStats = field(default_factory=HostPrefixStats)
