"""The torch reference (the CPU serving path) against dense contiguous attention."""

from __future__ import annotations

import pytest
import torch
from paged_kv_testlib import (
    cu_seqlens,
    dense_decode,
    dense_prefill,
    edge_lengths,
    make_paged_case,
)

from pagedserve import kernels

# (num_kv_heads, GQA ratio): ratios 1, 3, 4, 8; the last two take the decode path for
# more than 4 KV heads (transposed K/V instead of the block-diagonal GEMM).
HEADS = [(2, 1), (3, 3), (1, 4), (2, 8), (8, 1), (6, 3)]


@pytest.mark.parametrize("num_kv_heads,ratio", HEADS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_matches_dense(num_kv_heads, ratio, head_dim, block_size):
    lens = edge_lengths(block_size, long=3 * block_size + 7)
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, seed=block_size)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim)
    scale = head_dim**-0.5
    out = kernels.paged_decode_attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        scale,
        backend="torch",
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), dense_decode(case, query, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_heads,ratio", HEADS)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_mixed_batch_matches_dense(num_kv_heads, ratio, head_dim, block_size):
    # Full prefill, chunk over a cached prefix, two decodes, a chunk ending on a block edge.
    lens = [block_size + 5, 3 * block_size + 2, 7, 40, 2 * block_size]
    q_lens = [block_size + 5, block_size + 1, 1, 1, block_size]
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, seed=3)
    query = torch.randn(sum(q_lens), num_kv_heads * ratio, head_dim)
    scale = head_dim**-0.5
    out = kernels.paged_prefill_attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        cu_seqlens(q_lens),
        case.seq_lens,
        scale,
        backend="torch",
    )
    expected = dense_prefill(case, query, q_lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_of_decodes_equals_decode():
    lens = [1, 17, 33]
    case = make_paged_case(lens, 2, 64, 16)
    query = torch.randn(3, 6, 64)
    args = (case.key_cache, case.value_cache, case.block_tables)
    dec = kernels.paged_decode_attention(query, *args, case.seq_lens, 0.125, backend="torch")
    pre = kernels.paged_prefill_attention(
        query, *args, cu_seqlens([1, 1, 1]), case.seq_lens, 0.125, backend="torch"
    )
    torch.testing.assert_close(pre, dec, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_decode_and_prefill(dtype, atol):
    lens, q_lens = [5, 33, 16], [5, 1, 4]
    case = make_paged_case(lens, 2, 64, 16, dtype=dtype)
    query = torch.randn(len(lens), 8, 64).to(dtype)
    args = (case.key_cache, case.value_cache, case.block_tables)
    out = kernels.paged_decode_attention(query, *args, case.seq_lens, 0.125, backend="torch")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_decode(case, query, 0.125), atol=atol, rtol=0)
    query = torch.randn(sum(q_lens), 8, 64).to(dtype)
    out = kernels.paged_prefill_attention(
        query, *args, cu_seqlens(q_lens), case.seq_lens, 0.125, backend="torch"
    )
    expected = dense_prefill(case, query, q_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


def test_decode_zero_length_sequence_gives_zeros():
    case = make_paged_case([0, 5], 1, 64, 16)
    query = torch.randn(2, 2, 64)
    out = kernels.paged_decode_attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        0.125,
        backend="torch",
    )
    assert torch.equal(out[0], torch.zeros(2, 64))
    assert torch.isfinite(out).all()


def test_empty_batches():
    case = make_paged_case([4], 1, 64, 16)
    args = (case.key_cache, case.value_cache)
    q = torch.empty(0, 2, 64)
    tables = torch.empty(0, 1, dtype=torch.int32)
    lens = torch.empty(0, dtype=torch.int32)
    assert kernels.paged_decode_attention(q, *args, tables, lens, 1.0).shape == (0, 2, 64)
    cu = torch.zeros(1, dtype=torch.int32)
    assert kernels.paged_prefill_attention(q, *args, tables, cu, lens, 1.0).shape == (0, 2, 64)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_cache_writes_slots_and_skips_padding(slot_dtype):
    kc = torch.zeros(6, 4, 2, 8)
    vc = torch.zeros_like(kc)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, -1, 7, 23, -1], dtype=slot_dtype)
    kernels.store_kv_cache(key, value, kc, vc, slots, backend="torch")
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc[slot // 4, slot % 4], key[t])
            assert torch.equal(vc[slot // 4, slot % 4], value[t])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3  # exactly three slots written


def test_copy_blocks_and_swap_roundtrip():
    layers = 3
    kcs = [torch.randn(8, 4, 2, 16) for _ in range(layers)]
    vcs = [torch.randn(8, 4, 2, 16) for _ in range(layers)]
    before_k = [k.clone() for k in kcs]
    kernels.copy_blocks(kcs, vcs, torch.tensor([[1, 5], [2, 6]]), backend="torch")
    for k, k0 in zip(kcs, before_k):
        assert torch.equal(k[5], k0[1]) and torch.equal(k[6], k0[2])
        assert torch.equal(k[[0, 1, 2, 3, 4, 7]], k0[[0, 1, 2, 3, 4, 7]])

    ids = torch.tensor([7, 0, 3])
    packed = kernels.gather_blocks(kcs, vcs, ids)
    assert packed.shape == (3, layers, 2, 4, 2, 16) and packed.is_contiguous()
    assert torch.equal(packed[0, 1, 0], kcs[1][7]) and torch.equal(packed[2, 2, 1], vcs[2][3])
    host = torch.empty_like(packed)
    assert kernels.gather_blocks(kcs, vcs, ids, out=host) is host
    assert torch.equal(host, packed)

    new_k = [torch.zeros_like(k) for k in kcs]
    new_v = [torch.zeros_like(v) for v in vcs]
    kernels.scatter_blocks(new_k, new_v, torch.tensor([1, 2, 4]), packed)
    for layer in range(layers):
        assert torch.equal(new_k[layer][[1, 2, 4]], kcs[layer][ids])
        assert torch.equal(new_v[layer][[1, 2, 4]], vcs[layer][ids])
        assert not new_k[layer][[0, 3, 5, 6, 7]].any()


def test_int64_slot_arithmetic_beyond_int32_elements():
    """A pool with more than 2**31 elements (virtual memory only: torch.empty does not
    touch pages, and the ops below touch just the blocks they address)."""
    block_size, heads, dim = 16, 1, 64
    num_blocks = (2**31) // (block_size * heads * dim) + 4
    try:
        kc = torch.empty(num_blocks, block_size, heads, dim, dtype=torch.float16)
        vc = torch.empty_like(kc)
    except RuntimeError:
        pytest.skip("cannot reserve a 4 GiB virtual pool here")
    last = num_blocks - 1
    slots = torch.tensor([last * block_size + 3, 5], dtype=torch.int64)
    key = torch.randn(2, heads, dim).half()
    kernels.store_kv_cache(key, key, kc, vc, slots, backend="torch")
    assert torch.equal(kc[last, 3], key[0]) and torch.equal(kc[0, 5], key[1])
