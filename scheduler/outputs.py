"""The contract between the scheduler actor and the worker actors.

One :class:`SchedulerOutput` per worker per step says what to run; the worker answers with a
:class:`RunnerOutput`. Both are plain frozen dataclasses (Ray pickles them). They carry
deltas: a sequence's full token list and block table travel once (``NewSequenceData``),
after that only its block-table delta and computed-token count (``CachedSequenceData``);
the worker keeps the rest. This follows vLLM v1's ``SchedulerOutput`` design.

The unit the worker sees is a *sequence*: one choice of a client request, named by its
``seq_id`` (``f"{request_id}/{choice_index}"``) in every field below and on the worker.

Block-table deltas have one encoding: ``block_table[new_blocks_start:] = new_block_ids``.
``new_blocks_start`` equals the table's length for a plain append and is one less when
copy-on-write replaced the last block (its contents arrive through ``blocks_to_copy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleLogprobs:
    """Log probabilities at one output position of a sequence (fp32 log-softmax of the raw
    logits: before penalties, temperature and top-k/top-p, as vLLM's default).

    Attributes:
        token_id: the token generated at this position.
        logprob: its log probability (natural log, <= 0).
        top: the most likely ``(token_id, logprob)`` pairs, best first (as many as the
            request's ``logprobs``; with beam search, the ``2 * beam_width`` candidates).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class NewSequenceData:
    """A sequence the worker does not hold (first schedule, or resumed after preemption).

    Attributes:
        seq_id: scheduler-wide unique id of this sequence.
        token_ids: every token known so far: prompt, plus outputs when resumed after a
            recompute preemption.
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        block_ids: the sequence's block table (physical block ids, logical order).
        num_computed_tokens: tokens whose K/V are already in the cache (prefix-cache hits).
        sampling: sampling parameters.
        choice_index: which choice of its parent request this sequence is (seeds sampling).
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    choice_index: int = 0


@dataclass(slots=True)
class CachedSequenceData:
    """A sequence the worker already holds; only what changed since its last step.

    Built for every running sequence at every step, so not frozen (a frozen dataclass's
    ``__init__`` costs ~4x a plain one's); treat it as immutable, lists included: the
    scheduler gives every empty list of one step the same list object.

    Attributes:
        seq_id: sequence id.
        new_blocks_start: logical block index of ``new_block_ids[0]`` (see the module
            docstring; with no new blocks it is the table's length).
        new_block_ids: block ids written into the block table since the last step.
        num_computed_tokens: tokens with K/V in the cache before this step.
        new_token_ids: tokens the scheduler appended that the worker did not sample (the
            tokens beam search chose); the worker appends them before the step.
        spec_token_ids: speculative decoding: the proposed tokens to verify after the
            sequence's last known token (the step schedules ``1 + len(spec_token_ids)``
            tokens for it and reserves their slots); the worker keeps those it accepts
            and answers in ``RunnerOutput.spec_token_ids``. Empty for a plain step.
        num_draft_tokens: speculative decoding with a draft model: the worker's draft
            proposes this many tokens after the last known token (``spec_token_ids`` is
            then empty) and verifies them as it verifies ``spec_token_ids``; the step
            schedules ``1 + num_draft_tokens`` tokens. 0 otherwise.
    """

    seq_id: str
    new_blocks_start: int
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class SwapTransfer:
    """Blocks to move between the worker's KV pool and the host block store.

    Attributes:
        transfer_id: unique id of the transfer (its result is keyed by it).
        block_ids: physical blocks of this worker's pool: the gather source of a
            swap-out, the scatter destination of a swap-in.
        host_block_ids: the host block of each entry of ``block_ids`` (same length).
            Distinct for a swap-out; a swap-in may name one host block for several
            device blocks (a partial block two sequences shared is restored as one copy
            each).
        seq_ids: the sequences whose KV this is. A failed swap-in drops them from the
            step (the scheduler recomputes them).
        host_blocks_to_free: after a successful swap-in, host blocks to free on the store.
        source_address: a swap-in from another worker's store (a remote swap-in):
            ``host:port`` of that store, which the worker pulls the blocks from (with the
            cluster's store key, ``WorkerConfig.host_store_access``) and frees
            ``host_blocks_to_free`` on; None: the worker's own store.
    """

    transfer_id: str
    block_ids: list[int]
    host_block_ids: list[int]
    seq_ids: list[str] = field(default_factory=list)
    host_blocks_to_free: list[int] = field(default_factory=list)
    source_address: str | None = None


@dataclass(frozen=True)
class SwapResult:
    """How one :class:`SwapTransfer` (or a free of host blocks) went on the worker.

    Attributes:
        ok: the blocks moved and their checksums matched.
        num_bytes: payload bytes moved.
        seconds: wall time of the transfer (pack/unpack included).
        error: why it failed (empty when ``ok``).
    """

    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class SwapPlan:
    """One step's host-store transfers, in the order the worker runs them.

    The scheduler sends a plan only when one of its lists is non-empty.

    Attributes:
        blocks_to_swap_out: transfers to the host store, run first (before any swap-in,
            copy or model write: their blocks may be reused in this very step).
        blocks_to_swap_in: transfers from the host store into freshly allocated blocks,
            run after the swap-outs and before ``blocks_to_copy`` and the model.
        host_blocks_to_free: host blocks to drop from the store (best effort; result
            under the transfer id ``free_transfer_id``).
        free_transfer_id: names the free of ``host_blocks_to_free`` in the results.
    """

    blocks_to_swap_out: list[SwapTransfer] = field(default_factory=list)
    blocks_to_swap_in: list[SwapTransfer] = field(default_factory=list)
    host_blocks_to_free: list[int] = field(default_factory=list)
    free_transfer_id: str = ""


@dataclass(frozen=True)
class SchedulerOutput:
    """What one worker runs in one step.

    Attributes:
        step_id: monotonically increasing step counter (per worker).
        new_seqs: sequences sent in full.
        cached_seqs: sequences the worker holds, with their deltas.
        num_scheduled_tokens: seq_id -> tokens to compute this step (prefill chunk size, or
            1 for decode, 1 + its proposals for a speculative decode). Every scheduled sequence appears here; the order of this dict is
            the batch order.
        finished_seq_ids: sequences to forget (finished, aborted or preempted) before
            running.
        blocks_to_copy: (src, dst) physical block pairs to copy before running
            (copy-on-write).
        swap_plan: the step's transfers to and from the host block store; None when the
            step moves nothing (vLLM's ``kv_connector_metadata``: one optional field for
            the subsystem, read only by the worker's swapper).
    """

    step_id: int
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_seq_ids: list[str] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    swap_plan: SwapPlan | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (
            self.num_scheduled_tokens or self.finished_seq_ids or self.swap_plan is not None
        )


@dataclass(frozen=True)
class RunnerOutput:
    """A worker's answer to one :class:`SchedulerOutput`.

    Attributes:
        step_id: the step answered.
        sampled_token_ids: seq_id -> token sampled this step, only for sequences whose
            prompt is fully computed after the step (a partial prefill chunk samples nothing).
        execute_time_s: wall time of the model step on the worker, seconds.
        logprobs: seq_id -> log probabilities of the token sampled this step, for the
            sequences whose request asked for ``logprobs``.
        beam_candidates: seq_id -> the ``(token_id, logprob)`` pairs (best first, fp32
            log-softmax of the raw logits) of a beam-search sequence whose tokens are all
            computed; such sequences sample nothing and appear only here.
        swap_results: transfer_id -> outcome of each transfer of the step's
            ``swap_plan`` (and of the free of its ``host_blocks_to_free``).
        started_s: when the worker started the step (its monotonic clock, seconds; 0.0
            when unknown): with ``execute_time_s``, the idle gap between two steps.
        failed_seq_ids: seq_id -> why its structured-output grammar failed on the worker
            (a spec that does not compile there, a token the grammar rejects); the
            scheduler aborts these sequences. Such a sequence samples nothing this step.
        grammar_fill_s: seconds the worker spent filling this step's grammar bitmask (on
            a thread, while the forward ran); 0.0 when no row was constrained.
        spec_token_ids: seq_id -> the tokens a speculative step (one with
            ``CachedSequenceData.spec_token_ids``) produced: the accepted proposals, then
            the token sampled after them (1 to ``1 + len(proposals)`` tokens; such
            sequences appear here, not in ``sampled_token_ids``). The sequence's KV is
            computed for its last known token and the accepted proposals only.
        spec_logprobs: seq_id -> log probabilities of each token of ``spec_token_ids``,
            for the sequences whose request asked for ``logprobs``.
    """

    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    execute_time_s: float = 0.0
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    beam_candidates: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    swap_results: dict[str, SwapResult] = field(default_factory=dict)
    started_s: float = 0.0
    failed_seq_ids: dict[str, str] = field(default_factory=dict)
    grammar_fill_s: float = 0.0
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
