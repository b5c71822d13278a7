"""The worker's paged KV cache: one K and one V tensor per layer, split into blocks.

Layout per layer and per K/V: ``[num_blocks, block_size, num_kv_heads, head_dim]``, so a
block holds ``block_size`` consecutive tokens of one sequence and slot
``block_id * block_size + offset`` addresses one token (Kwon et al., SOSP 2023, sec. 4.1).
An int8 pool's last dimension is ``head_dim + 4``: each head's int8 elements, then its fp32
scale (:mod:`pagedserve.kernels.int8`), so the scales are part of every block's bytes.
The scheduler owns which block belongs to whom; this module only holds the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import int8
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.config import CacheConfig


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V: ``2 * L * bs * Hkv * D * itemsize``,
    with ``D + 4`` (the scale's bytes) for int8.

    Raises:
        ValueError: an int8 pool for a head_dim that is not a multiple of 4.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    dim = int8.stored_head_dim(arch.head_dim, dtype)
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * dim * itemsize


def num_blocks_for(cache: CacheConfig, arch: ModelArch, dtype: torch.dtype) -> int:
    """Pool size in blocks: ``cache.num_blocks``, else ``kv_cache_memory // bytes_per_block``.

    Raises:
        ValueError: when not even one block fits in ``kv_cache_memory``.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    n = cache.kv_cache_memory // per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_memory={cache.kv_cache_memory} bytes holds no KV block "
            f"({per_block} bytes per block of {cache.block_size} tokens); raise it or "
            "lower block_size"
        )
    return n


@dataclass(frozen=True)
class KVPool:
    """Per-layer K and V cache tensors of one worker.

    Attributes:
        key_caches, value_caches: one tensor per layer,
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``head_dim + 4`` for
            int8), zero-initialized (so that padded rows read by attention are finite).
        block_size: tokens per block.
    """

    key_caches: tuple[torch.Tensor, ...]
    value_caches: tuple[torch.Tensor, ...]
    block_size: int

    @classmethod
    def allocate(
        cls, cache: CacheConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device
    ) -> KVPool:
        """Allocate the pool sized by :func:`num_blocks_for`.

        Raises:
            ValueError: when no block fits.
            torch.OutOfMemoryError / RuntimeError: when the device cannot hold it.
        """
        n = num_blocks_for(cache, arch, dtype)
        shape = (n, cache.block_size, arch.num_kv_heads, int8.stored_head_dim(arch.head_dim, dtype))
        keys = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers))
        values = tuple(
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)
        )
        return cls(keys, values, cache.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return int(self.key_caches[0].shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every K and V tensor."""
        return self.key_caches[0].dtype

    @property
    def num_layers(self) -> int:
        """Layers (pairs of K/V tensors)."""
        return len(self.key_caches)

    @property
    def nbytes(self) -> int:
        """Total bytes of all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.key_caches, *self.value_caches))

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(key_cache, value_cache)]`` per layer, as the model's forward takes them."""
        return list(zip(self.key_caches, self.value_caches))
