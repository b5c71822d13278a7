"""Preemption by swapping to host memory: the swap manager's state and decisions.

:class:`SwapManager` owns the host block pool, the swapped groups, the transfers in
flight and the cost model, and returns decisions (a planned swap-out, a swap-in plan, the
sequences a transfer's failure sends back to recompute); the
:class:`pagedserve.scheduler.scheduler.Scheduler` applies every change to sequences,
queues and device block pools. The metadata types and the cost model are in
:mod:`pagedserve.scheduler.swap`.

Swap-out (:meth:`SwapManager.plan_swap_out`, asked by the scheduler for every victim of a
step): the victim and the other running sequences of its request on that worker (n > 1
choices, beams: they share blocks) leave as one group. Each distinct device block of the
group gets one host block; the device blocks are freed at once (another sequence may take
them in this very step: the worker packs them before anything writes). The group waits at
the front of the queue, keeping its computed tokens, and cannot resume until the worker
reports the transfer (``pending``). The policy declines (the victim is recomputed
instead) when the mode is ``recompute``, the worker has no store, its store is full, a
transfer of this worker failed within the last second, a member already has tokens
scheduled in this step, or, under ``auto``, the worker's cost model estimates recompute
cheaper.

Stores (:func:`pagedserve.scheduler.swap.swap_specs`): each worker that may swap has a
:class:`SwapSpec`; workers whose specs name one ``store_id`` share that store's host
block pool (the launcher starts one store per node), and each worker has its own cost
model (its bandwidth to its store, its prefill cost) and its own backoff. A group lives in
the store of the worker that swapped it out. A worker of another store resumes it by a
remote swap-in (the transfer names the source store's ``remote_address``; the worker pulls
the blocks from there and frees them there) only when :meth:`SwapManager.pull_wins`:
under ``auto``, ``bytes / bandwidth(worker <- that store)`` is below the worker's prefill
cost of the group's tokens (``swap`` pulls whatever it can); always, the pair's bandwidth
measured (``SwapSpec.pull_bandwidth_bytes_per_s``,
refined by each pull; an unmeasured pair never pulls) and the worker not backing off.
Otherwise a thief of another store leaves the group alone (:meth:`SwapManager.pinned`), and
a group routed to such a worker (its worker died) is dissolved and recomputed there. Host
blocks are freed on a store by the next step of any worker of that store, or by the pull.

Swap-in (:meth:`SwapManager.plan_swap_in`, from admission, on whichever worker admits it:
its own, a thief's, or a live one after its worker died; from another store by a pull):
the whole group is admitted at once. Tables are rebuilt as they were shared: each member forks the longest run of full
blocks it shared with a member restored before it and takes fresh blocks for the rest (a
partial block that was shared becomes one copy per holder, so no copy-on-write is needed
in the step that restores them). The worker scatters the host blocks into those blocks
before running the step and frees them on the store.

Failures (store full or dead, checksum): a failed swap-out leaves its members waiting with
no computed tokens (recompute); a failed swap-in takes its members off the worker and
queues them for recompute (:class:`SwapResolution`); a failed pull (the source store or
its node gone, a deadline) is a failed swap-in, and backs off the pulling worker. Host
blocks return to their store's pool only once the worker that touched them answered
(``InFlight.store_id`` names the source store of a pull), so a host id is never reused
while a transfer may still write or read it.

Prefill/decode disaggregation (:mod:`pagedserve.scheduler.disagg`) hands a finished
prefill to a decode worker as a swap-out with ``handoff`` (no mode or cost test; the
group, ``SwapGroup.handoff``, is pulled from another store whenever it is reachable) and a
swap-in there; everything else above applies to it unchanged.

The host tier of the prefix cache (:mod:`pagedserve.scheduler.host_prefix`) lives in the
same host pools: :meth:`SwapManager.plan_spills` copies the cached blocks a device pool
evicted into its store's tier (a swap-out before anything writes them),
:meth:`SwapManager.find_host_prefix` and :meth:`SwapManager.commit_load` load a prompt's
next blocks from a tier (own store, or another by a pull) when that beats recomputing
them; a swap-out that finds its store short takes the tier's LRU blocks first.

Overlapped scheduling (``async_scheduling``: step t+1 is planned while step t runs; the
worker runs its steps one at a time, in order):

- Each transfer is resolved by the answer of the step that carried it
  (``InFlight.step_id``), never by the answer of the step before it.
- A victim may have tokens in step t, in flight. The worker packs the swap-out at the start
  of t+1, after t, so the blocks of those slots are swapped out too
  (``SwapGroup.late``), and t's answer for the member is applied when it arrives, although
  the member now waits (:meth:`SwapManager.take_late`: its computed tokens advance, its
  sampled token is streamed, a stop ends it). If t fails instead, the member resumes from
  its computed tokens and redoes t's (the extra host blocks are freed with the group).
  Beams and sequences with choices still to fork drop t's answer (redone after the
  swap-in), keeping only computed blocks. The blocks t writes are freed with the rest and
  may be reused by t+1 (written only after the pack).
- A swapped group is pinned (``pending``) until its swap-out's answer: it cannot be
  swapped in by a step planned before that answer.
- A step that swaps a group in is not overlapped with the next one
  (``Scheduler.can_plan_past``): if the swap-in fails the worker drops the group, so a
  step planned before that answer would name sequences the worker no longer holds.
  Swap-ins are rare; every other step keeps the overlap.
- A worker death resolves every transfer of its steps in flight as failed (recompute).
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from pagedserve.scheduler.block_pool import EvictedBlock
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.host_prefix import HostEntry, HostPrefixTier, Key
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput, SwapResult, SwapTransfer
from pagedserve.scheduler.request import Sequence, SequenceStatus
from pagedserve.scheduler.swap import (
    CostModel,
    HostBlockPool,
    InFlight,
    SwapGroup,
    SwapSpec,
    SwapStats,
    WorkerSwapStats,
    swap_specs,
)
from pagedserve.scheduler.worker_state import WorkerState

_BACKOFF_S = 1.0  # after a worker's failed transfer, it recomputes for this long
_PULL_EMA = 0.2  # weight of a new pull in its (worker, store) bandwidth
# while spills do not pay: one block spilled every _PROBE_EVERY steps that evict (keeps the
# tier's hit rate measured; a spill's fixed cost is milliseconds on the step path)
_PROBE_EVERY = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True, slots=True)
class Restore:
    """How a swap-in rebuilds one member's table: fork the first ``num_shared_blocks``
    blocks of ``parent`` (a member restored before it; None: nothing shared), take fresh
    blocks for the rest of its ``num_tokens`` stored slots, and compute ``num_new``
    tokens in the step (``host_table``: its host block per logical block)."""

    seq: Sequence
    parent: str | None
    num_shared_blocks: int
    num_tokens: int
    host_table: list[int]
    num_new: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    """A swap-in plan for one group, in restore order (see :class:`Restore`)."""

    group: SwapGroup
    members: list[Restore]
    width: int  # batch seats the group takes (members and their choices to fork)


@dataclass
class SwapResolution:
    """What resolving transfers asks of the scheduler.

    Attributes:
        recompute: waiting sequences whose stored KV is gone: set their computed tokens
            to 0.
        requeue: sequences a failed swap-in restored on ``worker_id``: if still running
            there, take them off the worker and queue them at the front for recompute.
        wake: queued work or free blocks appeared that other workers may take.
    """

    recompute: list[str] = field(default_factory=list)
    requeue: list[str] = field(default_factory=list)
    wake: bool = False


class SwapManager:
    """Swap preemption state and policy (see the module docstring).

    Args:
        config: the preemption mode and batch limits.
        swap: the host block stores (:func:`~pagedserve.scheduler.swap.swap_specs`: one
            spec for every worker, or one per worker that may swap); None preempts by
            recompute only.
        worker_ids: every worker's id.

    Raises:
        ValueError: see :func:`~pagedserve.scheduler.swap.swap_specs`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        swap: SwapSpec | Mapping[int, SwapSpec] | None,
        worker_ids: Iterable[int],
    ) -> None:
        self.config = config
        self.specs = swap_specs(swap, worker_ids)  # worker_id -> its store and costs
        self.host_pools: dict[str, HostBlockPool] = {}  # store_id -> its host blocks
        for spec in self.specs.values():
            self.host_pools.setdefault(spec.store_id, HostBlockPool(spec.num_host_blocks))
        self.costs = {
            wid: CostModel(spec.bandwidth_bytes_per_s, spec.prefill_s_per_token)
            for wid, spec in self.specs.items()
        }
        self.groups: dict[str, SwapGroup] = {}  # seq_id -> its group while swapped
        self._inflight: dict[int, list[InFlight]] = {}  # worker_id -> sent, not answered
        self._host_free_queue: dict[str, list[int]] = {}  # store_id -> ids to free there
        self._next_transfer = 0
        self._backoff_until: dict[int, float] = {}  # worker_id -> recompute until then
        # store_id -> host:port where workers of other stores reach it
        self._remote_addresses = {
            spec.store_id: spec.remote_address
            for spec in self.specs.values()
            if spec.remote_address is not None
        }
        # (worker_id, store_id of another store) -> bytes/s of that worker's pulls from it
        self._pull_bandwidth = {
            (wid, store): bw
            for wid, spec in self.specs.items()
            for store, bw in spec.pull_bandwidth_bytes_per_s.items()
            if store != spec.store_id
        }
        # the host tier of the prefix cache, in the stores' host pools
        self.tier = HostPrefixTier(
            self.host_pools,
            config.host_prefix_cache_fraction,
            config.host_prefix_cache and config.enable_prefix_caching,
        )
        # worker_id -> evicting steps left before its next probe spill (see plan_spills)
        self._probe_wait = dict.fromkeys(self.specs, 0)
        keys = ("out_bytes", "in_bytes", "outs", "ins", "failures", "remote_ins", "remote_bytes")
        self._counts = dict.fromkeys(keys, 0)
        # worker_id -> its finished swap-outs, swap-ins and failed transfers
        self._worker_counts = {wid: dict.fromkeys(keys, 0) for wid in self.specs}

    # ------------------------------------------------------------------ queries
    def is_swapped(self, seq: Sequence) -> bool:
        """Whether ``seq``'s KV is (or is being written) in the host store."""
        return seq.seq_id in self.groups

    def members_of(self, seq: Sequence) -> list[str]:
        """The ids of the sequences swapped in one group with ``seq``, in running order."""
        return list(self.groups[seq.seq_id].host_tables)

    def pinned(self, seq: Sequence, thief: WorkerState | None = None) -> bool:
        """``seq`` may not move to another worker (``thief``, when known): its swap-out is
        in flight (only its own worker sees the result), or its group lives in a store
        ``thief`` does not use and pulling it from there would not beat recomputing it
        (:meth:`pull_wins`)."""
        g = self.groups.get(seq.seq_id)
        if g is None:
            return False
        if g.pending:
            return True
        if thief is None or self.store_of(thief.spec.worker_id) == self._home(g):
            return False
        return not self.pull_wins(thief.spec.worker_id, g)

    def pull_wins(self, worker_id: int, g: SwapGroup) -> bool:
        """Whether ``worker_id``, a worker of another store than ``g``'s, should resume
        ``g`` by pulling its host blocks from that store rather than recompute it: the
        store is reachable from other nodes, the pair's bandwidth is measured, the blocks
        are of one size, the worker is not backing off, and (mode ``auto``; ``swap``
        resumes every group it can, as it swaps every victim) ``bytes / bandwidth`` is
        below the worker's prefill cost of the group's stored tokens."""
        home = self._home(g)
        bandwidth = self._pull_bandwidth.get((worker_id, home))
        spec = self.specs.get(worker_id)
        if spec is None or home not in self._remote_addresses:
            return False
        if spec.block_bytes != self.specs[g.worker_id].block_bytes:
            return False
        if g.handoff:  # NOTE: disaggregation: the prefill is paid for, always pull it
            return self._backed_off_until(worker_id) <= time.monotonic()
        if bandwidth is None or not self._allowed(worker_id):
            return False  # NOTE: an unmeasured pair is never pulled from (conservative)
        if self.config.preemption_mode == "swap":
            return True
        pull_s = len(g.host_ids()) * spec.block_bytes / bandwidth
        return pull_s < self.costs[worker_id].recompute_s(sum(g.num_tokens.values()))

    def store_of(self, worker_id: int) -> str | None:
        """The ``store_id`` of ``worker_id``'s store; None: it preempts by recompute only."""
        spec = self.specs.get(worker_id)
        return None if spec is None else spec.store_id

    def _home(self, g: SwapGroup) -> str:
        """The store holding ``g``: the one of the worker that swapped it out."""
        return self.specs[g.worker_id].store_id

    def has_frees(self, worker_id: int) -> bool:
        """Host blocks wait to be freed on ``worker_id``'s store (by the next step of any
        worker of that store)."""
        store = self.store_of(worker_id)
        return store is not None and bool(self._host_free_queue.get(store))

    def _queue_free(self, store: str, host_ids: Iterable[int]) -> None:
        self._host_free_queue.setdefault(store, []).extend(host_ids)

    def _allowed(self, worker_id: int) -> bool:
        return (
            worker_id in self.costs
            and self.config.preemption_mode != "recompute"
            and time.monotonic() >= self._backed_off_until(worker_id)
        )

    def _backed_off_until(self, worker_id: int) -> float:
        """When ``worker_id``'s backoff after a failed transfer ends (0: none)."""
        return self._backoff_until.get(worker_id, 0.0)

    def _transfer_id(self, kind: str) -> str:
        self._next_transfer += 1
        return f"{kind}-{self._next_transfer}"

    # ------------------------------------------------------------------ swap-out
    def plan_swap_out(
        self,
        ws: WorkerState,
        victim: Sequence,
        scheduled: Container[str],
        handoff: WorkerState | None = None,
    ) -> tuple[list[Sequence], SwapTransfer] | None:
        """Swap out ``victim`` with its request's other running sequences on ``ws``.

        ``scheduled``: the sequences with tokens in the step being planned. ``handoff``:
        the decode worker a prefill worker hands the group to
        (:mod:`pagedserve.scheduler.disagg`): under every preemption mode, without the
        cost test (``SwapGroup.handoff``), and the group must fit that worker's pool. Returns the group (running order) and the
        transfer for this step's plan, the group recorded as swapped and its transfer in
        flight; None, with nothing changed, when the policy declines. The caller takes
        the group off the worker and queues it.
        """
        wid = ws.spec.worker_id
        if handoff is not None:
            allowed = wid in self.costs and time.monotonic() >= self._backed_off_until(wid)
        else:
            allowed = self._allowed(wid)
        if not (ws.alive and allowed):
            return None
        group = [s for s in ws.running if s.request_id == victim.request_id]
        if any(s.seq_id in scheduled for s in group):
            return None  # NOTE: their step's blocks are already handed to the worker
        kv = ws.kv
        bs = ws.spec.block_size
        # Overlapped scheduling: a member's tokens in the step in flight (the one before
        # this) are swapped out too and kept when that step answers (see the module
        # docstring); a beam or a sequence with choices to fork keeps its computed ones.
        in_flight = ws.next_step_id - 1
        late = {
            s.seq_id: (in_flight, s.num_inflight_tokens)
            for s in group
            if s.num_inflight_tokens and not (s.sampling.use_beam_search or s.fork_children)
        }
        tokens_of: dict[str, int] = {}
        for s in group:
            n = (
                s.num_computed_tokens + late[s.seq_id][1]
                if s.seq_id in late
                else s.num_computed_tokens
            )
            tokens_of[s.seq_id] = n if kv.has_seq(s.seq_id) else 0
        tables = {
            sid: kv.get_block_ids(sid)[: _cdiv(n, bs)] if n else [] for sid, n in tokens_of.items()
        }
        unique = list(dict.fromkeys(b for t in tables.values() for b in t))
        room = (ws if handoff is None else handoff).spec.num_blocks
        if not unique or len(unique) + len(group) > room:
            # NOTE: a group resumes whole; one that may not fit even an empty pool (forked
            # choices that grew apart) is recomputed one sequence at a time instead.
            return None
        spec, cost = self.specs[wid], self.costs[wid]
        if self.config.preemption_mode == "auto" and handoff is None:
            nbytes = len(unique) * spec.block_bytes
            tokens = sum(tokens_of.values())
            if cost.swap_s(nbytes) >= cost.recompute_s(tokens):
                return None
        pool = self.host_pools[spec.store_id]
        # NOTE: swap preemption comes first: the host tier gives up its LRU blocks.
        self.tier.reclaim(spec.store_id, len(unique) - pool.num_free_blocks)
        host = pool.allocate(len(unique))
        if host is None:
            return None  # host pool full: recompute
        to_host = dict(zip(unique, host))
        tid = self._transfer_id("out")
        g = SwapGroup(
            transfer_id=tid,
            request_id=victim.request_id,
            host_tables={sid: [to_host[b] for b in t] for sid, t in tables.items()},
            num_tokens={s.seq_id: s.num_computed_tokens if tables[s.seq_id] else 0 for s in group},
            worker_id=wid,
            late={sid: v for sid, v in late.items() if tables[sid]},
            handoff=handoff is not None,
        )
        self._inflight.setdefault(wid, []).append(InFlight("out", tid, g, host, ws.next_step_id))
        for s in group:
            self.groups[s.seq_id] = g
        return group, SwapTransfer(tid, unique, host, [s.seq_id for s in group])

    # ------------------------------------------------------------------ swap-in
    def plan_swap_in(
        self,
        ws: WorkerState,
        seq: Sequence,
        members: list[Sequence],
        budget: int,
        seats: int,
    ) -> SwapIn | SwapResolution | None:
        """How ``seq``'s whole group (``members``: the sequences of its host tables, see
        :meth:`members_of`) would be restored on ``ws`` within ``budget`` tokens and
        ``seats`` taken; None when it does not fit now. A group that can never fit ``ws``
        (a smaller pool than it left, or ``ws`` does not use the group's store) is
        dissolved instead: the resolution names its members to recompute.
        """
        g = self.groups[seq.seq_id]
        if g.pending:
            return None
        if self.store_of(ws.spec.worker_id) != self._home(g) and not self.pull_wins(
            ws.spec.worker_id, g
        ):
            # NOTE: its worker died (routing moved it here) or a thief's pull was costed
            # before its backoff began: recompute here.
            return self._dissolve(g)
        width = len(members) + sum(len(m.fork_children) for m in members)
        if seats + width > self.config.max_num_seqs and seats > 0:
            return None
        steps: list[int] = []
        left = budget
        for m in members:
            need = m.num_tokens - m.num_computed_tokens
            n = min(need, left)
            if need > 0 and (n <= 0 or (n < need and not self.config.enable_chunked_prefill)):
                return None
            steps.append(n)
            left -= n
        bs = ws.spec.block_size
        plan: list[Restore] = []
        need_blocks = 0
        for m, n in zip(members, steps):
            table, tokens = g.host_tables[m.seq_id], g.num_tokens[m.seq_id]
            parent, shared = None, 0
            for other in plan:
                k = 0
                limit = min(len(table), len(other.host_table), min(tokens, other.num_tokens) // bs)
                while k < limit and table[k] == other.host_table[k]:
                    k += 1
                if k > shared:
                    parent, shared = other.seq.seq_id, k
            need_blocks += _cdiv(max(tokens, m.num_computed_tokens + n), bs) - shared
            plan.append(Restore(m, parent, shared, tokens, table, n))
        if need_blocks > ws.spec.num_blocks:
            return self._dissolve(g)  # can never fit here (a smaller pool than it left)
        if need_blocks > ws.kv.num_free_blocks:
            return None
        return SwapIn(g, plan, width)

    def commit_swap_in(
        self, ws: WorkerState, swap_in: SwapIn, block_ids: list[int], host_block_ids: list[int]
    ) -> SwapTransfer:
        """The group of ``swap_in`` now runs on ``ws``, restored into ``block_ids`` from
        ``host_block_ids``: forget it as swapped; its transfer (in flight from now)."""
        g = swap_in.group
        for r in swap_in.members:
            del self.groups[r.seq.seq_id]
        tid = self._transfer_id("in")
        all_host = sorted(g.host_ids())
        seq_ids = [r.seq.seq_id for r in swap_in.members]
        home = self._home(g)
        source = None if home == self.store_of(ws.spec.worker_id) else self._remote_addresses[home]
        self._inflight.setdefault(ws.spec.worker_id, []).append(
            InFlight("in", tid, g, all_host, ws.next_step_id, seq_ids, store_id=home)
        )
        return SwapTransfer(tid, block_ids, host_block_ids, seq_ids, all_host, source)

    # ------------------------------------------------------------------ results
    def take_late(self, seq_id: str, step_id: int, num_new: int, num_computed: int) -> bool:
        """Whether step ``step_id``'s answer (``num_new`` tokens) applies to ``seq_id``,
        swapped out by the step after it (``SwapGroup.late``); if so its table now covers
        ``num_computed`` tokens (its computed tokens once the caller applies the answer)."""
        g = self.groups.get(seq_id)
        if g is None or not g.pending or g.late.pop(seq_id, None) != (step_id, num_new):
            return False
        g.num_tokens[seq_id] = num_computed
        return True

    def host_frees(self, ws: WorkerState) -> tuple[list[int], str]:
        """The host blocks ``ws``'s next step should free on the store, and the transfer
        id naming that free (empty when there are none)."""
        store = self.store_of(ws.spec.worker_id)
        free = [] if store is None else self._host_free_queue.pop(store, [])
        if not free:
            return free, ""
        tid = self._transfer_id("free")
        self._inflight.setdefault(ws.spec.worker_id, []).append(
            InFlight("free", tid, None, free, ws.next_step_id)
        )
        return free, tid

    def _take_inflight(self, worker_id: int, step_id: int | None) -> list[InFlight]:
        """Remove and return ``worker_id``'s transfers carried by steps up to ``step_id``
        (all when None); those of later steps stay in flight."""
        flights = self._inflight.pop(worker_id, None)
        if not flights or step_id is None:
            return flights or []
        later = [f for f in flights if f.step_id > step_id]
        if later:
            self._inflight[worker_id] = later
            return [f for f in flights if f.step_id <= step_id]
        return flights

    def apply_results(
        self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> SwapResolution:
        """Resolve the transfers of ``worker_id``'s step ``sched_out``, which ``runner_out``
        answers, and refine the cost model with its timings."""
        res = SwapResolution()
        for f in self._take_inflight(worker_id, sched_out.step_id):
            r = runner_out.swap_results.get(f.transfer_id)
            self._resolve(worker_id, f, r or SwapResult(False, error="no result"), res)
        cost = self.costs.get(worker_id)
        if cost is not None:
            spent = sum(r.seconds for r in runner_out.swap_results.values())
            cost.observe_step(
                sched_out.total_num_scheduled_tokens, runner_out.execute_time_s - spent
            )
        return res

    def step_failed(self, worker_id: int, step_id: int | None = None) -> SwapResolution:
        """The worker's step ``step_id`` raised (None: the worker died): the transfers of
        that step and earlier ones (None: all) count as failed."""
        res = SwapResolution()
        for f in self._take_inflight(worker_id, step_id):
            self._resolve(worker_id, f, SwapResult(False, error="step failed"), res)
        return res

    def _resolve(self, worker_id: int, f: InFlight, r: SwapResult, res: SwapResolution) -> None:
        """Apply the result ``r`` of ``worker_id``'s transfer ``f`` (on that worker's store)."""
        counts, mine = self._counts, self._worker_counts[worker_id]
        store = self._store_of_flight(worker_id, f)
        remote = store != self.specs[worker_id].store_id
        pool = self.host_pools[store]
        if f.kind == "free":
            pool.free(f.host_ids)
            return
        if f.kind in ("spill", "load"):
            self._resolve_tier(worker_id, f, r, res, store)
            return
        g = f.group
        if g is None:
            raise IntegrityError(f"transfer {f.transfer_id} has no group")
        if not r.ok:
            counts["failures"] += 1
            mine["failures"] += 1
            # NOTE: only this worker backs off: another's store (or link) may be healthy.
            self._backoff_until[worker_id] = time.monotonic() + _BACKOFF_S
        elif remote:
            self._observe_pull(worker_id, store, r)
        else:
            self.costs[worker_id].observe_transfer(r.num_bytes, r.seconds)
        if f.kind == "out":
            if r.ok:
                counts["outs"] += 1
                mine["outs"] += 1
                counts["out_bytes"] += r.num_bytes
                g.pending = False
                self._queue_free(store, sorted(set(f.host_ids) - g.host_ids()))
                res.wake = g.handoff  # its decode worker may be idle, waiting for it
                return
            for sid in list(g.host_tables):
                del self.groups[sid]
                res.recompute.append(sid)
            self._queue_free(store, f.host_ids)  # every id of the transfer
            res.wake = True
            return
        # swap-in: the worker freed the host blocks (or the store is gone)
        pool.free(f.host_ids)
        if r.ok:
            for c in (counts, mine):
                c["ins"] += 1
                c["in_bytes"] += r.num_bytes
                if remote:
                    c["remote_ins"] += 1
                    c["remote_bytes"] += r.num_bytes
            return
        res.requeue.extend(f.seq_ids)
        res.wake = True

    def _store_of_flight(self, worker_id: int, f: InFlight) -> str:
        """The store whose host blocks ``worker_id``'s transfer ``f`` names."""
        return self.specs[worker_id].store_id if f.store_id is None else f.store_id

    def _observe_pull(self, worker_id: int, store: str, r: SwapResult) -> None:
        """Refine the bandwidth of ``worker_id``'s pulls from ``store`` by one pull."""
        key = (worker_id, store)
        if r.num_bytes > 0 and r.seconds > 0 and key in self._pull_bandwidth:
            bw = r.num_bytes / r.seconds
            self._pull_bandwidth[key] += _PULL_EMA * (bw - self._pull_bandwidth[key])

    def _dissolve(self, g: SwapGroup) -> SwapResolution:
        """Give up a stored group: its members wait for recompute, its host blocks go."""
        members = list(g.host_tables)
        for sid in members:
            del self.groups[sid]
        self._queue_free(self._home(g), sorted(g.host_ids()))
        g.host_tables.clear()
        g.num_tokens.clear()
        return SwapResolution(recompute=members)

    def dissolve(self, seq: Sequence) -> SwapResolution | None:
        """Give up the stored KV of ``seq``'s group (its members are recomputed, its host
        blocks freed); None, with nothing changed, while its swap-out is in flight (that
        transfer's answer frees or keeps them)."""
        g = self.groups[seq.seq_id]
        return None if g.pending else self._dissolve(g)

    def forget(self, seq: Sequence) -> None:
        """``seq`` ends while swapped: drop it from its group, free what nobody holds."""
        g = self.groups.pop(seq.seq_id, None)
        if g is None:
            return
        before = g.host_ids()
        g.host_tables.pop(seq.seq_id, None)
        g.num_tokens.pop(seq.seq_id, None)
        if not g.pending:  # else the swap-out's result frees them
            self._queue_free(self._home(g), sorted(before - g.host_ids()))

    # ------------------------------------------------------------------ host prefix tier
    def tier_on(self, worker_id: int) -> bool:
        """Whether ``worker_id`` spills to and loads from the host tier (its store runs
        one)."""
        store = self.store_of(worker_id)
        return store is not None and store in self.tier.caches

    def _load_wins(self, ws: WorkerState, num_blocks: int, bandwidth: float) -> bool:
        """Loading ``num_blocks`` at ``bandwidth`` beats recomputing their tokens on ``ws``
        (mode ``swap`` loads whatever it finds, as it swaps every victim)."""
        if self.config.preemption_mode == "swap":
            return True
        wid = ws.spec.worker_id
        load_s = num_blocks * self.specs[wid].block_bytes / bandwidth
        return load_s < self.costs[wid].recompute_s(num_blocks * ws.spec.block_size)

    def _spills_pay(self, ws: WorkerState) -> bool:
        """Under ``auto``: whether a spilled block is worth its copy at the tier's hit rate
        (:class:`~pagedserve.scheduler.host_prefix.SpillHitRate`). The copy costs
        ``block_bytes / bandwidth`` on the step path now; a later load of it saves the
        recompute of its tokens less that load. Spill while ``rate * saving >= copy``."""
        wid = ws.spec.worker_id
        cost = self.costs[wid]
        move_s = self.specs[wid].block_bytes / cost.bandwidth_bytes_per_s
        saved_s = cost.recompute_s(ws.spec.block_size) - move_s
        return self.tier.hit_rate.rate * saved_s >= move_s

    def plan_spills(self, ws: WorkerState, evicted: list[EvictedBlock]) -> SwapTransfer | None:
        """The transfer copying ``evicted`` (cached blocks the device pool of ``ws``
        evicted while planning this step) to the tier of its store, as a swap-out that
        runs before anything writes them (:meth:`HostPrefixTier.spill`); None when nothing
        is spilled, and under ``auto`` when no load from the own store could beat a
        recompute at the worker's current rates (the spill would be paid for nothing).
        Under ``auto``, while the tier's hit rate says spills do not pay
        (:meth:`_spills_pay`: unique prompts, nothing comes back), one step in
        ``_PROBE_EVERY`` that evicts (counted per worker) spills its newest evicted block
        that the tier lacks and the others none, which keeps the rate measured; ``swap``
        spills every block, as it swaps every victim."""
        wid = ws.spec.worker_id
        if not evicted or not ws.alive or not self.tier_on(wid) or not self._allowed(wid):
            return None
        if not self._load_wins(ws, 1, self.costs[wid].bandwidth_bytes_per_s):
            return None
        limit = None
        if self.config.preemption_mode != "swap" and not self._spills_pay(ws):
            if self._probe_wait[wid] > 0:
                self._probe_wait[wid] -= 1
                return None
            limit = 1
        tid = self._transfer_id("spill")
        planned = self.tier.spill(self.specs[wid].store_id, evicted, tid, limit)
        if planned is None:
            return None
        if limit is not None:  # a probe went out: the next one in _PROBE_EVERY evicting steps
            self._probe_wait[wid] = _PROBE_EVERY - 1
        block_ids, host = planned
        self._inflight.setdefault(wid, []).append(
            InFlight("spill", tid, None, host, ws.next_step_id)
        )
        return SwapTransfer(tid, block_ids, host)

    def find_host_prefix(
        self, ws: WorkerState, seq: Sequence, computed_blocks: list[int]
    ) -> tuple[str, list[HostEntry]] | None:
        """The blocks of ``seq``'s prompt after its device hit ``computed_blocks`` that
        ``ws`` should load from a host tier instead of recomputing them: the longest
        chain in its own store's tier, or in another store's when the pair's pull
        bandwidth is measured, whose ``bytes / bandwidth`` is below the worker's prefill
        cost of those tokens (mode ``auto``; mode ``swap`` loads every chain it finds).
        Returns ``(store_id, entries in block order)``; None: none (or the worker backs
        off after a failed transfer). No side effects."""
        wid = ws.spec.worker_id
        if not self.tier_on(wid) or not self._allowed(wid):
            return None
        kv, spec = ws.kv, self.specs[wid]
        parent = kv.block_hash_of(computed_blocks[-1]) if computed_blocks else None
        if computed_blocks and parent is None:
            return None
        salt = seq.sampling.cache_salt
        keys = kv.prefix_keys(seq.all_token_ids, salt, len(computed_blocks), parent)
        seen: list[Key] = []
        candidates = [(spec.store_id, self.costs[wid].bandwidth_bytes_per_s)]
        candidates += [
            (store, bw)
            for (w, store), bw in self._pull_bandwidth.items()
            if w == wid
            and store in self.tier.caches
            and store in self._remote_addresses
            and self._store_block_bytes(store) == spec.block_bytes
        ]
        best: tuple[str, list[HostEntry]] | None = None
        for store, bandwidth in candidates:
            found = self.tier.chain(store, keys, seen)
            longer = found and (best is None or len(found) > len(best[1]))
            if longer and self._load_wins(ws, len(found), bandwidth):
                best = store, found
        return best

    def _store_block_bytes(self, store: str) -> int:
        """Bytes of one KV block of the workers of ``store``."""
        return next(s.block_bytes for s in self.specs.values() if s.store_id == store)

    def commit_load(
        self,
        ws: WorkerState,
        seq: Sequence,
        found: tuple[str, list[HostEntry]],
        block_ids: list[int],
    ) -> SwapTransfer:
        """``seq`` is admitted on ``ws`` with the blocks ``found`` (:meth:`find_host_prefix`)
        loaded into its fresh device blocks ``block_ids``: pin them; the load's transfer
        (a swap-in that frees nothing, in flight from now)."""
        store, entries = found
        wid = ws.spec.worker_id
        tid = self._transfer_id("load")
        host = self.tier.pin(store, entries, tid, seq.seq_id, ws.spec.block_size)
        source = None if store == self.store_of(wid) else self._remote_addresses[store]
        self._inflight.setdefault(wid, []).append(
            InFlight("load", tid, None, host, ws.next_step_id, [seq.seq_id], store_id=store)
        )
        return SwapTransfer(tid, block_ids, host, [seq.seq_id], [], source)

    def host_prefix_tokens(self, ws: WorkerState, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``ws`` would load from a host tier beyond its device
        hit (routing; no side effects)."""
        if not self.tier_on(ws.spec.worker_id):
            return 0
        salt = seq.sampling.cache_salt
        computed, _ = ws.kv.get_computed_blocks(seq.all_token_ids, salt, count=False)
        found = self.find_host_prefix(ws, seq, computed)
        return 0 if found is None else len(found[1]) * ws.spec.block_size

    def _resolve_tier(
        self, worker_id: int, f: InFlight, r: SwapResult, res: SwapResolution, store: str
    ) -> None:
        """Apply the result of a spill or a load (:meth:`HostPrefixTier.resolve`)."""
        if not r.ok:
            self._backoff_until[worker_id] = time.monotonic() + _BACKOFF_S
        elif store != self.specs[worker_id].store_id:
            self._observe_pull(worker_id, store, r)
        else:
            self.costs[worker_id].observe_transfer(r.num_bytes, r.seconds)
        requeue = self.tier.resolve(store, f.kind, f.transfer_id, r.ok, r.num_bytes, r.seconds)
        if requeue:
            res.requeue.extend(requeue)
            res.wake = True

    # ------------------------------------------------------------------ introspection
    def stats(self, preemptions_by_mode: dict[str, int]) -> SwapStats:
        """Swap counters and host pool occupancy, summed over the stores; the cost
        model's rates are the means over the workers that may swap (see
        :class:`SwapStats`)."""
        c = self._counts
        costs = list(self.costs.values())
        pools = self.host_pools.values()
        return SwapStats(
            preemption_mode=self.config.preemption_mode if costs else "recompute",
            num_requests_swapped=len(self.groups),
            host_blocks_total=sum(p.num_blocks for p in pools),
            host_blocks_free=sum(p.num_free_blocks for p in pools),
            swap_out_bytes=c["out_bytes"],
            swap_in_bytes=c["in_bytes"],
            num_swap_outs=c["outs"],
            num_swap_ins=c["ins"],
            num_swap_failures=c["failures"],
            num_remote_swap_ins=c["remote_ins"],
            remote_swap_in_bytes=c["remote_bytes"],
            bandwidth_bytes_per_s=_mean([m.bandwidth_bytes_per_s for m in costs]),
            prefill_s_per_token=_mean([m.prefill_s_per_token for m in costs]),
            preemptions_by_mode=preemptions_by_mode,
            host_prefix=self.tier.stats(),
        )

    def worker_stats(self, worker_id: int) -> WorkerSwapStats:
        """``worker_id``'s swap counters (see :class:`WorkerSwapStats`)."""
        c = self._worker_counts.get(worker_id)
        if c is None:
            return WorkerSwapStats()
        return WorkerSwapStats(
            True, c["outs"], c["ins"], c["failures"], c["remote_ins"], c["remote_bytes"]
        )

    def check_integrity(self, sequences: Mapping[str, Sequence]) -> None:
        """Every swapped sequence waits in a queue; in each store, host blocks held by
        groups, in flight or queued for freeing are exactly the ones not free in its pool.

        Raises:
            IntegrityError: on the first violation.
        """
        held: dict[str, set[int]] = {store: set() for store in self.host_pools}
        for sid, g in self.groups.items():
            seq = sequences.get(sid)
            if seq is None or seq.status is not SequenceStatus.WAITING:
                raise IntegrityError(f"swapped sequence {sid!r} is not waiting")
            held[self._home(g)] |= g.host_ids()
        for wid, flights in self._inflight.items():
            for f in flights:
                held[self._store_of_flight(wid, f)] |= set(f.host_ids)
        for store, ids in self._host_free_queue.items():
            held[store] |= set(ids)
        for store in self.host_pools:
            held[store] |= self.tier.held(store)
        for store, pool in self.host_pools.items():
            if len(held[store]) + pool.num_free_blocks != pool.num_blocks:
                raise IntegrityError(
                    f"host pool of store {store!r}: {len(held[store])} blocks held + "
                    f"{pool.num_free_blocks} free != {pool.num_blocks}"
                )
