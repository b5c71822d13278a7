"""Attention metadata of one step and the paged-attention call every layer makes.

The model runner builds one :class:`AttentionMetadata` per step and passes it explicitly
down the model (no module-level or global state). Each layer then:

1. writes the step's new K/V rows into its KV cache at ``slot_mapping``
   (``pagedserve.kernels.store_kv_cache``);
2. attends through the block tables: ``paged_decode_attention`` when every sequence has a
   single query token, otherwise ``paged_prefill_attention`` (ragged chunks, causal, mixed
   prefill + decode batches allowed).

This is the split introduced by vLLM (Kwon et al., SOSP 2023, sec. 4): the model sees a
flat batch of tokens, and sequence structure lives only in the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve import kernels


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the step's tokens live in the paged cache and how they group into sequences.

    Attributes:
        slot_mapping: int64 ``[num_tokens]``; cache slot (``block_id * block_size +
            offset``) of each token's K/V; ``-1`` skips the token.
        block_tables: int32 ``[num_seqs, max_blocks]``; physical blocks of each sequence in
            logical order, truncated to the blocks the step reads (rows padded with 0).
        seq_lens: int32 ``[num_seqs]``; tokens in the cache for each sequence after the
            step's K/V are stored (context + chunk).
        cu_seqlens_q: int32 ``[num_seqs + 1]``; prefix sums of the per-sequence query
            (chunk) lengths; the tokens of sequence ``s`` are rows
            ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of the flat batch.
        max_query_len: longest chunk of the step (1 for a decode-only step).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int

    def __post_init__(self) -> None:
        num_seqs = self.seq_lens.shape[0]
        if self.cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(
                f"cu_seqlens_q has {self.cu_seqlens_q.shape[0]} entries for {num_seqs} seqs"
            )
        if self.block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"block_tables has {self.block_tables.shape[0]} rows for {num_seqs} seqs"
            )
        if self.max_query_len < 0:
            raise ValueError(f"max_query_len must be >= 0, got {self.max_query_len}")

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the flat batch."""
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence contributes exactly one query token."""
        return self.max_query_len == 1 and self.num_tokens == self.num_seqs


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "auto",
    checked: kernels.CheckedIndices | None = None,
) -> torch.Tensor:
    """Store the step's K/V into one layer's cache, then attend through the block tables.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` (RoPE applied).
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` (RoPE applied to key), in
            ``query``'s dtype; cast to the caches' dtype when that differs.
        key_cache, value_cache: this layer's ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` caches, modified in place.
        meta: the step's metadata.
        scale: softmax scale, ``head_dim ** -0.5`` for Llama.
        backend: kernel backend passed to :mod:`pagedserve.kernels`.
        checked: ``meta``'s indices as validated by :func:`pagedserve.kernels.check_indices`
            (the kernels then skip checking them again), or ``None``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output in ``query.dtype``.

    Raises:
        ValueError: from the kernels on shape, dtype or device mismatches or indices
            outside the caches.
    """
    # An fp8 or int8 cache takes the model's activations as they are (quantised on store).
    if query.dtype != key_cache.dtype and key_cache.dtype not in (torch.float8_e4m3fn, torch.int8):
        # NOTE: a KV cache in a dtype other than the model's (``kv_cache_dtype``): attend in
        # the cache's dtype (the kernels accumulate in fp32 either way), answer in the model's.
        kv_dtype = key_cache.dtype
        out = paged_attention(
            query.to(kv_dtype), key.to(kv_dtype), value.to(kv_dtype), key_cache, value_cache,
            meta, scale, backend, checked,
        )  # fmt: skip
        return out.to(query.dtype)
    kernels.store_kv_cache(
        key, value, key_cache, value_cache, meta.slot_mapping, backend, checked=checked
    )
    if meta.is_decode_only:
        return kernels.paged_decode_attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, backend,
            checked=checked,
        )  # fmt: skip
    return kernels.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seq_lens,
        scale,
        backend,
        max_query_len=meta.max_query_len,  # no device->host sync per layer
        checked=checked,
    )
