"""Per-sequence worker state and the flattening of one step into model inputs.

The worker keeps, for every sequence the scheduler has sent it, the full token list, the
block table and the number of tokens whose K/V are cached (vLLM v1 keeps the same
"persistent batch" state on its workers so the scheduler only sends deltas).
:func:`prepare_inputs` turns the scheduled chunks ``[num_computed, num_computed + n)`` of
a list of sequences into the flat tensors the model and the paged kernels take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.attention import AttentionMetadata
from pagedserve.worker.sampler import SamplingRow
from pagedserve.worker.structured import SequenceGrammar


class BlockTableRow:
    """One sequence's block table on the worker: a growable int32 numpy buffer.

    Appends are amortised O(1) (capacity doubling) and a step copies each row into the
    batch's ``block_tables`` with one slice assignment, instead of converting Python lists
    every step (the host cost then grows with blocks copied, not with Python objects; the
    idea of vLLM v1's persistent ``BlockTable``).

    Args:
        block_ids: the initial table (physical block ids in logical order).
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, block_ids: Sequence[int] = ()) -> None:
        self._len = len(block_ids)
        self._buf = np.zeros(max(16, 2 * self._len), dtype=np.int32)
        self._buf[: self._len] = block_ids

    def __len__(self) -> int:
        return self._len

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTableRow):
            other = other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None  # type: ignore[assignment]

    def assign(self, start: int, block_ids: Sequence[int]) -> None:
        """``table[start:] = block_ids`` (start <= len; CoW replaces the last entry).

        Raises:
            ValueError: ``start`` is past the end of the table.
        """
        if not (0 <= start <= self._len):
            raise ValueError(f"start {start} is outside the block table (len {self._len})")
        end = start + len(block_ids)
        if end > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), end), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[start:end] = block_ids
        self._len = end

    def extend(self, block_ids: Sequence[int]) -> None:
        """Append block ids."""
        self.assign(self._len, block_ids)

    def view(self, n: int | None = None) -> np.ndarray[Any, Any]:
        """The first ``n`` (default all) entries, without copying."""
        return self._buf[: self._len if n is None else min(n, self._len)]

    def tolist(self) -> list[int]:
        return [int(b) for b in self._buf[: self._len]]


@dataclass
class SequenceState:
    """What a worker remembers about one sequence between steps (mutable).

    Attributes:
        seq_id: sequence id.
        token_ids: prompt + outputs known to the worker (it appends what it samples).
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        block_ids: block table (physical block ids in logical order).
        num_computed_tokens: tokens whose K/V are in the cache.
        sampling: the request's sampling parameters.
        choice_index: choice of the parent request (part of the sampling seed).
        seed: sampling seed (the user's, or drawn once by the worker).
        grammar: the structured-output matcher (None when unconstrained;
            :mod:`pagedserve.worker.structured`).
        num_spec_tokens: during a speculative step, the proposals at the end of
            ``token_ids`` (verified this step, then replaced by the accepted tokens); 0
            otherwise.
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: BlockTableRow
    num_computed_tokens: int
    sampling: SamplingParams
    choice_index: int
    seed: int
    grammar: SequenceGrammar | None = None
    num_spec_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_ids, BlockTableRow):
            self.block_ids = BlockTableRow(self.block_ids)

    def sampling_row(self) -> SamplingRow:
        """The sampler spec for this sequence's next output token."""
        return SamplingRow(
            temperature=self.sampling.temperature,
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
            seed=self.seed,
            choice_index=self.choice_index,
            output_index=len(self.token_ids) - self.num_prompt_tokens,
        )


@dataclass(frozen=True)
class ModelInputs:
    """The tensors of one step.

    Attributes:
        input_ids: int64 ``[T]`` tokens of all chunks, in batch order.
        positions: int64 ``[T]`` their positions in their sequences.
        attn_metadata: slots, block tables and lengths for the paged kernels.
        logits_indices: int64 ``[num_samples]`` rows (last token of a chunk) whose logits
            are sampled: the chunks that complete their sequence's known tokens; a
            speculative chunk adds the rows of its ``num_spec_tokens`` proposals before.
        sample_seq_ids: the sequences those rows belong to, same order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seq_ids: tuple[str, ...]


def prepare_inputs(
    scheduled: Sequence[tuple[SequenceState, int]],
    block_size: int,
    num_blocks: int,
    device: torch.device,
) -> ModelInputs:
    """Flatten scheduled chunks into model inputs.

    Args:
        scheduled: ``(state, n)`` pairs in batch order; the chunk of each sequence is
            tokens ``[state.num_computed_tokens, state.num_computed_tokens + n)``.
        block_size: tokens per KV block.
        num_blocks: pool size, to reject out-of-range block ids.
        device: where the tensors go.

    Returns:
        :class:`ModelInputs`; slot of token at position p of a sequence is
        ``block_ids[p // block_size] * block_size + p % block_size``.

    Raises:
        ValueError: a chunk of length < 1, a chunk past the known tokens, a block table
            too short for the chunk, or a block id outside ``[0, num_blocks)``.
    """
    query_lens, seq_lens, starts, token_ids, tables = [], [], [], [], []
    logits_rows: list[int] = []
    sample_ids: list[str] = []
    total = 0
    for state, n in scheduled:
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        if n < 1:
            raise ValueError(f"sequence {state.seq_id}: scheduled {n} tokens (must be >= 1)")
        if end > len(state.token_ids):
            raise ValueError(
                f"sequence {state.seq_id}: chunk [{start}, {end}) is past its "
                f"{len(state.token_ids)} known tokens"
            )
        blocks = -(-end // block_size)
        if len(state.block_ids) < blocks:
            raise ValueError(
                f"sequence {state.seq_id}: {end} tokens need {blocks} blocks, block table "
                f"has {len(state.block_ids)}"
            )
        query_lens.append(n)
        seq_lens.append(end)
        starts.append(start)
        token_ids.extend(state.token_ids[start:end])
        tables.append(state.block_ids.view(blocks))
        total += n
        if end == len(state.token_ids):
            # a speculative chunk samples its last token and every proposal's row
            logits_rows.extend(range(total - 1 - state.num_spec_tokens, total))
            sample_ids.append(state.seq_id)

    width = max((len(t) for t in tables), default=0)
    table_np = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for row, table in enumerate(tables):
        table_np[row, : len(table)] = table
    if table_np.size and (int(table_np.min()) < 0 or int(table_np.max()) >= num_blocks):
        raise ValueError(
            f"block ids must be in [0, {num_blocks}); got {[t.tolist() for t in tables]}"
        )
    block_tables = torch.from_numpy(table_np)

    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    cu_seqlens_q = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu_seqlens_q[1:])
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    # position = start of the sequence's chunk + offset of the token inside the chunk
    offset_in_chunk = torch.arange(total) - cu_seqlens_q[:-1].repeat_interleave(q_lens)
    positions = torch.tensor(starts, dtype=torch.int64).repeat_interleave(q_lens)
    positions += offset_in_chunk
    token_blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    slot_mapping = token_blocks * block_size + positions % block_size

    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32).to(device),
        max_query_len=max(query_lens, default=0),
    )
    return ModelInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64).to(device),
        positions=positions.to(device),
        attn_metadata=meta,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(device),
        sample_seq_ids=tuple(sample_ids),
    )
