"""Prefill/decode disaggregation: which worker prefills a prompt and where it then decodes.

Conditional disaggregation (DistServe, Splitwise; vLLM's and SGLang's KV connectors): the
workers named in :attr:`DisaggConfig.prefill_worker_ids` prefill the prompts of at least
:attr:`DisaggConfig.min_prompt_tokens` tokens; every other prompt is routed among the
decode workers as usual. A long prompt's prefill therefore never shares a step with the
decodes of short requests, whose inter-token latency it would stretch.

The handoff reuses swap preemption (:mod:`pagedserve.scheduler.swapping`), so the KV moves
over the one transport the cluster has (authenticated gRPC to the host block store of the
prefill worker's node, checksummed and checked for layout there):

1. The request's first sequence is queued on a prefill worker (:meth:`DisaggManager.routes`).
2. Its prefill completes on that worker, which samples its first token (and forks its
   other choices, n > 1). At that worker's next step the scheduler swaps the request's
   sequences out as one group (:meth:`SwapManager.plan_swap_out` with ``handoff``: no
   cost test, and the group may be pulled from another node's store without a measured
   bandwidth), frees their device blocks there and queues the group on a decode worker.
3. The decode worker admits the group with a swap-in: from the shared store of its node,
   or by a remote pull from the prefill worker's store (``SwapTransfer.source_address``).
   It resumes from the computed tokens (nothing is recomputed) and decodes.

Between 2 and 3 the group *waits for remote KV* (:class:`RemoteKVWait`, one per sequence),
a state of its own with a deadline (``kv_wait_timeout_s``): past it the stored KV is given
up (host blocks freed) and the sequences are recomputed on the decode worker, so a stalled
handoff never holds host memory for long and never loses a request. An abort in that state
frees the host blocks (and, the device blocks being freed at step 2, nothing stays on
either worker); a death of the prefill worker before its swap-out answered fails that
transfer (the group is recomputed on the decode worker); a death of the decode worker
routes the group to another live worker, which swaps it in.

A prefill worker that cannot hand off (no store, its store full, a failed transfer within
the last second) keeps decoding the request itself; so does a long prompt routed to a
decode worker because no prefill worker is alive. Beam search requests are never
disaggregated (their beams fork and drop every step).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pagedserve.scheduler.errors import IntegrityError
from pagedserve.scheduler.request import Sequence, SequenceStatus
from pagedserve.scheduler.worker_state import WorkerState

# NOTE: measured (benchmarks/serving/disagg_mixed.py --sweep, benchmarks/RESULTS.md): with
# chat turns of up to 384 tokens among 768-token documents, moving only the documents gave
# the chat requests' best ITL and TTFT p99; lower thresholds sent chat turns to the one
# prefill worker, which then queued them, and each move adds a gap before the 2nd token.
DEFAULT_MIN_PROMPT_TOKENS = 512
DEFAULT_KV_WAIT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DisaggConfig:
    """Which workers prefill long prompts, and what a long prompt is.

    Attributes:
        prefill_worker_ids: the prefill workers (at least one, not every worker).
        min_prompt_tokens: prompts of at least this many tokens are prefilled on a
            prefill worker; shorter ones are routed among the decode workers.
        kv_wait_timeout_s: how long (seconds) a handed-off group may wait for its swap-in
            on a decode worker before its KV is given up and it is recomputed there.

    Raises:
        ValueError: no prefill worker, a negative id, ``min_prompt_tokens < 1`` or a
            timeout that is not > 0.
    """

    prefill_worker_ids: frozenset[int]
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    kv_wait_timeout_s: float = DEFAULT_KV_WAIT_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_worker_ids", frozenset(self.prefill_worker_ids))
        if not self.prefill_worker_ids:
            raise ValueError("DisaggConfig.prefill_worker_ids must name at least one worker")
        if min(self.prefill_worker_ids) < 0:
            raise ValueError(
                f"DisaggConfig.prefill_worker_ids must be >= 0, got {sorted(self.prefill_worker_ids)}"
            )
        if self.min_prompt_tokens < 1:
            raise ValueError(
                f"DisaggConfig.min_prompt_tokens must be >= 1, got {self.min_prompt_tokens}"
            )
        if not self.kv_wait_timeout_s > 0:
            raise ValueError(
                f"DisaggConfig.kv_wait_timeout_s must be > 0, got {self.kv_wait_timeout_s}"
            )


@dataclass(frozen=True, slots=True)
class RemoteKVWait:
    """A handed-off sequence waiting for its KV on a decode worker.

    ``source``: the prefill worker whose store holds the KV; ``target``: the decode worker
    whose queue it joined; ``deadline``: ``time.monotonic()`` past which it is recomputed.
    """

    source: int
    target: int
    deadline: float


@dataclass(frozen=True, slots=True)
class DisaggStats:
    """Disaggregation counters since start.

    Attributes:
        num_handoffs: requests whose prefill finished on a prefill worker and whose
            sequences were swapped out for a decode worker.
        handoff_blocks: device blocks those swap-outs moved (each moves once more on the
            swap-in); ``handoff_bytes``: their bytes.
        num_resumed: handoffs resumed on a decode worker by a swap-in.
        num_fallbacks: requests a prefill worker kept decoding (the swap-out declined).
        num_timeouts: handed-off groups recomputed because their wait passed the deadline.
        num_waiting: sequences waiting for remote KV now.
    """

    num_handoffs: int = 0
    handoff_blocks: int = 0
    handoff_bytes: int = 0
    num_resumed: int = 0
    num_fallbacks: int = 0
    num_timeouts: int = 0
    num_waiting: int = 0


class DisaggManager:
    """Disaggregation state and routing decisions (see the module docstring).

    Args:
        config: the prefill workers and the threshold.
        worker_ids: every worker's id.

    Raises:
        ValueError: a prefill worker id is not a worker, or every worker is a prefill
            worker (nobody would decode).
    """

    def __init__(self, config: DisaggConfig, worker_ids: Iterable[int]) -> None:
        ids = set(worker_ids)
        unknown = config.prefill_worker_ids - ids
        if unknown:
            raise ValueError(f"prefill workers {sorted(unknown)} are not workers {sorted(ids)}")
        if config.prefill_worker_ids >= ids:
            raise ValueError("every worker is a prefill worker: at least one must decode")
        self.config = config
        self._marked: set[str] = set()  # request ids to hand off once their prefill is done
        self.waits: dict[str, RemoteKVWait] = {}  # seq_id -> its wait for remote KV
        self._counts = dict.fromkeys(
            ("handoffs", "blocks", "bytes", "resumed", "fallbacks", "timeouts"), 0
        )

    # ------------------------------------------------------------------ routing
    def is_prefill_worker(self, worker_id: int) -> bool:
        return worker_id in self.config.prefill_worker_ids

    def on_add(self, seq: Sequence) -> None:
        """A new request's first sequence: mark it for a prefill worker when its prompt is
        long (and it is not a beam search)."""
        if (
            len(seq.prompt_token_ids) >= self.config.min_prompt_tokens
            and not seq.sampling.use_beam_search
        ):
            self._marked.add(seq.request_id)

    def is_marked(self, request_id: str) -> bool:
        """Whether ``request_id`` is to be prefilled on a prefill worker and handed off."""
        return request_id in self._marked

    def routes(
        self, seq: Sequence, workers: Mapping[int, WorkerState]
    ) -> Mapping[int, WorkerState]:
        """The workers the router may put ``seq`` on: the live prefill workers for a
        marked request (unmarked when there is none: it then prefills and decodes on a
        decode worker), else the live decode workers; every worker when none of that
        kind is alive."""
        prefill = self.config.prefill_worker_ids
        if seq.request_id in self._marked:
            live = {w: ws for w, ws in workers.items() if w in prefill and ws.alive}
            if live:
                return live
            self._marked.discard(seq.request_id)
        return self.decode_workers(workers) or workers

    def decode_workers(self, workers: Mapping[int, WorkerState]) -> dict[int, WorkerState]:
        """The live decode workers (empty: none is alive)."""
        prefill = self.config.prefill_worker_ids
        return {w: ws for w, ws in workers.items() if w not in prefill and ws.alive}

    def may_steal(self, seq: Sequence, thief: WorkerState) -> bool:
        """A prefill worker steals only marked requests; a decode worker never does."""
        return self.is_prefill_worker(thief.spec.worker_id) == (seq.request_id in self._marked)

    def ready(self, ws: WorkerState) -> list[Sequence]:
        """One sequence per marked request running on ``ws`` (a prefill worker) whose
        prefill is done: its prompt is computed (again, after a recompute preemption), it
        sampled a token, and no choice is left to fork."""
        found: dict[str, Sequence] = {}
        blocked: set[str] = set()
        for s in ws.running:
            rid = s.request_id
            if rid not in self._marked:
                continue
            if s.fork_children:
                blocked.add(rid)
            elif (
                s.output_token_ids
                and s.num_computed_tokens >= s.num_prompt_tokens
                and rid not in found
            ):
                found[rid] = s
        return [s for rid, s in found.items() if rid not in blocked]

    # ------------------------------------------------------------------ handoff
    def handed_off(
        self, group: list[Sequence], source: int, target: int, num_blocks: int, block_bytes: int
    ) -> None:
        """``group``'s swap-out for ``target`` is planned on ``source``: it now waits for
        remote KV, with a deadline."""
        self._marked.discard(group[0].request_id)
        deadline = time.monotonic() + self.config.kv_wait_timeout_s
        for s in group:
            self.waits[s.seq_id] = RemoteKVWait(source, target, deadline)
        c = self._counts
        c["handoffs"] += 1
        c["blocks"] += num_blocks
        c["bytes"] += num_blocks * block_bytes

    def fell_back(self, request_id: str) -> None:
        """The prefill worker keeps decoding ``request_id`` (its swap-out declined)."""
        self._marked.discard(request_id)
        self._counts["fallbacks"] += 1

    def resumed(self, seq_ids: Iterable[str]) -> None:
        """These sequences were swapped in: their wait is over."""
        popped = [self.waits.pop(sid, None) for sid in seq_ids]
        if any(w is not None for w in popped):
            self._counts["resumed"] += 1

    def expired(self, now: float) -> list[str]:
        """The waiting sequences whose deadline passed (they stay recorded until
        :meth:`forget`)."""
        return [sid for sid, w in self.waits.items() if w.deadline <= now]

    def timed_out(self) -> None:
        self._counts["timeouts"] += 1

    def forget(self, seq_id: str) -> None:
        """``seq_id`` ends, or its stored KV is gone (it is recomputed): its wait is over."""
        self.waits.pop(seq_id, None)

    def forget_request(self, request_id: str) -> None:
        """``request_id`` is done: no mark left."""
        self._marked.discard(request_id)

    def stats(self) -> DisaggStats:
        c = self._counts
        return DisaggStats(
            c["handoffs"],
            c["blocks"],
            c["bytes"],
            c["resumed"],
            c["fallbacks"],
            c["timeouts"],
            len(self.waits),
        )

    def check_integrity(self, sequences: Mapping[str, Sequence], swapped: set[str]) -> None:
        """Every sequence waiting for remote KV is waiting and swapped.

        Raises:
            IntegrityError: on the first violation.
        """
        for sid in self.waits:
            seq = sequences.get(sid)
            if seq is None or seq.status is not SequenceStatus.WAITING or sid not in swapped:
                raise IntegrityError(f"sequence {sid!r} waits for remote KV but is not swapped")
