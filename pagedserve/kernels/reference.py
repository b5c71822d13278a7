"""Pure-torch reference implementations of the paged KV-cache kernels.

These functions are the numerical ground truth for the Triton kernels and also the
production path on CPU: they gather each sequence's blocks through its block table with
``index_select``-style indexing and compute plain softmax attention in fp32 (the same
math as eager attention in HF transformers: ``softmax(q k^T * scale) v``), so a model
served through them stays token-identical to the contiguous-cache model in fp32.

Layouts (shared with the Triton kernels, see ``pagedserve.kernels``):

* caches: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, K and V apart;
* a token's *slot* is ``block_id * block_size + offset``;
* query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query
  attention, same convention as ``repeat_kv`` in HF Llama).

Arguments are assumed to be validated by the public wrappers in ``pagedserve.kernels``,
whose docstrings give the full shapes and dtypes; these functions raise no ValueError of
their own. Outputs are returned in the query's dtype, computed in fp32. The attention is
the textbook ``softmax(q k^T * scale) v`` (Vaswani et al., 2017) with the paged-cache
indirection of vLLM's PagedAttention (Kwon et al., 2023).
"""

from __future__ import annotations

import torch

from pagedserve.kernels import fp8, int8
from pagedserve.kernels._math import cdiv

# Up to this many KV heads the decode path multiplies against a block-diagonal query
# (num_kv_heads x redundant FLOPs, but no transposes of the gathered K/V).
_BLOCK_DIAG_MAX_KV_HEADS = 4

__all__ = [
    "copy_blocks",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_blocks",
    "store_kv_cache",
]


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` rows into their cache slots in place (``-1`` = skip); into
    an fp8 cache as :func:`pagedserve.kernels.fp8.quantize` of ``key / k_scale`` and
    ``value / v_scale`` (the scales are unused for other caches); into an int8 cache as
    :func:`pagedserve.kernels.int8.quantize` (each head vector with its own scale)."""
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots = slots[keep]
        key = key[keep]
        value = value[keep]
    if slots.numel() == 0:
        return
    block_size = key_cache.shape[1]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    if fp8.is_fp8(key_cache.dtype):
        key_cache[blocks, offsets] = fp8.quantize(key, k_scale)
        value_cache[blocks, offsets] = fp8.quantize(value, v_scale)
        return
    if int8.is_int8(key_cache.dtype):
        key_cache[blocks, offsets] = int8.quantize(key)
        value_cache[blocks, offsets] = int8.quantize(value)
        return
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def _widen(t: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathered cache elements as fp32; fp8 ones dequantised (``float(q) * scale``), int8
    head vectors ``[..., D + 4]`` with their stored scales (:func:`int8.dequantize`)."""
    if int8.is_int8(t.dtype):
        return int8.dequantize(t)
    return fp8.dequantize(t, scale) if fp8.is_fp8(t.dtype) else t.float()


def _gather_tokens(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` flattened to tokens: ``[..., n_blocks * block_size, Hkv, D]``."""
    gathered = cache[block_ids]  # [..., n_blocks, block_size, Hkv, D]
    shape = gathered.shape
    return gathered.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])


def _clamp_blocks(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    # Entries past a sequence's last block are unused padding (their keys are masked);
    # clamp them so the gather never indexes out of range.
    return block_ids.to(torch.int64).clamp(0, num_blocks - 1)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per sequence attending to its first ``seq_lens[b]`` cached tokens.

    fp8 caches are dequantised (``k_scale``, ``v_scale``) after the gather; the scales are
    unused for other caches.

    Batched over sequences without a Python loop: every sequence's blocks are gathered
    (one ``index_select`` per cache) up to the longest sequence of the batch and the tail
    is masked. With few KV heads the per-head products are done as one dense batched GEMM
    against a block-diagonal query (the off-group terms are exact zeros), which avoids
    transposing the gathered K/V; with many KV heads the K/V are transposed instead.
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    device = query.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    max_len = int(lens.max())
    n_blk = max(1, cdiv(max_len, block_size))
    ids = _clamp_blocks(block_tables[:, :n_blk].to(device), num_blocks).reshape(-1)
    length = n_blk * block_size
    stored = key_cache.shape[3]  # head_dim, or head_dim + 4 scale bytes for int8
    per_slot = (num_seqs, length, num_kv_heads, stored)
    row = block_size * num_kv_heads * stored
    # [B, L, Hkv * D]
    k = _widen(key_cache.view(num_blocks, row).index_select(0, ids).view(per_slot), k_scale)
    v = _widen(value_cache.view(num_blocks, row).index_select(0, ids).view(per_slot), v_scale)
    k = k.reshape(num_seqs, length, -1)
    v = v.reshape(num_seqs, length, -1)
    q = query.float()
    invalid = torch.arange(length, device=device)[None, :] >= lens[:, None]  # [B, L]
    # Unwritten slots of a sequence's last block may hold NaN/inf garbage: a masked
    # probability of 0 times NaN would still be NaN, so zero those V rows.
    v = v.masked_fill(invalid[:, :, None], 0.0)

    if num_kv_heads <= _BLOCK_DIAG_MAX_KV_HEADS:
        # q_bd[b, j*D + d, h] = q[b, h, d] if h // group == j else 0.
        owner = torch.arange(num_heads, device=device) // group
        select = owner[None, :] == torch.arange(num_kv_heads, device=device)[:, None]
        q_bd = q.transpose(1, 2)[:, None, :, :] * select[None, :, None, :].to(q.dtype)
        q_bd = q_bd.reshape(num_seqs, num_kv_heads * head_dim, num_heads)
        scores = torch.bmm(k, q_bd) * scale  # [B, L, H]
        scores = scores.masked_fill(invalid[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=1)
        full = torch.bmm(probs.transpose(1, 2), v)  # [B, H, Hkv * D]
        full = full.view(num_seqs, num_heads, num_kv_heads, head_dim)
        out = full[:, torch.arange(num_heads, device=device), owner]  # [B, H, D]
    else:
        k4 = k.view(num_seqs, length, num_kv_heads, head_dim)
        v4 = v.view(num_seqs, length, num_kv_heads, head_dim)
        qg = q.view(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, k4.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, L]
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v4.permute(0, 2, 1, 3))  # [B, Hkv, G, D]
        out = out.reshape(num_seqs, num_heads, head_dim)
    if bool((lens <= 0).any()):
        # A sequence without keys has an all-masked row (NaN softmax): define it as zeros.
        out = out.masked_fill((lens <= 0)[:, None, None], 0.0)
    return out.to(query.dtype)


def _prefill_one(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk ``q [T, H, D]`` against its ``seq_len`` cached tokens."""
    q_len, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    n_blk = cdiv(seq_len, block_size)
    ids = _clamp_blocks(table[:n_blk], num_blocks)
    k = _widen(_gather_tokens(key_cache, ids)[:seq_len], k_scale)  # [L, Hkv, D]
    v = _widen(_gather_tokens(value_cache, ids)[:seq_len], v_scale)
    # [Hkv, G*T, D] x [Hkv, D, L] -> [Hkv, G*T, L]; rows ordered (g, t).
    qg = q.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    future = k_pos[None, :] > q_pos[:, None]  # [T, L]
    scores = scores.view(num_kv_heads, group, q_len, seq_len).masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, seq_len)
    out = torch.bmm(probs, v.permute(1, 0, 2))  # [Hkv, G*T, D]
    out = out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Chunked-prefill / extend attention over a ragged batch of query chunks.

    Chunks of length 1 (decodes) are batched together through
    :func:`paged_decode_attention`; longer chunks are processed one sequence at a time.
    """
    out = torch.zeros_like(query)
    if query.shape[0] == 0:
        return out
    cu = cu_seqlens_q.to(torch.int64).tolist()
    lens = seq_lens.to(torch.int64).tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    decode_seqs = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decode_seqs) > 1:
        idx = torch.tensor(decode_seqs, device=query.device, dtype=torch.int64)
        rows = torch.tensor([cu[i] for i in decode_seqs], device=query.device)
        tables = block_tables.to(query.device).index_select(0, idx)
        sl = seq_lens.to(query.device).index_select(0, idx)
        out[rows] = paged_decode_attention(
            query[rows], key_cache, value_cache, tables, sl, scale, k_scale, v_scale
        )
        done = set(decode_seqs)
    else:
        done = set()
    for s, q_len in enumerate(q_lens):
        if q_len == 0 or s in done:
            continue
        start = cu[s]
        out[start : start + q_len] = _prefill_one(
            query[start : start + q_len],
            key_cache,
            value_cache,
            block_tables[s].to(query.device),
            lens[s],
            scale,
            k_scale,
            v_scale,
        ).to(query.dtype)
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 elements as their bytes (torch has no fp8 ``index_copy_``); others (int8 with its
    scales included) as they are."""
    return t.view(torch.uint8) if fp8.is_fp8(t.dtype) else t


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For each ``(src, dst)`` row of ``block_mapping`` copy block ``src`` onto ``dst``."""
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.to(device=key_caches[0].device, dtype=torch.int64)
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        raw = _raw(cache)
        raw.index_copy_(0, dst, raw.index_select(0, src))


def gather_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack blocks into ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
    ids = block_ids.to(device=key_caches[0].device, dtype=torch.int64)
    per_layer = [
        torch.stack((k.index_select(0, ids), v.index_select(0, ids)), dim=1)
        for k, v in zip(key_caches, value_caches, strict=True)
    ]
    packed = torch.stack(per_layer, dim=1)
    if out is None:
        return packed
    out.copy_(packed)
    return out


def scatter_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    packed: torch.Tensor,
) -> None:
    """Inverse of :func:`gather_blocks`: write ``packed[i]`` into block ``block_ids[i]``."""
    device = key_caches[0].device
    ids = block_ids.to(device=device, dtype=torch.int64)
    packed = packed.to(device=device, non_blocking=True)
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        _raw(k).index_copy_(0, ids, _raw(packed[:, layer, 0].to(k.dtype)))
        _raw(v).index_copy_(0, ids, _raw(packed[:, layer, 1].to(v.dtype)))
