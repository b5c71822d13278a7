"""Triton split-KV paged decode attention (flash-decoding over a paged KV cache).

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023) as adapted to paged caches by
vLLM's ``paged_attention_v2``, with the FlashAttention-2 online softmax (Dao, 2023).

Stage 1, grid ``(num_seqs, num_kv_heads, num_splits)``: a program owns the query heads
that share one KV head (the GQA group, padded to >= 16 rows and masked so ``q @ K^T`` is
a ``tl.dot`` and each K/V tile is read once for the whole group) and one contiguous split
of the sequence. It walks the split in tiles of ``BLOCK_N`` tokens; token ``pos`` lives in
physical block ``block_tables[seq, pos // block_size]`` at row ``pos % block_size``
(addresses in int64). It keeps a running max, running sum and rescaled accumulator in fp32
(base-2 exponentials with ``log2(e)`` folded into the scale) and writes the normalized
partial output and the log-sum-exp of its split. Stage 2, grid ``(num_seqs, num_heads)``,
merges the splits with weights ``exp2(lse_split - max_lse)``. With a single split stage 1
writes the final output directly and stage 2 is skipped.
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
    sm_count,
)
from pagedserve.kernels.workspace import DecodeWorkspace

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# Tokens per tile and warps by padded head_dim (GPU defaults; no autotuning, so the same
# choice is used under the interpreter).
_DECODE_CONFIGS = MappingProxyType(
    {16: (64, 4), 32: (64, 4), 64: (64, 4), 128: (32, 4), 256: (16, 8)}
)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    qk_scale,
    v_scale,
    block_size,
    tokens_per_split,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_INT8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = (kv_head * GROUP + g).to(tl.int64)
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + seq64 * stride_qs + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    if FP32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq64 * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
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
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
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

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    result = acc / l_safe[:, None] * v_scale
    if DIRECT:
        o_ptrs = out_ptr + seq64 * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        split64 = split.to(tl.int64)
        p_ptrs = part_out_ptr + seq64 * stride_ps + head[:, None] * stride_ph + split64 * stride_pk
        tl.store(p_ptrs + d[None, :], result, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + seq64 * stride_ls + head * stride_lh + split64, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    k_mask = k < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + seq * stride_ls + head * stride_lh + k, mask=k_mask, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    p_ptrs = (
        part_out_ptr
        + seq * stride_ps
        + head * stride_ph
        + k[:, None].to(tl.int64) * stride_pk
        + d[None, :]
    )
    parts = tl.load(p_ptrs, mask=k_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / denom
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def decode_config(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` for a head dimension (looked up by its padded size)."""
    return _DECODE_CONFIGS[max(16, next_pow2(head_dim))]


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int, max_splits: int
) -> tuple[int, int]:
    """Return ``(num_splits, tokens_per_split)`` for split-KV decode.

    Splits until the grid holds about two programs per SM (more programs only add merge
    work), never below one tile per split and never above ``max_splits``.
    ``tokens_per_split`` is a multiple of ``block_n``.
    """
    n_tiles = max(1, cdiv(max_seq_len, block_n))
    wanted = cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    splits = max(1, min(wanted, n_tiles, max_splits))
    tiles_per_split = cdiv(n_tiles, splits)
    splits = cdiv(n_tiles, tiles_per_split)
    return splits, tiles_per_split * block_n


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    workspace: DecodeWorkspace | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton backend of :func:`pagedserve.kernels.paged_decode_attention`.

    Arguments are validated by the caller. ``max_seq_len`` bounds ``seq_lens`` (default:
    the block-table capacity, which needs no device-to-host sync); ``workspace`` supplies
    preallocated stage-1 scratch; ``num_splits`` and ``block_n`` override the heuristics
    (tests use them to force the multi-split path on tiny grids). An fp8 cache's tiles
    are widened in registers to the query's compute dtype; ``k_scale`` is folded into the
    score scale and ``v_scale`` multiplies each split's normalised output. An int8 cache's
    rows (:mod:`pagedserve.kernels.int8`) are multiplied by their stored scales in fp32 after
    the load (through an fp32 view of the same cache), then taken to the compute dtype.
    """
    check_triton_device(query.device, _decode_split_kernel)
    check_head_dim(query.shape[2])
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()

    group = num_heads // num_kv_heads
    group_pad = max(16, next_pow2(group))
    dim_pad = max(16, next_pow2(head_dim))
    cfg_block_n, num_warps = decode_config(head_dim)
    block_n = block_n or cfg_block_n
    capacity = block_tables.shape[1] * block_size
    bound = capacity if max_seq_len is None else min(int(max_seq_len), capacity)
    use_ws = workspace is not None and workspace.fits(num_seqs, num_heads, head_dim, query.device)
    limit = workspace.max_splits if use_ws and workspace is not None else MAX_SPLITS
    if num_splits is None:
        splits, per_split = choose_num_splits(
            num_seqs, num_kv_heads, bound, block_n, sm_count(query.device), limit
        )
    else:
        splits = max(1, min(int(num_splits), limit))
        per_split = cdiv(cdiv(max(bound, 1), splits), block_n) * block_n

    if splits == 1:
        part_out = part_lse = out  # unused placeholders
    elif use_ws and workspace is not None:
        part_out, part_lse = workspace.part_out, workspace.part_lse
    else:
        part_out = torch.empty(
            num_seqs, num_heads, splits, dim_pad, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, splits, dtype=torch.float32, device=query.device
        )
    int8 = key_cache.dtype == torch.int8
    fp32 = compute_in_fp32(query.dtype)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        key_cache.view(torch.float32) if int8 else key_cache,  # the int8 rows' scales
        value_cache.view(torch.float32) if int8 else value_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        float(scale) * float(k_scale) * LOG2E,
        float(v_scale),
        block_size,
        per_split,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_N=block_n,
        DIRECT=splits == 1,
        FP32=fp32,
        KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        KV_INT8=int8,
        PRECISION=dot_precision(query.dtype),
        num_warps=num_warps,
    )
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=dim_pad,
            SPLITS_PAD=max(2, next_pow2(splits)),
            num_warps=4 if dim_pad >= 128 else 2,
        )
    return out


__all__ = ["choose_num_splits", "decode_config", "paged_decode_attention"]
