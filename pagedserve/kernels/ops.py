"""Public kernel API: backend dispatch and the validated entry points.

Each function validates its arguments (:mod:`pagedserve.kernels._checks`), picks a backend
with :func:`resolve_backend`, and calls the torch reference
(:mod:`pagedserve.kernels.reference`) or a Triton module (``*_triton``, imported lazily on
the first Triton-backend call so that importing this module never imports Triton).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

from pagedserve.kernels import cpu_native, fp8, int8, reference
from pagedserve.kernels._checks import (
    CheckedIndices,
    check_copy,
    check_decode,
    check_gather,
    check_indices,
    check_positions,
    check_prefill,
    check_scatter,
    check_store,
)
from pagedserve.kernels.workspace import DecodeWorkspace

__all__ = [
    "CheckedIndices",
    "check_indices",
    "check_positions",
    "copy_blocks",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "resolve_backend",
    "scatter_blocks",
    "store_kv_cache",
    "uses_cpu_kernels",
]

_BACKENDS = ("auto", "triton", "torch", "cpu")
_TRUTHY = ("1", "true", "on", "yes")


# --------------------------------------------------------------------------- dispatch
def uses_cpu_kernels(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """True when ``backend`` on ``device``/``dtype`` runs the fused C kernels (:mod:`cpu_native`).

    ``"auto"`` and ``"cpu"`` do for fp32, fp8 and int8 CPU caches when the library builds; otherwise
    (another dtype, no compiler) ``"cpu"`` falls back to the torch reference like ``"auto"``.
    """
    return (
        backend in ("auto", "cpu")
        and device.type == "cpu"
        and dtype in (torch.float32, fp8.FP8_DTYPE, int8.INT8_DTYPE)
        and cpu_native.available()
    )


def _cpu_attention(backend: str, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the attention runs the C kernel: :func:`uses_cpu_kernels` for the cache,
    and an fp32 query (what the C kernel reads; an fp8 cache may come with any query)."""
    return query.dtype == torch.float32 and uses_cpu_kernels(
        backend, key_cache.device, key_cache.dtype
    )


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for ``backend`` and the tensors' ``device``.

    ``"cpu"`` resolves like ``"torch"`` here; the attention entry points first check
    :func:`uses_cpu_kernels` and run the fused C kernels when it holds.

    Raises:
        ValueError: ``backend`` is not one of ``"auto"``, ``"triton"``, ``"torch"``,
            ``"cpu"``.
        RuntimeError: ``"triton"`` was asked for CPU tensors while ``TRITON_INTERPRET=1``
            is not set, or Triton is not installed.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend in ("torch", "cpu"):
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


# ----------------------------------------------------------------------- public API
def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
    *,
    checked: CheckedIndices | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new tokens' K/V into the paged cache in place (vLLM ``reshape_and_cache``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the cache;
            fp32/fp16/bf16 for a ``torch.float8_e4m3fn`` cache, which stores
            :func:`pagedserve.kernels.fp8.quantize` of ``key / k_scale`` and
            ``value / v_scale`` (saturated to +-448, round to nearest even).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (int32 accepted) ``[num_tokens]``; token ``i`` goes to block
            ``slot // block_size``, row ``slot % block_size``. ``-1`` (any negative) skips
            the token (padding); every other slot must be ``< num_blocks * block_size``.
            Offsets are computed in int64.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        checked: the step's :func:`check_indices` result; when it holds this
            ``slot_mapping`` (the same tensor) for a cache of this geometry, the slot
            values are not checked again.
        k_scale, v_scale: the fp8 cache's per-tensor scales (fp32, ``> 0``); unused for
            other caches.

    Raises:
        ValueError: rank, shape, dtype or device mismatch, a slot beyond the cache
            (message names the argument and the bad entry), or a scale not finite and
            ``> 0``.
    """
    check_store(key, value, key_cache, value_cache, slot_mapping, checked)
    k_scale, v_scale = fp8.check_scale("k_scale", k_scale), fp8.check_scale("v_scale", v_scale)
    if resolve_backend(backend, key_cache.device) == "torch":
        reference.store_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    from pagedserve.kernels import store_triton

    store_triton.store_kv_cache(
        key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )


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
    checked: CheckedIndices | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Single-token-per-sequence attention over a paged KV cache.

    The Triton path is split-KV flash-decoding (Dao et al., "Flash-Decoding for
    long-context inference", 2023; vLLM ``paged_attention_v2``): stage 1 computes a
    partial output and log-sum-exp per (sequence, KV head, split of the context) with the
    FlashAttention-2 online softmax, stage 2 merges the splits.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, the new token of each sequence (its K/V
            already stored in the cache).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, in
            ``query``'s dtype, or ``torch.float8_e4m3fn`` (read as ``float(q) * scale``,
            widened in registers by the Triton and C kernels).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; the entries a sequence
            reads (its first ``ceil(seq_len / block_size)``) must be in ``[0, num_blocks)``.
        seq_lens: int32 ``[num_seqs]``, context length including the new token (``>= 0``,
            at most ``max_blocks_per_seq * block_size``).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        max_seq_len: optional host-side bound on ``seq_lens`` (Triton only): sizes the
            split count without a device sync; default is the block-table capacity
            ``max_blocks_per_seq * block_size``. Precondition (not checked, to avoid the
            sync): it must be >= every ``seq_lens`` entry, or keys past it are dropped.
        workspace: optional preallocated :class:`DecodeWorkspace` (Triton only) for the
            stage-1 scratch; used when it fits the call, else scratch is allocated.
        checked: the step's :func:`check_indices` result; when it holds these
            ``block_tables`` and ``seq_lens`` (the same tensors) for a cache of this
            geometry, their values are not checked again.
        k_scale, v_scale: an fp8 cache's per-tensor scales (``> 0``); unused otherwise.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query.dtype`` (accumulated in fp32).
        A sequence with ``seq_len == 0`` gets zeros.

    Raises:
        ValueError: rank, shape, dtype or device mismatch, a negative ``seq_lens`` entry,
            a table too narrow for its ``seq_lens`` or a block id it reads outside
            ``[0, num_blocks)`` (message names the argument and the bad entry), or a
            scale not finite and ``> 0``.
    """
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, checked)
    k_scale, v_scale = fp8.check_scale("k_scale", k_scale), fp8.check_scale("v_scale", v_scale)
    if _cpu_attention(backend, query, key_cache):
        num_seqs = query.shape[0]
        cu = torch.arange(num_seqs + 1, dtype=torch.int32)
        lens = seq_lens.to(torch.int32).contiguous()
        if bool((lens <= 0).any()):
            # Defined as zeros for an empty context; the C kernel needs >= 1 key.
            out = torch.zeros_like(query)
            keep = (lens > 0).nonzero().flatten()
            if keep.numel():
                out[keep] = paged_decode_attention(
                    query[keep], key_cache, value_cache, block_tables[keep], lens[keep],
                    scale, backend, k_scale=k_scale, v_scale=v_scale,
                )  # fmt: skip
            return out
        tables = block_tables.to(torch.int32).contiguous()
        return cpu_native.paged_attention(
            query, key_cache, value_cache, tables, cu, lens, float(scale), k_scale, v_scale
        )
    if resolve_backend(backend, key_cache.device) == "torch":
        return reference.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, float(scale), k_scale, v_scale
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
        k_scale=k_scale,
        v_scale=v_scale,
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
    checked: CheckedIndices | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, as
            in :func:`paged_decode_attention` (fp8 included).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; the entries a sequence
            reads (its first ``ceil(seq_len / block_size)``) must be in ``[0, num_blocks)``.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, prefix sums of chunk lengths: starts at 0,
            never decreases, ends at ``total_query_tokens``.
        seq_lens: int32 ``[num_seqs]``, cached context + this chunk (``>= q_len``, at most
            ``max_blocks_per_seq * block_size``).
        scale: softmax scale.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        max_query_len: optional longest chunk length (Triton only) to size the grid
            without reading ``cu_seqlens_q`` back to the host.
        checked: the step's :func:`check_indices` result; when it holds these
            ``cu_seqlens_q``, ``block_tables`` and ``seq_lens`` (the same tensors) for this
            many query rows and a cache of this geometry, their values are not checked
            again.
        k_scale, v_scale: an fp8 cache's per-tensor scales (``> 0``); unused otherwise.

    Returns:
        Tensor shaped like ``query``, in ``query.dtype``.

    Raises:
        ValueError: rank, shape, dtype or device mismatch; a ``cu_seqlens_q`` that does
            not start at 0, decreases, does not end at ``total_query_tokens`` or gives a
            chunk longer than its ``seq_lens`` entry; a block-table entry as in
            :func:`paged_decode_attention` (message names the argument and the entry); a
            scale not finite and ``> 0``.
    """
    check_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, checked)
    k_scale, v_scale = fp8.check_scale("k_scale", k_scale), fp8.check_scale("v_scale", v_scale)
    if _cpu_attention(backend, query, key_cache):
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        return cpu_native.paged_attention(
            query, key_cache, value_cache, tables, cu_seqlens_q.to(torch.int32).contiguous(),
            lens, float(scale), k_scale, v_scale,
        )  # fmt: skip
    if resolve_backend(backend, key_cache.device) == "torch":
        return reference.paged_prefill_attention(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, float(scale),
            k_scale, v_scale,
        )  # fmt: skip
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
        k_scale=k_scale,
        v_scale=v_scale,
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
    check_copy(key_caches, value_caches, block_mapping)
    if resolve_backend(backend, key_caches[0].device) == "torch":
        reference.copy_blocks(list(key_caches), list(value_caches), block_mapping)
        return
    from pagedserve.kernels import blocks_triton

    blocks_triton.copy_blocks(list(key_caches), list(value_caches), block_mapping)


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
        block_ids: int64 ``[n]`` physical blocks to pack, in order, in ``[0, num_blocks)``.
        out: optional destination of the packed shape and cache dtype, on any device
            (e.g. a pinned host buffer); the result is copied into it and returned.
        backend: accepted for a uniform signature; every backend uses torch indexing.

    Returns:
        ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` (block-major: ``[i]`` is
        all layers' K (``[:, :, 0]``) and V (``[:, :, 1]``) of ``block_ids[i]``), on the
        caches' device unless ``out`` is given.

    Raises:
        ValueError: rank, shape, dtype or device mismatch, or a block id outside the
            cache (message names the argument).
    """
    check_gather(key_caches, value_caches, block_ids, out)
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
        block_ids: int64 ``[n]`` destination blocks in ``[0, num_blocks)``; ``packed[i]``
            goes to ``block_ids[i]``.
        packed: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the cache
            dtype, on any device (copied to the caches' device first).
        backend: accepted for a uniform signature; every backend uses torch indexing.

    Raises:
        ValueError: rank, shape, dtype or device mismatch, or a block id outside the
            cache (message names the argument).
    """
    check_scatter(key_caches, value_caches, block_ids, packed)
    resolve_backend(backend, key_caches[0].device)
    reference.scatter_blocks(list(key_caches), list(value_caches), block_ids, packed)
