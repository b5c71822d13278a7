"""Paged KV-cache kernels: cache store, paged decode / prefill attention, block copies.

Every operation has two implementations behind one validated entry point:

* ``backend="torch"``: the pure-torch reference in :mod:`pagedserve.kernels.reference`
  (gather through the block table, fp32 softmax attention). It is also the CPU serving
  path.
* ``backend="triton"``: Triton kernels (``*_triton.py`` modules). On CUDA tensors they run
  compiled; on CPU tensors they run only under the Triton interpreter
  (``TRITON_INTERPRET=1`` set before the first Triton-backend call, when the kernels are
  defined), which is how the tests exercise them without a GPU. Head dims up to 256.
* ``backend="cpu"``: fused C kernels for fp32 CPU tensors
  (:mod:`pagedserve.kernels.cpu_native`: paged attention straight through the block
  tables, rotary + K/V store, RMSNorm, SiLU*mul), compiled on first use with the system C
  compiler; the torch reference when the compiler or the dtype does not allow it.
* ``backend="auto"`` (default): Triton for CUDA tensors (torch if Triton is not
  installed), the fused C kernels for fp32 CPU tensors when they build, torch otherwise.

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

Argument errors (rank, shape, dtype, device, and index values that would reach outside a
buffer: slots, block-table entries, ``cu_seqlens_q``, rotary positions) raise
:class:`ValueError` naming the argument; :func:`check_indices` validates a whole step's
indices once and its :class:`CheckedIndices` lets the per-layer calls skip repeating that.

The entry points live in :mod:`pagedserve.kernels.ops` (argument checks in the private
``_checks`` module) and are re-exported here.
"""

from __future__ import annotations

from pagedserve.kernels import reference as reference  # submodule, re-exported
from pagedserve.kernels.ops import (
    CheckedIndices,
    check_indices,
    check_positions,
    copy_blocks,
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    resolve_backend,
    scatter_blocks,
    store_kv_cache,
    uses_cpu_kernels,
)
from pagedserve.kernels.workspace import DecodeWorkspace

__all__ = [
    "CheckedIndices",
    "DecodeWorkspace",
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
