"""A new request's checks and sequences: what :meth:`Scheduler.add_request` validates.

Pure functions of the request and the live workers' pools; the scheduler registers and
queues the sequences they return.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Sequence_

from pagedserve.scheduler.errors import ClusterUnavailable, InvalidRequest, RequestRejected
from pagedserve.scheduler.request import Sequence, SequenceStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.worker_state import WorkerState


def check_request(
    prompt_token_ids: Sequence_[int],
    sampling: SamplingParams,
    workers: Iterable[WorkerState],
    max_model_len: int,
) -> int:
    """Validate a request against ``max_model_len`` and the live workers' pools.

    Returns:
        The most tokens (prompt + output) one of its sequences may reach.

    Raises:
        InvalidRequest: empty prompt, or prompt + max_tokens longer than ``max_model_len``.
        RequestRejected: one choice at its longest needs more slots than the largest live
            worker pool holds (it could never finish, even alone); or, with beam search,
            its ``beam_width`` beams at their longest do not fit one pool at once.
        ClusterUnavailable: no worker is alive.
    """
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty")
    prompt_len = len(prompt_token_ids)
    if prompt_len + sampling.max_tokens > max_model_len:
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
            f"max_model_len ({max_model_len})"
        )
    max_total = prompt_len + sampling.max_tokens
    live = [w for w in workers if w.alive]
    if not live:
        raise ClusterUnavailable("no worker is alive")
    # Each choice must fit alone (after the fork, preemption lets them take turns), so
    # the bound is per sequence, not n times it.
    capacity = max(w.spec.num_blocks * w.spec.block_size for w in live)
    if max_total > capacity:
        raise RequestRejected(
            f"a sequence of this request needs up to {max_total} KV slots but a worker "
            f"holds only {capacity}"
        )
    if sampling.use_beam_search:
        # NOTE: beams step together (a beam that reported waits for its siblings while
        # holding its blocks), so all K must fit at once, not just one at a time.
        bs = max(w.spec.block_size for w in live)
        need = sampling.beam_width * -(-max_total // bs)
        if need > max(w.spec.num_blocks for w in live):
            raise RequestRejected(
                f"beam search with beam_width {sampling.beam_width} needs up to {need} KV "
                "blocks at once, more than a worker's pool holds"
            )
    return max_total


def check_speculative(sampling: SamplingParams) -> None:
    """Refuse what speculative decoding does not support: beam search (its candidates
    come from one position per step) and structured outputs (the grammar would have to
    mask every verified position).

    Raises:
        InvalidRequest: naming the field.
    """
    if sampling.use_beam_search:
        raise InvalidRequest(
            "beam search (beam_width > 1) is not supported with speculative decoding"
        )
    if sampling.structured_outputs is not None:
        raise InvalidRequest("structured_outputs is not supported with speculative decoding")


def new_sequences(
    request_id: str,
    prompt_token_ids: Sequence_[int],
    sampling: SamplingParams,
    eos_token_ids: frozenset[int],
    max_total: int,
    arrival_s: float,
) -> list[Sequence]:
    """The sequences of a request: one per choice (``sampling.n``), or the first beam
    alone under beam search. Choice 0 is the one to queue; the others wait
    (``PENDING_FORK``) to fork from it once it computed its prompt."""
    count = 1 if sampling.use_beam_search else sampling.n
    seqs = [
        Sequence(
            seq_id=f"{request_id}/{i}",
            request_id=request_id,
            choice_index=i,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=eos_token_ids,
            max_total_tokens=max_total,
            arrival_s=arrival_s,
        )
        for i in range(count)
    ]
    for child in seqs[1:]:
        child.status = SequenceStatus.PENDING_FORK
    seqs[0].fork_children = seqs[1:]
    return seqs
