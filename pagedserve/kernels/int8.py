"""The int8 KV-cache format: scales stored in the block, next to the elements they scale.

An int8 KV cache holds, for every (slot, KV head), ``head_dim`` int8 elements followed by
the 4 bytes of one fp32 scale: a layer's K (or V) cache is one ``torch.int8`` tensor
``[num_blocks, block_size, num_kv_heads, head_dim + 4]``. A head vector ``x`` (fp32) is
stored as ``scale = absmax(x) / 127`` and ``q = clamp(rne(x / scale), -127, 127)``
(symmetric; round to nearest even; ``q = 0`` where ``scale == 0``) and reads back as
``float(q) * scale``. The scales of a layer form the fp32 view :func:`scales`,
``[num_blocks, block_size, num_kv_heads]``, indexed by the same block ids as the elements;
since they live inside each block's bytes, everything that moves a block (copy-on-write,
swap out and in, the host store, prefix sharing) moves its scales with no code of its own.

The absmax / 127 rule is the symmetric int8 quantiser of LLM.int8() (Dettmers et al.,
2022, sec. 3.1), applied here per token and KV head with the scale computed on store. These
functions
are the reference the C kernels are tested against (the same bytes on store, the same fp32
values on read).
"""

from __future__ import annotations

import torch

INT8_DTYPE = torch.int8
"""The element type of an int8 KV cache."""

INT8_MAX = 127.0
"""The largest stored magnitude: ``q`` lies in ``[-127, 127]``."""

SCALE_BYTES = 4
"""Bytes of the fp32 scale after each head's elements."""

__all__ = [
    "INT8_DTYPE",
    "INT8_MAX",
    "SCALE_BYTES",
    "cache_head_dim",
    "dequantize",
    "is_int8",
    "quantize",
    "scales",
    "stored_head_dim",
]


def is_int8(dtype: torch.dtype) -> bool:
    """True for the int8 KV element type."""
    return dtype == INT8_DTYPE


def stored_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache of ``dtype`` for heads of ``head_dim``: ``head_dim + 4``
    for int8 (the scale's bytes), ``head_dim`` for every other dtype.

    Raises:
        ValueError: an int8 cache for a ``head_dim`` that is not a positive multiple of 4
            (the scales' fp32 view needs 4-byte aligned rows).
    """
    if not is_int8(dtype):
        return head_dim
    if head_dim <= 0 or head_dim % SCALE_BYTES:
        raise ValueError(f"an int8 KV cache needs head_dim a multiple of 4, got {head_dim}")
    return head_dim + SCALE_BYTES


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache holds (its last dimension, less the scale bytes of int8)."""
    last = int(cache.shape[-1])
    return last - SCALE_BYTES if is_int8(cache.dtype) else last


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (any float dtype) as int8 head vectors with their scales: int8
    ``[..., D + 4]``, computed in fp32 (``D`` a multiple of 4)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, xf / safe, torch.zeros_like(xf))
    q = q.round().clamp(-INT8_MAX, INT8_MAX).to(INT8_DTYPE)
    return torch.cat((q, scale.contiguous().view(INT8_DTYPE)), dim=-1)


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """fp32 ``float(q) * scale`` of int8 head vectors ``[..., D + 4]``: ``[..., D]``."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return packed[..., :d].float() * scale


def scales(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of an int8 cache ``[..., D + 4]`` as a view ``[...]`` (writes go to
    the cache)."""
    d = cache.shape[-1] - SCALE_BYTES
    return cache.view(torch.float32)[..., d // SCALE_BYTES]
