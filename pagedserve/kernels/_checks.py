"""Argument validation for every caller of the paged KV-cache kernels.

Every check raises :class:`ValueError` naming the offending argument (and, for index
values, the bad entry and its value); none is an ``assert``, so ``python -O`` keeps them.
The ``check_<op>`` functions validate all arguments of one public operation of
:mod:`pagedserve.kernels.ops` (in a fixed order, so the same bad call always reports the
same argument) before a backend is chosen. The index-value checks
(:func:`check_slot_values`, :func:`check_table_values`, :func:`check_query_starts`,
:func:`check_positions`) are what keeps the C kernels (:mod:`pagedserve.kernels.cpu_native`,
which index without bounds checks) inside their buffers; :func:`check_indices` runs them
once for a whole model step and returns a :class:`CheckedIndices` that the per-layer calls
pass back to skip repeating them.

The value checks are vectorised torch reductions over the small index tensors, each read
back to the host once (one device sync per check on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.kernels.fp8 import FP8_DTYPE
from pagedserve.kernels.int8 import INT8_DTYPE, SCALE_BYTES, cache_head_dim

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE, INT8_DTYPE)
QUANTIZED_DTYPES = (FP8_DTYPE, INT8_DTYPE)


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
    if key_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"{prefix}key_cache must be fp32/fp16/bf16/float8_e4m3fn/int8, got {key_cache.dtype}"
        )
    last = key_cache.shape[3]
    if key_cache.dtype == INT8_DTYPE and (last <= SCALE_BYTES or last % SCALE_BYTES):
        raise ValueError(
            f"{prefix}an int8 key_cache's last dim (head_dim + 4 scale bytes) must be a "
            f"multiple of 4 above 4, got {last}"
        )
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


def check_activation_dtype(name: str, t: torch.Tensor, key_cache: torch.Tensor) -> None:
    """``t`` (a query, key or value) in the cache's dtype, or in fp32/fp16/bf16 for an
    fp8 or int8 cache (quantised on store, dequantised on read)."""
    if key_cache.dtype in QUANTIZED_DTYPES:
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name} dtype {t.dtype} must be fp32/fp16/bf16 for a {key_cache.dtype} cache"
            )
    elif t.dtype != key_cache.dtype:
        raise ValueError(f"{name} dtype {t.dtype} != key_cache dtype {key_cache.dtype}")


def check_query(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    check_rank("query", query, 3)
    check_device("query", query, key_cache.device)
    check_activation_dtype("query", query, key_cache)
    num_kv_heads, head_dim = key_cache.shape[2], cache_head_dim(key_cache)
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


def check_block_ids(name: str, ids: torch.Tensor, rank: int, num_blocks: int) -> None:
    """``ids``: int32/int64 of ``rank`` dimensions, every entry in ``[0, num_blocks)``."""
    check_index(name, ids, rank)
    if ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
    if low < 0 or high >= num_blocks:
        flat = ids.reshape(-1)
        i = int(((flat < 0) | (flat >= num_blocks)).nonzero()[0])
        raise ValueError(
            f"{name}[{i}] = {int(flat[i])} is outside the cache's blocks [0, {num_blocks})"
        )


# ------------------------------------------------------------------ index values
def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot of the 1-D ``slot_mapping`` is ``< num_slots`` (``num_blocks *
    block_size``); negative slots are padding (not stored) and allowed.

    Raises:
        ValueError: naming the first slot at the maximum and its value.
    """
    if slot_mapping.numel() == 0:
        return
    high = int(slot_mapping.max())
    if high >= num_slots:
        i = int(slot_mapping.argmax())
        raise ValueError(
            f"slot_mapping[{i}] = {high} is beyond the cache's {num_slots} slots "
            "(num_blocks * block_size)"
        )


def check_positions(positions: torch.Tensor, max_positions: int, num_tokens: int) -> None:
    """``positions`` is int32/int64 ``[num_tokens]`` with every entry in ``[0,
    max_positions)`` (the rotary table's rows, which the fused CPU kernels read without
    checks).

    Raises:
        ValueError: a bad rank, dtype or length, or naming the first bad position and its
            value.
    """
    check_index("positions", positions, 1)
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    low, high = (int(v) for v in torch.stack(torch.aminmax(positions)).tolist())
    if low < 0 or high >= max_positions:
        i = int(((positions < 0) | (positions >= max_positions)).nonzero()[0])
        raise ValueError(f"positions[{i}] = {int(positions[i])} is outside [0, {max_positions})")


def check_table_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """The block table entries that attention reads are ids of the cache.

    Sequence ``s`` reads ``block_tables[s, j // block_size]`` for every key ``j <
    seq_lens[s]``: those entries must be in ``[0, num_blocks)`` (the rest of the row is
    padding and is not checked), and the row must be wide enough.

    Args:
        block_tables: int32/int64 ``[num_seqs, max_blocks]``.
        seq_lens: int32/int64 ``[num_seqs]``, keys of each sequence.
        num_blocks, block_size: the cache's geometry.

    Raises:
        ValueError: a negative ``seq_lens`` entry, a sequence needing more blocks than the
            table has columns, or a used entry outside ``[0, num_blocks)`` (named as
            ``block_tables[s, j]`` with its value).
    """
    if seq_lens.numel() == 0:
        return
    lens = seq_lens.to(torch.int64)
    low, high = (int(v) for v in torch.stack(torch.aminmax(lens)).tolist())
    if low < 0:
        i = int((lens < 0).nonzero()[0])
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} is negative")
    width = block_tables.shape[1]
    most = -(-high // block_size)
    if most > width:
        i = int(lens.argmax())
        raise ValueError(
            f"seq_lens[{i}] = {high} needs {most} blocks of {block_size} but block_tables "
            f"has {width} columns"
        )
    if most == 0:
        return
    needed = (lens + (block_size - 1)) // block_size
    used = torch.arange(most, device=lens.device)[None, :] < needed[:, None]
    ids = torch.where(used, block_tables[:, :most], 0)
    low, high = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
    if low < 0 or high >= num_blocks:
        s, j = (int(v) for v in ((ids < 0) | (ids >= num_blocks)).nonzero()[0])
        raise ValueError(
            f"block_tables[{s}, {j}] = {int(ids[s, j])} is outside the cache's blocks "
            f"[0, {num_blocks}) (seq_lens[{s}] = {int(lens[s])} reads {int(needed[s])} blocks)"
        )


def check_query_starts(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_rows: int) -> None:
    """``cu_seqlens_q`` splits the ``num_rows`` query rows into the sequences' chunks.

    It must start at 0, never decrease, end at ``num_rows``, and give each sequence a chunk
    no longer than its ``seq_lens`` entry (the chunk is the last keys of the sequence).

    Args:
        cu_seqlens_q: int32/int64 ``[num_seqs + 1]``.
        seq_lens: int32/int64 ``[num_seqs]``.
        num_rows: query rows of the call (``query.shape[0]``).

    Raises:
        ValueError: naming the bad entry and its value.
    """
    cu = cu_seqlens_q.to(torch.int64)
    if cu.shape[0] == 1:
        first = last = int(cu[0])
        shortest = excess = 0
    else:
        q_lens = cu[1:] - cu[:-1]
        stats = torch.stack(
            (cu[0], cu[-1], q_lens.min(), (q_lens - seq_lens.to(torch.int64)).max())
        )
        first, last, shortest, excess = (int(v) for v in stats.tolist())
    if first != 0:
        raise ValueError(f"cu_seqlens_q[0] = {first}, must be 0")
    if shortest < 0:
        s = int((cu[1:] < cu[:-1]).nonzero()[0])
        raise ValueError(
            f"cu_seqlens_q decreases: cu_seqlens_q[{s + 1}] = {int(cu[s + 1])} < "
            f"cu_seqlens_q[{s}] = {int(cu[s])}"
        )
    if last != num_rows:
        raise ValueError(f"cu_seqlens_q[{cu.shape[0] - 1}] = {last} != the {num_rows} query rows")
    if excess > 0:
        lens = seq_lens.to(torch.int64)
        s = int(((cu[1:] - cu[:-1]) > lens).nonzero()[0])
        raise ValueError(
            f"cu_seqlens_q gives sequence {s} a chunk of {int(cu[s + 1] - cu[s])} rows but "
            f"seq_lens[{s}] = {int(lens[s])}"
        )


@dataclass(frozen=True, eq=False)
class CheckedIndices:
    """A step's index tensors whose values :func:`check_indices` validated.

    The model passes it to the per-layer kernel calls (``checked=``) so that they skip the
    value checks for these very tensors (compared by identity) on a cache of this
    geometry; any other tensor or cache is checked again. Build it only with
    :func:`check_indices`.

    Attributes:
        slot_mapping, block_tables, seq_lens, cu_seqlens_q: the validated tensors.
        num_blocks, block_size: the cache geometry they were checked against.
        num_tokens: query rows of the step.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_blocks: int
    block_size: int
    num_tokens: int

    def fits(self, key_cache: torch.Tensor) -> bool:
        """Whether ``key_cache`` has the geometry the indices were checked against."""
        return (key_cache.shape[0], key_cache.shape[1]) == (self.num_blocks, self.block_size)


def check_indices(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    num_blocks: int,
    block_size: int,
    num_tokens: int,
) -> CheckedIndices:
    """Validate a whole step's attention indices once (ranks, dtypes, lengths, values).

    Args:
        slot_mapping: int32/int64 ``[num_tokens]``, ``< num_blocks * block_size`` or
            negative (padding).
        block_tables: int32/int64 ``[num_seqs, max_blocks]`` (see :func:`check_table_values`).
        seq_lens: int32/int64 ``[num_seqs]``.
        cu_seqlens_q: int32/int64 ``[num_seqs + 1]`` (see :func:`check_query_starts`).
        num_blocks, block_size: the KV caches' geometry.
        num_tokens: query rows of the step.

    Returns:
        The :class:`CheckedIndices` of these tensors.

    Raises:
        ValueError: naming the bad argument (and entry).
    """
    check_index("slot_mapping", slot_mapping, 1)
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    check_tables(block_tables, seq_lens, num_seqs, cu_seqlens_q.device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    check_slot_values(slot_mapping, num_blocks * block_size)
    check_query_starts(cu_seqlens_q, seq_lens, num_tokens)
    check_table_values(block_tables, seq_lens, num_blocks, block_size)
    return CheckedIndices(
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, num_blocks, block_size, num_tokens
    )


# ------------------------------------------------------------------ packed GEMM
def check_linear_weight(weight: torch.Tensor) -> None:
    """A weight :func:`~pagedserve.kernels.cpu_native.pack_linear_weight` can pack: 2-D
    fp32 on CPU."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"weight must be a 2-D fp32 CPU tensor, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )


def check_packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    panel_width: int,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.cpu_native.linear_packed`: ``x`` 2-D fp32
    ``[M, K]``, ``packed`` holding ``ceil(out_features / panel_width) * K * panel_width``
    floats, ``bias`` contiguous ``[out_features]`` or ``None``."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be 2-D fp32 [M, K], got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    if packed.numel() != -(-out_features // panel_width) * k * panel_width:
        raise ValueError(f"packed weight does not hold a [{out_features}, {k}] matrix")
    if bias is not None and (bias.numel() != out_features or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{out_features}] tensor")


def check_linear_weight_bf16(weight: torch.Tensor) -> None:
    """A weight :func:`~pagedserve.kernels.cpu_native.pack_bf16_linear_weight` can pack:
    2-D fp32 or bf16 on CPU."""
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 2
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or weight.device.type != "cpu"
    ):
        raise ValueError(
            f"weight must be a 2-D fp32 or bf16 CPU tensor, got {getattr(weight, 'dtype', None)} "
            f"{tuple(getattr(weight, 'shape', ()))} on {getattr(weight, 'device', None)}"
        )


def check_packed_linear_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    panel_width: int,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.cpu_native.linear_packed_bf16`: ``x`` 2-D
    fp32 or bf16 ``[M, K]`` on CPU, ``packed`` a contiguous bf16 CPU tensor of
    ``ceil(out_features / panel_width) * ceil(K / 2) * 2 * panel_width`` values, ``bias``
    contiguous fp32 ``[out_features]`` or ``None``."""
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() != 2
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type != "cpu"
    ):
        raise ValueError(
            f"x must be a 2-D fp32 or bf16 CPU tensor [M, K], got "
            f"{getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
        )
    if out_features < 1:
        raise ValueError(f"out_features must be >= 1, got {out_features}")
    if (
        not isinstance(packed, torch.Tensor)
        or packed.dtype != torch.bfloat16
        or packed.device.type != "cpu"
        or not packed.is_contiguous()
    ):
        raise ValueError("packed must be a contiguous bf16 CPU tensor from pack_bf16_linear_weight")
    packed_numel = -(-out_features // panel_width) * -(-x.shape[1] // 2) * 2 * panel_width
    if packed.numel() != packed_numel:
        raise ValueError(
            f"packed weight ({packed.numel()} values) does not hold a "
            f"[{out_features}, {x.shape[1]}] matrix ({packed_numel})"
        )
    if bias is not None and (
        bias.dtype != torch.float32
        or bias.device.type != "cpu"
        or bias.numel() != out_features
        or not bias.is_contiguous()
    ):
        raise ValueError(f"bias must be a contiguous fp32 CPU [{out_features}] tensor")


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
    checked: CheckedIndices | None = None,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.store_kv_cache`; the slot values unless
    ``checked`` holds this ``slot_mapping`` for this cache."""
    check_caches(key_cache, value_cache)
    check_rank("key", key, 3)
    check_rank("value", value, 3)
    heads = (key_cache.shape[2], cache_head_dim(key_cache))
    if tuple(key.shape[1:]) != heads:
        raise ValueError(
            f"key shape {tuple(key.shape)} does not match key_cache "
            f"(num_kv_heads, head_dim) = {heads}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value)):
        check_activation_dtype(name, t, key_cache)
        check_device(name, t, key_cache.device)
    check_index("slot_mapping", slot_mapping, 1)
    check_device("slot_mapping", slot_mapping, key_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries, key has {key.shape[0]} tokens"
        )
    if not (
        checked is not None and checked.slot_mapping is slot_mapping and checked.fits(key_cache)
    ):
        check_slot_values(slot_mapping, key_cache.shape[0] * key_cache.shape[1])


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    checked: CheckedIndices | None = None,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.paged_decode_attention`; the block-table
    values unless ``checked`` holds these ``block_tables`` and ``seq_lens`` for this
    cache."""
    check_caches(key_cache, value_cache)
    check_query(query, key_cache)
    check_tables(block_tables, seq_lens, query.shape[0], key_cache.device)
    if not (
        checked is not None
        and checked.block_tables is block_tables
        and checked.seq_lens is seq_lens
        and checked.fits(key_cache)
    ):
        check_table_values(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])


def check_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    checked: CheckedIndices | None = None,
) -> None:
    """Arguments of :func:`~pagedserve.kernels.paged_prefill_attention`; the values of
    ``cu_seqlens_q`` and the block tables unless ``checked`` holds these tensors for this
    cache and query."""
    check_caches(key_cache, value_cache)
    check_query(query, key_cache)
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    check_device("cu_seqlens_q", cu_seqlens_q, key_cache.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    check_tables(block_tables, seq_lens, num_seqs, key_cache.device)
    if not (
        checked is not None
        and checked.cu_seqlens_q is cu_seqlens_q
        and checked.block_tables is block_tables
        and checked.seq_lens is seq_lens
        and checked.num_tokens == query.shape[0]
        and checked.fits(key_cache)
    ):
        check_query_starts(cu_seqlens_q, seq_lens, query.shape[0])
        check_table_values(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])


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
    check_block_ids("block_ids", block_ids, 1, key_caches[0].shape[0])
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
    check_block_ids("block_ids", block_ids, 1, key_caches[0].shape[0])
    check_device("block_ids", block_ids, key_caches[0].device)
    check_rank("packed", packed, 6)
    expected = packed_shape(key_caches, block_ids.shape[0])
    if tuple(packed.shape) != expected:
        raise ValueError(f"packed shape {tuple(packed.shape)} != expected {expected}")
    if packed.dtype != key_caches[0].dtype:
        raise ValueError(f"packed dtype {packed.dtype} != cache dtype {key_caches[0].dtype}")
