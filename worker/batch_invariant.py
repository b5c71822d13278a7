"""Batch-invariant mode: a sequence's logits are bitwise the same whatever it is batched with.

Why logits move with the batch: a dense matmul's library kernel (MKL / oneDNN on CPU) is
chosen and blocked by the number of rows M, and different kernels sum the K products in
different orders, so the same row of activations gives results that differ in the last
bits depending on how many other tokens share the step (measured on SmolLM2: 3-6e-5 on the
logits). Seeded sampling draws the same uniform for the same (seed, choice, position)
(:mod:`pagedserve.worker.sampler`), but a near-tie between two tokens can still flip.

The fix (the idea of vLLM's batch-invariant mode: batch-size-independent reductions): every
matmul of the model runs on fixed-shape row tiles. :func:`invariant_linear` copies the
rows into a zero-padded ``[ROWS, K]`` buffer and calls the library GEMM on that one shape,
so each output row is computed by the same kernel with the same blocking and reduction
order whatever M is (measured: ``F.linear`` gives a row different bits for 63 of the
M = 1..64; the tiles for none). RMSNorm, rotary and SiLU are per row already, and the
sampler works row by row. The paged attention kernel gives a decode row the same bits
whatever else is in the batch (one task per sequence and KV head), but a row of a prefill
tile (16 query rows sharing one pass over the keys) differs in the last bits from the same
token computed as a decode (measured: up to 3e-7), so a chunked prefill, a recompute after
preemption and plain decoding would disagree; :func:`per_token_metadata` presents every
query row to the kernel as its own one-token sequence, so each token is computed exactly
as a decode is. The cost: the padding of the last tile, the large-M GEMM efficiency, and
prefill attention reading the keys once per query row (see docs/architecture.md, "Seeded
sampling and batch invariance").

Only the fused fp32 CPU path is covered (the worker refuses others), and
:func:`make_batch_invariant` first checks on this machine that the GEMM library treats the
rows of one call alike (:func:`check_row_invariance`), refusing to start otherwise.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.worker.attention import AttentionMetadata

ROWS = 16  # rows per GEMM call in batch-invariant mode


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = ROWS
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on fixed ``[rows, K]`` tiles, so that output
    row i depends only on ``x[i]`` (bitwise), not on how many rows ``x`` has.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]``.
        bias: ``[N]`` or None.
        rows: tile height (the one M the GEMM library ever sees).

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    total = flat.shape[0]
    out = flat.new_empty(total, weight.shape[0])
    # A fresh buffer per call: the same shape and (allocator) alignment every time.
    tile = flat.new_zeros(rows, flat.shape[1])
    for start in range(0, total, rows):
        n = min(rows, total - start)
        tile[:n].copy_(flat[start : start + n])
        if n < rows:
            tile[n:].zero_()
        out[start : start + n].copy_(F.linear(tile, weight, bias)[:n])
    return out.view(*lead, weight.shape[0])


def per_token_metadata(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """The same attention as ``meta`` with every query row as a one-token sequence.

    Token ``t`` of sequence ``s`` at position ``p`` attends keys ``0..p`` of ``s``'s
    block table, exactly as ``meta`` says, but through the kernel's decode shape (a tile
    of one row), so its output does not depend on how the step chunked its sequence.

    Args:
        meta: the step's metadata (int32 ``block_tables``, ``seq_lens``, ``cu_seqlens_q``).
        positions: int64 ``[num_tokens]``, each token's position in its sequence.

    Returns:
        metadata with ``num_tokens`` sequences: ``block_tables`` ``[num_tokens,
        max_blocks]`` (each token's sequence's row), ``seq_lens = positions + 1``,
        ``cu_seqlens_q = 0..num_tokens``, ``max_query_len`` 1; ``slot_mapping`` unchanged.
    """
    q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).to(torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    num_tokens = positions.numel()
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables.index_select(0, seq_of_token).contiguous(),
        seq_lens=(positions + 1).to(torch.int32).contiguous(),
        cu_seqlens_q=torch.arange(num_tokens + 1, dtype=torch.int32),
        max_query_len=1 if num_tokens else 0,
    )


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`invariant_linear` (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def check_row_invariance(weight: torch.Tensor, rows: int = ROWS, seed: int = 0) -> None:
    """Verify on this machine's GEMM library that a row's result does not depend on its
    position in the tile or on the other rows (the property :func:`invariant_linear` relies
    on: the library must treat the rows of one fixed-shape call alike).

    Raises:
        RuntimeError: a row's result changed bitwise with its neighbours or position.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = weight.shape[1]
    x = torch.randn(2 * rows, k, generator=gen).to(weight.device, weight.dtype)
    ref = invariant_linear(x[:1], weight)[0]
    for pos in range(rows):
        tile = x[rows : 2 * rows].clone()
        tile[pos] = x[0]
        if not torch.equal(invariant_linear(tile, weight)[pos], ref):
            raise RuntimeError(
                f"the GEMM library gives a row a different result at position {pos} of a "
                f"[{rows}, {k}] x [{k}, {weight.shape[0]}] call: batch invariance cannot be "
                "guaranteed on this machine"
            )


def make_batch_invariant(model: nn.Module, lm_head_weight: torch.Tensor | None = None) -> int:
    """Switch every ``nn.Linear`` of ``model`` to :class:`InvariantLinear` in place (the
    parameters stay) and set ``model.batch_invariant`` (the LM head reads it), after
    checking each distinct weight shape with :func:`check_row_invariance`.

    Args:
        model: the model (modified in place).
        lm_head_weight: the LM head's weight when it is not an ``nn.Linear`` (tied
            embeddings), to check its shape too.

    Returns:
        how many linear layers were switched.

    Raises:
        RuntimeError: see :func:`check_row_invariance`.
    """
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    weights = {tuple(m.weight.shape): m.weight for m in linears}
    if lm_head_weight is not None:
        weights.setdefault(tuple(lm_head_weight.shape), lm_head_weight)
    with torch.no_grad():
        for weight in weights.values():
            check_row_invariance(weight)
    for module in linears:
        module.__class__ = InvariantLinear  # same state; only forward changes
    cast(Any, model).batch_invariant = True  # read by LlamaForCausalLM._lm_head
    return len(linears)
