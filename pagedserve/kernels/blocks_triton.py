"""Triton ``copy_blocks``: copy-on-write block copies across all layers in one launch.

As in vLLM's ``copy_blocks``: the per-layer K and V caches are reached through a table of
their base addresses (int64), so one launch with grid
``(2 * num_layers, num_pairs, tiles)`` copies every ``(src, dst)`` block pair of every
layer; element offsets are int64. Swap gather/scatter stay torch index ops (see
:func:`pagedserve.kernels.gather_blocks`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.common_triton import cdiv, check_triton_device, next_pow2


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,
    typed_ptr,
    mapping_ptr,
    block_elems,
    TILE: tl.constexpr,
):
    cache = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    # typed_ptr is any cache of the list: it only lends its pointer type to the cast.
    base = tl.load(cache_ptrs_ptr + cache).to(typed_ptr.dtype)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    idx = tile * TILE + tl.arange(0, TILE)
    mask = idx < block_elems
    data = tl.load(base + src * block_elems + idx, mask=mask)
    tl.store(base + dst * block_elems + idx, data, mask=mask)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Triton backend of :func:`pagedserve.kernels.copy_blocks` (arguments validated)."""
    device = key_caches[0].device
    check_triton_device(device, _copy_blocks_kernel)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    caches = [*key_caches, *value_caches]
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)
    block_elems = caches[0][0].numel()
    tile = min(2048, next_pow2(block_elems))
    grid = (len(caches), num_pairs, cdiv(block_elems, tile))
    _copy_blocks_kernel[grid](
        ptrs,
        # fp8 blocks move as bytes: a copy never converts, and the interpreter's fp8
        # load/store would not keep every bit pattern.
        caches[0].view(torch.uint8) if caches[0].element_size() == 1 else caches[0],
        block_mapping.to(torch.int64).contiguous(),
        block_elems,
        TILE=tile,
        num_warps=4,
    )


__all__ = ["copy_blocks"]
