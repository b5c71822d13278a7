"""Preemption by swapping to host memory: the scheduler's swap bookkeeping.

A mixin of :class:`pagedserve.scheduler.scheduler.Scheduler` (as
:mod:`pagedserve.scheduler.forking`); the metadata types and the cost model are in
:mod:`pagedserve.scheduler.swap`.

Swap-out (:meth:`SwapMixin._try_swap_out`, asked by ``_preempt`` for every victim): the
victim and the other running sequences of its request on that worker (n > 1 choices,
beams: they share blocks) leave as one group. Each distinct device block of the group gets
one host block; the device blocks are freed at once (another sequence may take them in
this very step: the worker packs them before anything writes). The group waits at the
front of the queue, keeping its computed tokens, and cannot resume until the worker
reports the transfer (``pending``). The policy declines (the victim is recomputed
instead) when the mode is ``recompute``, the store is missing, full, or failed within the
last second, a member already has tokens scheduled in this step, or, under ``auto``, the
cost model estimates recompute cheaper.

Swap-in (:meth:`SwapMixin._admit_swapped`, from admission, on whichever worker admits
it: its own, a thief's, or a live one after its worker died): the whole group is admitted
at once. Tables are rebuilt as they were shared: each member forks the longest run of
full blocks it shared with a member restored before it and takes fresh blocks for the
rest (a partial block that was shared becomes one copy per holder, so no copy-on-write is
needed in the step that restores them). The worker scatters the host blocks into those
blocks before running the step and frees them on the store.

Failures (store full or dead, checksum): a failed swap-out leaves its members waiting with
no computed tokens (recompute); a failed swap-in takes its members off the worker and
queues them for recompute. Host blocks return to the pool only once the worker that
touched them answered, so a host id is never reused while a transfer may still write it.

Overlapped scheduling (``async_scheduling``: step t+1 is planned while step t runs; the
worker runs its steps one at a time, in order):

- Each transfer is resolved by the answer of the step that carried it
  (``InFlight.step_id``), never by the answer of the step before it.
- A victim may have tokens in step t, in flight. The worker packs the swap-out at the start
  of t+1, after t, so the blocks of those slots are swapped out too
  (``SwapGroup.late``), and t's answer for the member is applied when it arrives, although
  the member now waits (:meth:`SwapMixin._late_answer`: its computed tokens advance, its
  sampled token is streamed, a stop ends it). If t fails instead, the member resumes from
  its computed tokens and redoes t's (the extra host blocks are freed with the group).
  Beams and sequences with choices still to fork drop t's answer (redone after the
  swap-in), keeping only computed blocks. The blocks t writes are freed with the rest and
  may be reused by t+1 (written only after the pack).
- A swapped group is pinned (``pending``) until its swap-out's answer: it cannot be
  swapped in by a step planned before that answer.
- A step that swaps a group in is not overlapped with the next one
  (:meth:`SwapMixin.can_plan_past`): if the swap-in fails the worker drops the group, so
  a step planned before that answer would name sequences the worker no longer holds.
  Swap-ins are rare; every other step keeps the overlap.
- A worker death resolves every transfer of its steps in flight as failed (recompute).
"""

from __future__ import annotations

import time

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import SequenceOutput
from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.forking import ForkingMixin
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput, SwapResult, SwapTransfer
from pagedserve.scheduler.request import Sequence, SequenceStatus
from pagedserve.scheduler.swap import (
    CostModel,
    HostBlockPool,
    InFlight,
    SwapGroup,
    SwapSpec,
    SwapStats,
)
from pagedserve.scheduler.worker_state import WorkerState

_BACKOFF_S = 1.0  # after a failed transfer, recompute for this long before swapping again


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SwapMixin(ForkingMixin):
    """Swap preemption of the :class:`Scheduler` (see the module docstring)."""

    config: SchedulerConfig
    metrics: SchedulerMetrics
    num_preemptions: int

    # Provided by the Scheduler.
    @staticmethod
    def _release(ws: WorkerState, seq: Sequence) -> None:
        raise NotImplementedError

    @staticmethod
    def _delta(seq: Sequence, new_tokens: tuple[int, ...]) -> SequenceOutput:
        raise NotImplementedError

    def _count_computed(self, ws: WorkerState, seq: Sequence, num_new: int) -> None:
        raise NotImplementedError

    def _init_swap(self, spec: SwapSpec | None) -> None:
        self._swap_spec = spec
        self._host_pool = HostBlockPool(spec.num_host_blocks if spec else 0)
        self._cost = (
            CostModel(spec.bandwidth_bytes_per_s, spec.prefill_s_per_token) if spec else None
        )
        self._groups: dict[str, SwapGroup] = {}  # seq_id -> its group while swapped
        self._inflight: dict[int, list[InFlight]] = {}  # worker_id -> sent, not answered
        self._staged: dict[int, tuple[list[SwapTransfer], list[SwapTransfer]]] = {}
        self._host_free_queue: list[int] = []
        self._step_scheduled: dict[str, int] = {}
        self._next_transfer = 0
        self._swap_backoff_until = 0.0
        self._swap_counts = {"out_bytes": 0, "in_bytes": 0, "outs": 0, "ins": 0, "failures": 0}

    # ------------------------------------------------------------------ policy
    def _swap_allowed(self) -> bool:
        return (
            self._cost is not None
            and self.config.preemption_mode != "recompute"
            and time.monotonic() >= self._swap_backoff_until
        )

    def _transfer_id(self, kind: str) -> str:
        self._next_transfer += 1
        return f"{kind}-{self._next_transfer}"

    def _is_swapped(self, seq: Sequence) -> bool:
        """Whether ``seq``'s KV is (or is being written) in the host store."""
        return seq.seq_id in self._groups

    def _pinned(self, seq: Sequence) -> bool:
        g = self._groups.get(seq.seq_id)
        if g is not None and g.pending:
            return True  # its swap-out is in flight: only its own worker sees the result
        return super()._pinned(seq)

    # ------------------------------------------------------------------ swap-out
    def _try_swap_out(self, ws: WorkerState, victim: Sequence) -> bool:
        """Preempt ``victim`` (with its request's other running sequences on ``ws``) by
        swapping; False, with nothing changed, when the policy declines."""
        if not (ws.alive and self._swap_allowed()):
            return False
        group = [s for s in ws.running if s.request_id == victim.request_id]
        if any(s.seq_id in self._step_scheduled for s in group):
            return False  # NOTE: their step's blocks are already handed to the worker
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
        if not unique or len(unique) + len(group) > ws.spec.num_blocks:
            # NOTE: a group resumes whole; one that may not fit even an empty pool (forked
            # choices that grew apart) is recomputed one sequence at a time instead.
            return False
        if self._cost is None or self._swap_spec is None:
            return False
        if self.config.preemption_mode == "auto":
            nbytes = len(unique) * self._swap_spec.block_bytes
            tokens = sum(tokens_of.values())
            if self._cost.swap_s(nbytes) >= self._cost.recompute_s(tokens):
                return False
        host = self._host_pool.allocate(len(unique))
        if host is None:
            return False  # host pool full: recompute
        to_host = dict(zip(unique, host))
        tid = self._transfer_id("out")
        g = SwapGroup(
            transfer_id=tid,
            request_id=victim.request_id,
            host_tables={sid: [to_host[b] for b in t] for sid, t in tables.items()},
            num_tokens={s.seq_id: s.num_computed_tokens if tables[s.seq_id] else 0 for s in group},
            worker_id=ws.spec.worker_id,
            late={sid: v for sid, v in late.items() if tables[sid]},
        )
        outs, _ = self._staged.setdefault(ws.spec.worker_id, ([], []))
        outs.append(SwapTransfer(tid, unique, host, [s.seq_id for s in group]))
        self._inflight.setdefault(ws.spec.worker_id, []).append(
            InFlight("out", tid, g, host, ws.next_step_id)
        )
        for s in reversed(group):  # front-inserted: the group keeps its order
            self._release(ws, s)
            s.status = SequenceStatus.WAITING
            s.worker_id = None
            s.num_preemptions += 1  # NOTE: num_computed_tokens is kept: the KV is saved
            self.num_preemptions += 1
            self.metrics.on_preempted("swap")
            self._enqueue(ws, s, front=True)
            self._groups[s.seq_id] = g
        self._wake_others = True
        return True

    # ------------------------------------------------------------------ swap-in
    def _admit_swapped(
        self,
        ws: WorkerState,
        seq: Sequence,
        budget: int,
        seats: int,
        num_scheduled: dict[str, int],
    ) -> tuple[int, int] | None:
        """Admit ``seq``'s whole swapped group on ``ws`` with a swap-in; returns the
        budget and seats left, or None (nothing changed) when it does not fit now."""
        g = self._groups[seq.seq_id]
        if g.pending:
            return None
        members = [self.sequences[sid] for sid in g.host_tables]
        width = len(members) + sum(len(m.fork_children) for m in members)
        if seats + width > self.config.max_num_seqs and seats > 0:
            return None
        plan: list[tuple[Sequence, int]] = []
        left = budget
        for m in members:
            need = m.num_tokens - m.num_computed_tokens
            n = min(need, left)
            if need > 0 and (n <= 0 or (n < need and not self.config.enable_chunked_prefill)):
                return None
            plan.append((m, n))
            left -= n
        bs = ws.spec.block_size
        restored: list[tuple[str, list[int], int]] = []
        forks: list[tuple[Sequence, str | None, int]] = []
        need_blocks = 0
        for m, n in plan:
            table, tokens = g.host_tables[m.seq_id], g.num_tokens[m.seq_id]
            parent, shared = None, 0
            for sid, other, other_tokens in restored:
                k, limit = 0, min(len(table), len(other), min(tokens, other_tokens) // bs)
                while k < limit and table[k] == other[k]:
                    k += 1
                if k > shared:
                    parent, shared = sid, k
            need_blocks += _cdiv(max(tokens, m.num_computed_tokens + n), bs) - shared
            forks.append((m, parent, shared))
            restored.append((m.seq_id, table, tokens))
        if need_blocks > ws.spec.num_blocks:
            self._dissolve(g)  # can never fit here (a smaller pool than it left): recompute
            return None
        if need_blocks > ws.kv.num_free_blocks:
            return None
        dev: list[int] = []
        host: list[int] = []
        kv = ws.kv
        for m, parent, shared in forks:
            table, tokens = g.host_tables[m.seq_id], g.num_tokens[m.seq_id]
            if parent is not None:
                kv.fork(parent, m.seq_id, shared * bs)
            if tokens > shared * bs and kv.allocate_slots(m.seq_id, tokens) is None:
                raise IntegrityError(f"swap-in of {m.seq_id!r}: counted blocks are missing")
            if tokens:
                ids = kv.get_block_ids(m.seq_id)
                dev.extend(ids[shared:])
                host.extend(table[shared : len(ids)])  # a late step that never answered
        for m, n in plan:
            if n > 0:
                res = kv.allocate_slots(m.seq_id, m.num_computed_tokens + n)
                if res is None or res.blocks_to_copy:
                    raise IntegrityError(f"swap-in of {m.seq_id!r}: step allocation failed")
            self._queue_of(m).waiting.remove(m)
            m.queued_on = None
            m.status = SequenceStatus.RUNNING
            m.worker_id = ws.spec.worker_id
            ws.running.append(m)
            del self._groups[m.seq_id]
            self.metrics.on_scheduled(m)
            if n > 0:
                num_scheduled[m.seq_id] = n
        tid = self._transfer_id("in")
        all_host = sorted(g.host_ids())
        seq_ids = [m.seq_id for m in members]
        _, ins = self._staged.setdefault(ws.spec.worker_id, ([], []))
        ins.append(SwapTransfer(tid, dev, host, seq_ids, all_host))
        self._inflight.setdefault(ws.spec.worker_id, []).append(
            InFlight("in", tid, g, all_host, ws.next_step_id, seq_ids)
        )
        return left, seats + width

    # ------------------------------------------------------------------ results
    def _late_answer(
        self, ws: WorkerState, seq: Sequence, step_id: int, num_new: int, runner_out: RunnerOutput
    ) -> SequenceOutput | None:
        """Apply step ``step_id``'s answer for ``seq``, swapped out by the step after it
        (``SwapGroup.late``); returns its delta, or None (nothing applies, or nothing
        was sampled). Call from update for a sequence that is no longer running."""
        g = self._groups.get(seq.seq_id)
        if g is None or not g.pending or g.late.pop(seq.seq_id, None) != (step_id, num_new):
            return None
        if seq.max_computed_tokens > seq.num_computed_tokens:  # recomputing
            self._count_computed(ws, seq, num_new)
        else:
            seq.num_computed_tokens = seq.max_computed_tokens = seq.num_computed_tokens + num_new
        g.num_tokens[seq.seq_id] = seq.num_computed_tokens  # its table covers these slots
        token = runner_out.sampled_token_ids.get(seq.seq_id)
        if token is None:
            return None  # a prefill chunk
        seq.append_token(token)
        self.metrics.on_token(seq)
        lp = runner_out.logprobs.get(seq.seq_id)
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        reason = seq.check_stop()
        if reason is not None:
            self._finish(seq, reason)  # frees its host blocks with the swap-out's result
        return self._delta(seq, (token,))

    def _drain_swaps(
        self, ws: WorkerState
    ) -> tuple[list[SwapTransfer], list[SwapTransfer], list[int], str]:
        """This step's transfers for ``ws`` and the host blocks it should free."""
        outs, ins = self._staged.pop(ws.spec.worker_id, ([], []))
        free, tid = self._host_free_queue, ""
        if free:
            self._host_free_queue = []
            tid = self._transfer_id("free")
            self._inflight.setdefault(ws.spec.worker_id, []).append(
                InFlight("free", tid, None, free, ws.next_step_id)
            )
        return outs, ins, free, tid

    def can_plan_past(self, sched_out: SchedulerOutput) -> bool:
        """Whether the worker's next step may be planned while ``sched_out`` is in flight
        (overlapped scheduling): False when it swaps a group in, whose failure makes the
        worker drop the group (see the module docstring)."""
        return not sched_out.blocks_to_swap_in

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

    def _apply_swap_results(
        self, worker_id: int, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> None:
        """Resolve the transfers of the step ``runner_out`` answers and refine the cost
        model with its timings (call first in update)."""
        for f in self._take_inflight(worker_id, sched_out.step_id):
            res = runner_out.swap_results.get(f.transfer_id)
            self._resolve(worker_id, f, res or SwapResult(False, error="no result"))
        if self._cost is not None:
            spent = sum(r.seconds for r in runner_out.swap_results.values())
            self._cost.observe_step(
                sched_out.total_num_scheduled_tokens, runner_out.execute_time_s - spent
            )

    def _resolve(self, worker_id: int, f: InFlight, res: SwapResult) -> None:
        counts = self._swap_counts
        if f.kind == "free":
            self._host_pool.free(f.host_ids)
            return
        g = f.group
        if g is None:
            raise IntegrityError(f"transfer {f.transfer_id} has no group")
        if not res.ok:
            counts["failures"] += 1
            self._swap_backoff_until = time.monotonic() + _BACKOFF_S
        elif self._cost is not None:
            self._cost.observe_transfer(res.num_bytes, res.seconds)
        if f.kind == "out":
            if res.ok:
                counts["outs"] += 1
                counts["out_bytes"] += res.num_bytes
                g.pending = False
                self._host_free_queue.extend(sorted(set(f.host_ids) - g.host_ids()))
                return
            for sid in list(g.host_tables):
                seq = self.sequences.get(sid)
                del self._groups[sid]
                if seq is not None:
                    seq.num_computed_tokens = 0  # recompute
            self._host_free_queue.extend(f.host_ids)  # every id of the transfer
            self._wake_others = True
            return
        # swap-in: the worker freed the host blocks (or the store is gone)
        self._host_pool.free(f.host_ids)
        if res.ok:
            counts["ins"] += 1
            counts["in_bytes"] += res.num_bytes
            return
        ws = self.workers[worker_id]
        for sid in f.seq_ids:
            seq = self.sequences.get(sid)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.worker_id != worker_id:
                continue
            self._release(ws, seq)
            seq.status = SequenceStatus.WAITING
            seq.worker_id = None
            seq.num_computed_tokens = 0
            self._enqueue(ws, seq, front=True)
        self._wake_others = True

    def _dissolve(self, g: SwapGroup) -> None:
        """Give up a stored group: its members wait for recompute, its host blocks go."""
        for sid in list(g.host_tables):
            seq = self.sequences.get(sid)
            del self._groups[sid]
            if seq is not None:
                seq.num_computed_tokens = 0
        self._host_free_queue.extend(sorted(g.host_ids()))
        g.host_tables.clear()
        g.num_tokens.clear()

    def _swap_step_failed(self, worker_id: int, step_id: int | None = None) -> None:
        """The worker's step ``step_id`` raised (None: the worker died): the transfers of
        that step and earlier ones (None: all) count as failed."""
        for f in self._take_inflight(worker_id, step_id):
            self._resolve(worker_id, f, SwapResult(False, error="step failed"))

    def _forget_swapped(self, seq: Sequence) -> None:
        """``seq`` ends while swapped: drop it from its group, free what nobody holds."""
        g = self._groups.pop(seq.seq_id, None)
        if g is None:
            return
        before = g.host_ids()
        g.host_tables.pop(seq.seq_id, None)
        g.num_tokens.pop(seq.seq_id, None)
        if not g.pending:  # else the swap-out's result frees them
            self._host_free_queue.extend(sorted(before - g.host_ids()))

    # ------------------------------------------------------------------ introspection
    def swap_stats(self) -> SwapStats:
        """Swap counters and host pool occupancy (see :class:`SwapStats`)."""
        c = self._swap_counts
        cost = self._cost
        return SwapStats(
            preemption_mode=self.config.preemption_mode if cost else "recompute",
            num_requests_swapped=len(self._groups),
            host_blocks_total=self._host_pool.num_blocks,
            host_blocks_free=self._host_pool.num_free_blocks,
            swap_out_bytes=c["out_bytes"],
            swap_in_bytes=c["in_bytes"],
            num_swap_outs=c["outs"],
            num_swap_ins=c["ins"],
            num_swap_failures=c["failures"],
            bandwidth_bytes_per_s=cost.bandwidth_bytes_per_s if cost else 0.0,
            prefill_s_per_token=cost.prefill_s_per_token if cost else 0.0,
            preemptions_by_mode=dict(self.metrics.num_preemptions),
        )

    def check_swap_integrity(self) -> None:
        """Every swapped sequence waits in a queue; host blocks held by groups, in flight
        or queued for freeing are exactly the ones not free in the host pool.

        Raises:
            IntegrityError: on the first violation.
        """
        held: set[int] = set()
        for sid, g in self._groups.items():
            seq = self.sequences.get(sid)
            if seq is None or seq.status is not SequenceStatus.WAITING:
                raise IntegrityError(f"swapped sequence {sid!r} is not waiting")
            held |= g.host_ids()
        for flights in self._inflight.values():
            for f in flights:
                held |= set(f.host_ids)
        held |= set(self._host_free_queue)
        if len(held) + self._host_pool.num_free_blocks != self._host_pool.num_blocks:
            raise IntegrityError(
                f"host pool: {len(held)} blocks held + {self._host_pool.num_free_blocks} free "
                f"!= {self._host_pool.num_blocks}"
            )
