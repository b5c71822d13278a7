"""Builders for paged-KV test cases and a dense (contiguous) attention oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """A batch of sequences laid out in a paged cache with shuffled physical blocks."""

    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], contiguous truth
    values: list[torch.Tensor]


def make_paged_case(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    table_slack: int = 1,
) -> PagedCase:
    """Random K/V for each sequence written straight into shuffled physical blocks.

    Unwritten slots hold NaN, so any kernel that lets a masked-out slot leak into the
    result fails loudly. Unused block-table entries point at a NaN-filled spare block.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])
    width = max([*blocks_per_seq, 1]) + table_slack
    tables = torch.full((len(seq_lens), width), spare, dtype=torch.int32)
    keys, values = [], []
    used = 0
    for s, n in enumerate(seq_lens):
        ids = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        tables[s, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        blocks = ids[pos // block_size] if n else pos
        key_cache[blocks, pos % block_size] = k
        value_cache[blocks, pos % block_size] = v
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedCase(
        key_cache.to(device),
        value_cache.to(device),
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys,
        values,
    )


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain softmax attention in float64 over contiguous K/V with a causal mask.

    query ``[T, H, D]``, keys/values ``[L, Hkv, D]``; query ``t`` sees keys at positions
    ``<= query_positions[t]``. KV heads are repeated (HF ``repeat_kv`` convention).
    """
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", query.double(), k) * scale
    future = torch.arange(k.shape[0], device=k.device)[None, :] > query_positions[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), v)


def dense_decode(case: PagedCase, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Oracle for paged decode: each sequence's last token attends to its whole context."""
    outs = []
    for s, (k, v) in enumerate(zip(case.keys, case.values)):
        n = k.shape[0]
        pos = torch.tensor([n - 1], device=k.device)
        outs.append(dense_attention(query[s : s + 1], k, v, pos, scale))
    return torch.cat(outs)


def dense_prefill(
    case: PagedCase, query: torch.Tensor, q_lens: list[int], scale: float
) -> torch.Tensor:
    """Oracle for paged prefill: chunk ``s`` holds the last ``q_lens[s]`` positions."""
    outs = []
    start = 0
    for k, v, q_len in zip(case.keys, case.values, q_lens):
        n = k.shape[0]
        pos = torch.arange(n - q_len, n, device=k.device)
        outs.append(dense_attention(query[start : start + q_len], k, v, pos, scale))
        start += q_len
    return torch.cat(outs)


def cu_seqlens(q_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 prefix sums ``[0, q0, q0+q1, ...]``."""
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def edge_lengths(block_size: int, long: int) -> list[int]:
    """1, block_size-1, block_size, block_size+1 and ``long`` (deduplicated, all >= 1)."""
    lens = [1, block_size - 1, block_size, block_size + 1, long]
    return sorted({n for n in lens if n >= 1})
