"""Paged KV-cache kernels: cache store, paged decode / prefill attention, block copies.

Every operation has two implementations behind one validated entry point:

* ``backend="torch"``: the pure-torch reference in :mod:`pagedserve.kernels.reference`
  (gather through the block table, fp32 softmax attention). It is also the CPU serving
  path.
* ``backend="triton"``: Triton kernels (``*_triton.py`` modules). On CUDA tensors they run
  compiled; on CPU tensors they run only under the Triton interpreter
  (``TRITON_INTERPRET=1`` set before the first Triton-backend call, when the kernels are
  defined), which is how the tests exercise them without a GPU. Head dims up to 256.
* ``backend="auto"`` (default): Triton for CUDA tensors (torch if Triton is not
  installed), torch for anything else.

``copy_blocks`` has a Triton kernel (one launch for all layers); ``gather_blocks`` /
``scatter_blocks`` always use torch ``index_select`` / ``index_copy_`` (bandwidth-bound
gathers that need no custom kernel).

Importing this package never imports Triton; the Triton modules are loaded on first use.

Shared layouts:

* ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
  contiguous, one pair per layer. A token's slot is ``block_id * block_size + offset``.
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; row ``s`` lists the physical
  blocks of sequence ``s`` in logical order. Entries past the last used block are ignored.
* Grouped-query attention: ``num_heads`` is a multiple of ``num_kv_heads`` and query head
  ``h`` attends with KV head ``h // (num_heads // num_kv_heads)``.

Argument errors (rank, shape, dtype, device) raise :class:`ValueError` naming the argument.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.workspace import DecodeWorkspace

__all__ = [
    "DecodeWorkspace",
    "copy_blocks",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "resolve_backend",
    "scatter_blocks",
    "store_kv_cache",
]

_BACKENDS = ("auto", "triton", "torch")
_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRUTHY = ("1", "true", "on", "yes")


# --------------------------------------------------------------------------- dispatch
def resolve_backend(backend: str, device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for ``backend`` and the tensors' ``device``.

    Raises:
        ValueError: ``backend`` is not one of ``"auto"``, ``"triton"``, ``"torch"``.
        RuntimeError: ``"triton"`` was asked for CPU tensors while ``TRITON_INTERPRET=1``
            is not set, or Triton is not installed.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        has_triton = importlib.util.find_spec("triton") is not None
        return "triton" if device.type == "cuda" and has_triton else "torch"
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"backend='triton' on {device.type} tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 (before the first Triton-backend call), or use "
            "backend='torch'/'auto'"
        )
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a dependency on x86_64
        raise RuntimeError("backend='triton' needs the triton package") from exc
    return "triton"


# ------------------------------------------------------------------------- validation
def _check_rank(name: str, t: torch.Tensor, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")


def _check_index(name: str, t: torch.Tensor, rank: int) -> None:
    _check_rank(name, t, rank)
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the KV cache is on {device}")


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, prefix: str = "") -> None:
    _check_rank(f"{prefix}key_cache", key_cache, 4)
    _check_rank(f"{prefix}value_cache", value_cache, 4)
    if key_cache.dtype not in _FLOAT_DTYPES:
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
    _check_device(f"{prefix}value_cache", value_cache, key_cache.device)
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError(f"{prefix}key_cache and {prefix}value_cache must be contiguous")


def _check_query(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    _check_rank("query", query, 3)
    _check_device("query", query, key_cache.device)
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != key_cache dtype {key_cache.dtype}")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != key_cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
        )


def _check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int, device: torch.device
) -> None:
    _check_index("block_tables", block_tables, 2)
    _check_index("seq_lens", seq_lens, 1)
    _check_device("block_tables", block_tables, device)
    _check_device("seq_lens", seq_lens, device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected {num_seqs}")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, expected {num_seqs}")


def _check_layers(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]) -> None:
    if len(key_caches) == 0:
        raise ValueError("key_caches must hold at least one layer")
    if len(value_caches) != len(key_caches):
        raise ValueError(
            f"value_caches has {len(value_caches)} layers, key_caches has {len(key_caches)}"
        )
    first = key_caches[0]
    for i, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        _check_caches(k, v, prefix=f"layer {i} ")
        if k.shape != first.shape or k.dtype != first.dtype or k.device != first.device:
            raise ValueError(
                f"key_caches[{i}] ({tuple(k.shape)}, {k.dtype}, {k.device}) differs from "
                f"key_caches[0] ({tuple(first.shape)}, {first.dtype}, {first.device})"
            )


def _check_block_ids(name: str, ids: torch.Tensor, rank: int) -> None:
    _check_index(name, ids, rank)


# ----------------------------------------------------------------------- public API
def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write new tokens' K/V into the paged cache in place (vLLM ``reshape_and_cache``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the cache.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (int32 accepted) ``[num_tokens]``; token ``i`` goes to block
            ``slot // block_size``, row ``slot % block_size``. ``-1`` (any negative) skips
            the token (padding). Offsets are computed in int64.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: rank, shape, dtype or device mismatch (message names the argument).
    """
    _check_caches(key_cache, value_cache)
    _check_rank("key", key, 3)
    _check_rank("value", value, 3)
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
        _check_device(name, t, key_cache.device)
    _check_index("slot_mapping", slot_mapping, 1)
    _check_device("slot_mapping", slot_mapping, key_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries, key has {key.shape[0]} tokens"
        )
    if resolve_backend(backend, key_cache.device) == "torch":
        reference.store_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    from pagedserve.kernels import store_triton

    store_triton.store_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
    *,
    max_seq_len: int | None = None,
    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """Single-token-per-sequence attention over a paged KV cache.

    The Triton path is split-KV flash-decoding (Dao et al., "Flash-Decoding for
    long-context inference", 2023; vLLM ``paged_attention_v2``): stage 1 computes a
    partial output and log-sum-exp per (sequence, KV head, split of the context) with the
    FlashAttention-2 online softmax, stage 2 merges the splits.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, the new token of each sequence (its K/V
            already stored in the cache).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: int32 ``[num_seqs]``, context length including the new token.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        max_seq_len: optional host-side bound on ``seq_lens`` (Triton only): sizes the
            split count without a device sync; default is the block-table capacity
            ``max_blocks_per_seq * block_size``. Precondition (not checked, to avoid the
            sync): it must be >= every ``seq_lens`` entry, or keys past it are dropped.
        workspace: optional preallocated :class:`DecodeWorkspace` (Triton only) for the
            stage-1 scratch; used when it fits the call, else scratch is allocated.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query.dtype`` (accumulated in fp32).
        A sequence with ``seq_len == 0`` gets zeros.

    Raises:
        ValueError: rank, shape, dtype or device mismatch (message names the argument).
    """
    _check_caches(key_cache, value_cache)
    _check_query(query, key_cache)
    _check_tables(block_tables, seq_lens, query.shape[0], key_cache.device)
    if resolve_backend(backend, key_cache.device) == "torch":
        return reference.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, float(scale)
        )
    from pagedserve.kernels import decode_triton

    return decode_triton.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        float(scale),
        max_seq_len=max_seq_len,
        workspace=workspace,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal chunked-prefill (extend) attention over a paged KV cache.

    Sequence ``s`` contributes the query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    (``q_len``); query ``i`` sits at position ``seq_lens[s] - q_len + i`` and attends to
    every key at a position ``<=`` its own (cached context plus the causal part of its own
    chunk, whose K/V are already stored). Chunks with ``q_len == 1`` are decodes, so a
    mixed prefill + decode batch is one call. The Triton path is a FlashAttention-2 style
    kernel (online softmax, Dao 2023) with the GQA query heads packed into the M dimension
    and K/V tiles loaded through the block table.

    Args:
        query: ``[total_query_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, prefix sums of chunk lengths, starting at 0
            and ending at ``total_query_tokens``.
        seq_lens: int32 ``[num_seqs]``, cached context + this chunk (``>= q_len``).
        scale: softmax scale.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        max_query_len: optional longest chunk length (Triton only) to size the grid
            without reading ``cu_seqlens_q`` back to the host.

    Returns:
        Tensor shaped like ``query``, in ``query.dtype``.

    Raises:
        ValueError: rank, shape, dtype or device mismatch (message names the argument).
    """
    _check_caches(key_cache, value_cache)
    _check_query(query, key_cache)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1)
    _check_device("cu_seqlens_q", cu_seqlens_q, key_cache.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    _check_tables(block_tables, seq_lens, num_seqs, key_cache.device)
    if resolve_backend(backend, key_cache.device) == "torch":
        return reference.paged_prefill_attention(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, float(scale)
        )
    from pagedserve.kernels import prefill_triton

    return prefill_triton.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        float(scale),
        max_query_len=max_query_len,
    )


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Copy whole blocks of every layer in place, for copy-on-write of shared prefixes.

    Args:
        key_caches, value_caches: per-layer caches, all
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` with one dtype and device.
        block_mapping: int64 ``[n, 2]`` rows of ``(src_block, dst_block)``. Destinations
            must be distinct and not also be sources in the same call.
        backend: ``"auto"``, ``"triton"`` (one Triton program per (pair, layer, tile))
            or ``"torch"`` (``index_select`` + ``index_copy_`` per layer).

    Raises:
        ValueError: rank, shape, dtype or device mismatch (message names the argument);
            a block id outside ``[0, num_blocks)``, a repeated destination, or a
            destination that is also a source (the backends would disagree on order).
            Checking reads the mapping on the host: copy-on-write is rare, so the sync is
            cheap next to the copy.
    """
    _check_layers(key_caches, value_caches)
    _check_index("block_mapping", block_mapping, 2)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}")
    _check_device("block_mapping", block_mapping, key_caches[0].device)
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
    if resolve_backend(backend, key_caches[0].device) == "torch":
        reference.copy_blocks(list(key_caches), list(value_caches), block_mapping)
        return
    from pagedserve.kernels import blocks_triton

    blocks_triton.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def _packed_shape(key_caches: Sequence[torch.Tensor], n: int) -> tuple[int, ...]:
    _, block_size, num_kv_heads, head_dim = key_caches[0].shape
    return (n, len(key_caches), 2, block_size, num_kv_heads, head_dim)


def gather_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Pack the given blocks of every layer into one contiguous buffer (swap-out unit).

    Always implemented with torch indexing (``index_select`` per layer, one ``stack``),
    which on CUDA is already a bandwidth-bound gather; no Triton kernel is needed.

    Args:
        key_caches, value_caches: per-layer caches as in :func:`copy_blocks`.
        block_ids: int64 ``[n]`` physical blocks to pack, in order.
        out: optional destination of the packed shape and cache dtype, on any device
            (e.g. a pinned host buffer); the result is copied into it and returned.
        backend: accepted for a uniform signature; every backend uses torch indexing.

    Returns:
        ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` (block-major: ``[i]`` is
        all layers' K (``[:, :, 0]``) and V (``[:, :, 1]``) of ``block_ids[i]``), on the
        caches' device unless ``out`` is given.

    Raises:
        ValueError: rank, shape, dtype or device mismatch (message names the argument).
    """
    _check_layers(key_caches, value_caches)
    _check_block_ids("block_ids", block_ids, 1)
    _check_device("block_ids", block_ids, key_caches[0].device)
    if out is not None:
        _check_rank("out", out, 6)
        expected = _packed_shape(key_caches, block_ids.shape[0])
        if tuple(out.shape) != expected:
            raise ValueError(f"out shape {tuple(out.shape)} != expected {expected}")
        if out.dtype != key_caches[0].dtype:
            raise ValueError(f"out dtype {out.dtype} != cache dtype {key_caches[0].dtype}")
    resolve_backend(backend, key_caches[0].device)
    return reference.gather_blocks(list(key_caches), list(value_caches), block_ids, out)


def scatter_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    packed: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Unpack a :func:`gather_blocks` buffer into the given blocks (swap-in unit), in place.

    Args:
        key_caches, value_caches: per-layer caches as in :func:`copy_blocks`.
        block_ids: int64 ``[n]`` destination blocks; ``packed[i]`` goes to ``block_ids[i]``.
        packed: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the cache
            dtype, on any device (copied to the caches' device first).
        backend: accepted for a uniform signature; every backend uses torch indexing.

    Raises:
        ValueError: rank, shape, dtype or device mismatch (message names the argument).
    """
    _check_layers(key_caches, value_caches)
    _check_block_ids("block_ids", block_ids, 1)
    _check_device("block_ids", block_ids, key_caches[0].device)
    _check_rank("packed", packed, 6)
    expected = _packed_shape(key_caches, block_ids.shape[0])
    if tuple(packed.shape) != expected:
        raise ValueError(f"packed shape {tuple(packed.shape)} != expected {expected}")
    if packed.dtype != key_caches[0].dtype:
        raise ValueError(f"packed dtype {packed.dtype} != cache dtype {key_caches[0].dtype}")
    resolve_backend(backend, key_caches[0].device)
    reference.scatter_blocks(list(key_caches), list(value_caches), block_ids, packed)
