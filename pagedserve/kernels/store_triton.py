"""Triton ``reshape_and_cache``: scatter new tokens' K/V rows into the paged cache.

Algorithm as in vLLM's ``reshape_and_cache``: one program per (token, tile of the
``num_kv_heads * head_dim`` row); the program loads the token's slot, returns early on a
negative (padding) slot, and otherwise writes the K and V tiles at element offset
``slot * num_kv_heads * head_dim`` of the contiguous cache, computed in int64 so pools of
more than 2**31 elements are addressed correctly.

Into an fp8 (e4m3fn) cache a program stores the bytes of ``x / scale`` saturated to
+-448 and rounded to nearest even, built with integer arithmetic on the fp32 bits
(:func:`_fp8_e4m3_bits`), so the bytes are :func:`pagedserve.kernels.fp8.quantize`'s on
every target: the interpreter's own fp32 -> fp8 cast flushes e4m3 subnormals to zero.

Into an int8 cache (:mod:`pagedserve.kernels.int8`: each head's int8 elements, then its
fp32 scale) one program per (token, KV head) stores ``q = clamp(rne(x / s), -127, 127)``
and ``s = absmax(x) / 127``: the divisions round to nearest (``div_rn``) and the rounding to
an integer is the fp32 add/subtract of 1.5 * 2**23, so the bytes are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.common_triton import cdiv, check_triton_device, next_pow2


@triton.jit
def _fp8_e4m3_bits(x, scale):
    """uint8 e4m3fn bits of fp32 ``x / scale``: saturated to +-448, round to nearest even,
    NaN -> 0x7f with the sign. Below 2**-6 the value is a multiple of 2**-9 (subnormal),
    rounded by the fp32 add/subtract of 2**23; from 2**-6 up the fp32 mantissa is rounded
    to 3 bits on the integer bits and the exponent rebased from 127 to 7."""
    y = x.to(tl.float32) / scale
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    mag = tl.where(a < 0.015625, sub, normal)
    mag = tl.where(y != y, 0x7F, mag)
    return (sign | mag).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    row_elems,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    idx = tile * TILE + tl.arange(0, TILE)
    mask = idx < row_elems
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    t64 = token.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + head * stride_vh + dim, mask=mask)
    dst = slot * row_elems + idx
    if FP8:  # the caches are passed as uint8 views
        tl.store(key_cache_ptr + dst, _fp8_e4m3_bits(k, k_scale), mask=mask)
        tl.store(value_cache_ptr + dst, _fp8_e4m3_bits(v, v_scale), mask=mask)
    else:
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_int8_head(x, dst_ptr, scale_ptr, d, d_mask, HEAD_DIM: tl.constexpr):
    """Store one head vector ``x`` (fp32, padded lanes 0) as int8 at ``dst_ptr + d`` and its
    scale at ``scale_ptr`` (an fp32 pointer to the 4 bytes after the elements)."""
    amax = tl.max(tl.abs(x), 0)
    s = tl.math.div_rn(amax, 127.0)
    safe = tl.where(s > 0.0, s, 1.0)
    y = tl.where(s > 0.0, tl.math.div_rn(x, safe), 0.0)
    y = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 2**22)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(dst_ptr + d, y.to(tl.int8), mask=d_mask)
    tl.store(scale_ptr, s)


@triton.jit
def _store_kv_int8_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    t64 = token.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + head * stride_kh + d, mask=d_mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + head * stride_vh + d, mask=d_mask, other=0.0)
    base = slot * stride_ct + head * stride_ch  # bytes; the scale's fp32 index follows
    scale_at = (base + HEAD_DIM) // 4
    _store_int8_head(
        k.to(tl.float32), key_cache_ptr + base, key_scale_ptr + scale_at, d, d_mask, HEAD_DIM
    )
    _store_int8_head(
        v.to(tl.float32), value_cache_ptr + base, value_scale_ptr + scale_at, d, d_mask, HEAD_DIM
    )


def _store_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    _store_kv_int8_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        key_cache.view(torch.float32),
        value_cache.view(torch.float32),
        slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(1),
        key_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim),
        num_warps=1,
    )


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tile: int | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton backend of :func:`pagedserve.kernels.store_kv_cache` (arguments validated).

    ``key``/``value`` may be strided over tokens and heads (e.g. views into a fused QKV
    projection) but need a unit stride over ``head_dim``. ``tile`` overrides the number of
    elements per program (a power of two; default ``min(1024, next_pow2(heads*dim))``).
    ``k_scale`` / ``v_scale`` divide K / V before an fp8 cache quantises them; an int8
    cache takes a scale per (token, KV head) of its own (``tile`` then unused).
    """
    check_triton_device(key_cache.device, _store_kv_kernel)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if key_cache.dtype == torch.int8:
        _store_int8(key, value, key_cache, value_cache, slot_mapping)
        return
    row = num_kv_heads * head_dim
    tile = tile or min(1024, next_pow2(row))
    grid = (num_tokens, cdiv(row, tile))
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    _store_kv_kernel[grid](
        key,
        value,
        key_cache.view(torch.uint8) if fp8 else key_cache,
        value_cache.view(torch.uint8) if fp8 else value_cache,
        slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        row,
        float(k_scale),
        float(v_scale),
        HEAD_DIM=head_dim,
        TILE=tile,
        FP8=fp8,
        num_warps=4 if tile >= 512 else 1,
    )
