"""Triton paged prefill / extend attention (chunked prefill over a paged KV cache).

Algorithm: FlashAttention-2 (Dao, 2023) forward pass with an online softmax, reading K/V
through the block table as in vLLM's prefix-prefill / ``context_attention_fwd`` kernels.

Grid ``(num_seqs, num_kv_heads, query_tiles)``. A program owns up to
``BLOCK_M // GROUP`` consecutive query tokens of one sequence and all ``GROUP`` query
heads that share one KV head: the (token, head) pairs are packed into the M dimension
(row ``r`` -> token ``r // GROUP``, head ``r % GROUP``) so each K/V tile loaded from the
cache serves the whole group. The chunk's own K/V are already in the cache, so a single
loop over key positions ``[0, last query position]`` suffices, with the causal mask
``key_pos <= query_pos`` (query ``i`` of a chunk of ``q_len`` sits at position
``seq_len - q_len + i``). Running max/sum in fp32 with base-2 exponentials; rows with no
visible key (padding rows) are guarded so no NaN is produced.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl

from pagedserve.kernels.common_triton import (
    cdiv,
    check_head_dim,
    check_triton_device,
    compute_in_fp32,
    dot_precision,
    next_pow2,
)

LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, num_warps) by padded head_dim; no autotuning (it needs a GPU).
_PREFILL_CONFIGS = MappingProxyType(
    {
        16: (64, 64, 4),
        32: (64, 64, 4),
        64: (64, 64, 4),
        128: (64, 32, 4),
        256: (32, 32, 8),
    }
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ct,
    stride_ch,
    qk_scale,
    v_scale,
    block_size,
    GROUP: tl.constexpr,
    TOKENS_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_INT8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first = q_tile * TOKENS_M
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    t = first + r // GROUP
    head = (kv_head * GROUP + r % GROUP).to(tl.int64)
    row_valid = (r < TOKENS_M * GROUP) & (t < q_len)
    d_mask = d < HEAD_DIM
    io_mask = row_valid[:, None] & d_mask[None, :]
    token = (q_start + t).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    if FP32:
        q = q.to(tl.float32)
    q_pos = ctx_len + t

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    kv_end = tl.minimum(seq_len, ctx_len + first + TOKENS_M)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        block = tl.load(table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (pos % block_size).to(tl.int64) * stride_ct + head_off
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_INT8:  # each row times its scale (the fp32 after the row's elements)
            ks = tl.load(k_scale_ptr + (row + HEAD_DIM) // 4, mask=valid, other=0.0)
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
        elif FP32:
            k = k.to(tl.float32)
        elif KV_FP8:  # e4m3 widens exactly to fp16/bf16
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf: shift by 0 instead so
        # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_INT8:
            vs = tl.load(v_scale_ptr + (row + HEAD_DIM) // 4, mask=valid, other=0.0)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        elif FP32:
            v = v.to(tl.float32)
        elif KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None] * v_scale
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_config(head_dim: int, group: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for a head dimension and GQA group size."""
    block_m, block_n, warps = _PREFILL_CONFIGS[max(16, next_pow2(head_dim))]
    return max(block_m, next_pow2(group)), block_n, warps


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton backend of :func:`pagedserve.kernels.paged_prefill_attention`.

    Arguments are validated by the caller. ``max_query_len`` (longest chunk) sizes the
    grid; when omitted it is read from ``cu_seqlens_q`` (one device-to-host sync).
    ``block_m`` / ``block_n`` override the tile table (powers of two, ``>= 16``). An fp8
    cache is widened in registers as in the decode kernel (``k_scale`` folded into the
    score scale, ``v_scale`` on the normalised output); an int8 cache is dequantised by
    each row's stored scale after the load, as in the decode kernel.
    """
    check_triton_device(query.device, _prefill_kernel)
    check_head_dim(query.shape[2])
    total, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if total == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    cu_seqlens_q = cu_seqlens_q.contiguous()
    seq_lens = seq_lens.contiguous()
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    dim_pad = max(16, next_pow2(head_dim))
    cfg_m, cfg_n, num_warps = prefill_config(head_dim, group)
    block_m = max(block_m or cfg_m, next_pow2(group))
    block_n = block_n or cfg_n
    tokens_m = block_m // group
    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, tokens_m))
    int8 = key_cache.dtype == torch.int8
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        key_cache.view(torch.float32) if int8 else key_cache,  # the int8 rows' scales
        value_cache.view(torch.float32) if int8 else value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        float(scale) * float(k_scale) * LOG2E,
        float(v_scale),
        block_size,
        GROUP=group,
        TOKENS_M=tokens_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP32=compute_in_fp32(query.dtype),
        KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        KV_INT8=int8,
        PRECISION=dot_precision(query.dtype),
        num_warps=num_warps,
    )
    return out


__all__ = ["paged_prefill_attention", "prefill_config"]
