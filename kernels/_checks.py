"""Argument validation for the public kernel API in :mod:`pagedserve.kernels.ops`.

Every check raises :class:`ValueError` naming the offending argument. The ``check_<op>``
functions validate all arguments of one public operation (in a fixed order, so the same
bad call always reports the same argument) before a backend is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------- building blocks
def check_rank(name: str, t: torch.Tensor, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")


def check_index(name: str, t: torch.Tensor, rank: int) -> None:
    check_rank(name, t, rank)
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the KV cache is on {device}")


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, prefix: str = "") -> None:
    check_rank(f"{prefix}key_cache", key_cache, 4)
    check_rank(f"{prefix}value_cache", value_cache, 4)
    if key_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{prefix}key_cache must be fp32/fp16/bf16, got {key_cache.dtype}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"{prefix}value_cache shape {tuple(value_cache.shape)} != "
            f"key_cache shape {tuple(key_cache.shape)}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"{prefix}value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}"
        )
    check_device(f"{prefix}value_cache", value_cache, key_cache.device)
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError(f"{prefix}key_cache and {prefix}value_cache must be contiguous")


def check_query(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    check_rank("query", query, 3)
    check_device("query", query, key_cache.device)
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != key_cache dtype {key_cache.dtype}")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != key_cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
        )


def check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int, device: torch.device
) -> None:
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    check_device("block_tables", block_tables, device)
    check_device("seq_lens", seq_lens, device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected {num_seqs}")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, expected {num_seqs}")


def check_layers(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]) -> None:
    if len(key_caches) == 0:
        raise ValueError("key_caches must hold at least one layer")
    if len(value_caches) != len(key_caches):
        raise ValueError(
            f"value_caches has {len(value_caches)} layers, key_caches has {len(key_caches)}"
        )
    first = key_caches[0]
    for i, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        check_caches(k, v, prefix=f"layer {i} ")
        if k.shape != first.shape or k.dtype != first.dtype or k.device != first.device:
            raise ValueError(
                f"key_caches[{i}] ({tuple(k.shape)}, {k.dtype}, {k.device}) differs from "
                f"key_caches[0] ({tuple(first.shape)}, {first.dtype}, {first.device})"
            )


def check_block_ids(name: str, ids: torch.Tensor, rank: int) -> None:
    check_index(name, ids, rank)


def packed_shape(key_caches: Sequence[torch.Tensor], n: int) -> tuple[int, ...]:
    """Shape of the :func:`~pagedserve.kernels.gather_blocks` buffer for ``n`` blocks."""
    _, block_size, num_kv_heads, head_dim = key_caches[0].shape
    return (n, len(key_caches), 2, block_size, num_kv_heads, head_dim)


# --------------------------------------------------------------------- per operation
def check_store(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.store_kv_cache`."""
    check_caches(key_cache, value_cache)
    check_rank("key", key, 3)
    check_rank("value", value, 3)
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key shape {tuple(key.shape)} does not match key_cache "
            f"(num_kv_heads, head_dim) = {tuple(key_cache.shape[2:])}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != key_cache dtype {key_cache.dtype}")
        check_device(name, t, key_cache.device)
    check_index("slot_mapping", slot_mapping, 1)
    check_device("slot_mapping", slot_mapping, key_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries, key has {key.shape[0]} tokens"
        )


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.paged_decode_attention`."""
    check_caches(key_cache, value_cache)
    check_query(query, key_cache)
    check_tables(block_tables, seq_lens, query.shape[0], key_cache.device)


def check_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.paged_prefill_attention`."""
    check_caches(key_cache, value_cache)
    check_query(query, key_cache)
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    check_device("cu_seqlens_q", cu_seqlens_q, key_cache.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    check_tables(block_tables, seq_lens, num_seqs, key_cache.device)


def check_copy(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.copy_blocks`; reads the mapping on the host."""
    check_layers(key_caches, value_caches)
    check_index("block_mapping", block_mapping, 2)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}")
    check_device("block_mapping", block_mapping, key_caches[0].device)
    pairs = block_mapping.tolist()
    num_blocks = key_caches[0].shape[0]
    srcs = {p[0] for p in pairs}
    dsts = [p[1] for p in pairs]
    if any(not (0 <= b < num_blocks) for pair in pairs for b in pair):
        raise ValueError(f"block_mapping ids must be in [0, {num_blocks})")
    if len(set(dsts)) != len(dsts):
        raise ValueError("block_mapping has a repeated destination block")
    if srcs.intersection(dsts):
        raise ValueError("block_mapping has a block that is both a source and a destination")


def check_gather(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.gather_blocks`."""
    check_layers(key_caches, value_caches)
    check_block_ids("block_ids", block_ids, 1)
    check_device("block_ids", block_ids, key_caches[0].device)
    if out is not None:
        check_rank("out", out, 6)
        expected = packed_shape(key_caches, block_ids.shape[0])
        if tuple(out.shape) != expected:
            raise ValueError(f"out shape {tuple(out.shape)} != expected {expected}")
        if out.dtype != key_caches[0].dtype:
            raise ValueError(f"out dtype {out.dtype} != cache dtype {key_caches[0].dtype}")


def check_scatter(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    packed: torch.Tensor,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.scatter_blocks`."""
    check_layers(key_caches, value_caches)
    check_block_ids("block_ids", block_ids, 1)
    check_device("block_ids", block_ids, key_caches[0].device)
    check_rank("packed", packed, 6)
    expected = packed_shape(key_caches, block_ids.shape[0])
    if tuple(packed.shape) != expected:
        raise ValueError(f"packed shape {tuple(packed.shape)} != expected {expected}")
    if packed.dtype != key_caches[0].dtype:
        raise ValueError(f"packed dtype {packed.dtype} != cache dtype {key_caches[0].dtype}")
