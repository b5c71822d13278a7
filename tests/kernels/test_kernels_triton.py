"""Triton kernels against the torch reference and the dense oracle.

Without a GPU these run under TRITON_INTERPRET=1 (set in conftest.py), so the shapes are
kept tiny; on a CUDA machine the same tests run the compiled kernels.
"""

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
from pagedserve.kernels import reference

pytest.importorskip("triton")

from pagedserve.kernels import decode_triton, prefill_triton

RATIOS = [1, 3, 4, 8]
HALF = [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)]


def _decode(case, query, scale, **kw):
    return decode_triton.paged_decode_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale, **kw
    )


def _prefill(case, query, q_lens, scale, **kw):
    cu = cu_seqlens(q_lens, query.device)
    return prefill_triton.paged_prefill_attention(
        query, case.key_cache, case.value_cache, case.block_tables, cu, case.seq_lens, scale, **kw
    )


# ----------------------------------------------------------------------------- store
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(2, 80), (3, 64)])
def test_store_matches_reference(device, dtype, heads, dim):
    kc = torch.zeros(5, 16, heads, dim, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    # K and V as strided views into one fused projection output.
    fused = torch.randn(6, 2 * heads * dim + 8, device=device).to(dtype)
    key = fused[:, : heads * dim].view(6, heads, dim)
    value = fused[:, heads * dim : 2 * heads * dim].view(6, heads, dim)
    slots = torch.tensor([79, -1, 0, 17, 16, -1], device=device)
    kc2, vc2 = kc.clone(), vc.clone()
    kernels.store_kv_cache(key, value, kc, vc, slots, backend="triton")
    reference.store_kv_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(kc[4, 15], key[0])


def test_store_small_tiles_cover_the_row(device):
    from pagedserve.kernels import store_triton

    kc = torch.zeros(2, 4, 3, 80, device=device)
    vc = torch.zeros_like(kc)
    key, value = torch.randn(3, 3, 80, device=device), torch.randn(3, 3, 80, device=device)
    store_triton.store_kv_cache(key, value, kc, vc, torch.tensor([1, 6, 2], device=device), tile=64)
    assert torch.equal(kc[0, 1], key[0]) and torch.equal(vc[1, 2], value[1])


# ---------------------------------------------------------------------------- decode
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_matches_reference_and_dense(device, ratio, head_dim, block_size):
    num_kv_heads = 2 if ratio < 8 else 1
    lens = edge_lengths(block_size, long=2 * block_size + 19)
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, device=device)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim, device=device)
    scale = head_dim**-0.5
    # Alternate between the single-split (direct) path and the split + merge path.
    splits = None if (head_dim + block_size) % 2 else 3
    out = _decode(case, query, scale, num_splits=splits, block_n=16)
    ref = reference.paged_decode_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), dense_decode(case, query, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", HALF)
def test_decode_half_precision(device, dtype, atol):
    case = make_paged_case([3, 40, 17], 2, 128, 16, dtype=dtype, device=device)
    query = torch.randn(3, 8, 128, device=device).to(dtype)
    out = _decode(case, query, 128**-0.5, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.double(), dense_decode(case, query, 128**-0.5), atol=atol, rtol=0
    )


def test_decode_split_heuristic_workspace_and_public_api(device):
    case = make_paged_case([70, 5, 1], 1, 64, 8, device=device, table_slack=6)
    query = torch.randn(3, 3, 64, device=device)
    ref = dense_decode(case, query, 0.125)
    splits, per_split = decode_triton.choose_num_splits(3, 1, 70, 16, 4, 64)
    assert splits > 1 and per_split % 16 == 0 and splits * per_split >= 70
    ws = kernels.DecodeWorkspace(4, 3, 64, max_splits=8, device=device)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    for kw in ({}, {"max_seq_len": 70}, {"workspace": ws}, {"workspace": ws, "max_seq_len": 70}):
        out = kernels.paged_decode_attention(*args, backend="triton", **kw)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out = decode_triton.paged_decode_attention(*args, workspace=ws, num_splits=5, block_n=16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_zero_length_and_empty_splits_are_finite(device):
    case = make_paged_case([0, 50, 2], 1, 64, 16, device=device)
    query = torch.randn(3, 2, 64, device=device)
    out = _decode(case, query, 0.125, num_splits=4, block_n=16)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(
        out[1:].double(), dense_decode(case, query, 0.125)[1:], atol=1e-5, rtol=1e-5
    )


# --------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_mixed_batch_matches_dense(device, ratio, head_dim, block_size):
    num_kv_heads = 2 if ratio < 8 else 1
    # Fresh prefill, chunk after a cached prefix, decodes, chunk ending on a block edge.
    lens = [block_size + 1, 2 * block_size + 9, 1, block_size - 1 or 1, 2 * block_size]
    q_lens = [block_size + 1, 6, 1, 1, block_size]
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, device=device)
    query = torch.randn(sum(q_lens), num_kv_heads * ratio, head_dim, device=device)
    scale = head_dim**-0.5
    # Small tiles: several query tiles per chunk and several key tiles per program.
    out = _prefill(case, query, q_lens, scale, block_m=16, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out.double(), dense_prefill(case, query, q_lens, scale), atol=1e-5, rtol=1e-5
    )


def test_prefill_default_tiles_and_public_api(device):
    lens, q_lens = [45, 3, 20], [45, 1, 0]
    case = make_paged_case(lens, 3, 80, 16, device=device)
    query = torch.randn(sum(q_lens), 9, 80, device=device)
    cu = cu_seqlens(q_lens, device)
    args = (query, case.key_cache, case.value_cache, case.block_tables, cu, case.seq_lens, 0.1)
    out = kernels.paged_prefill_attention(*args, backend="triton")
    ref = kernels.paged_prefill_attention(*args, backend="torch")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out2 = kernels.paged_prefill_attention(*args, backend="triton", max_query_len=45)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype,atol", HALF)
def test_prefill_half_precision(device, dtype, atol):
    lens, q_lens = [40, 9], [24, 1]
    case = make_paged_case(lens, 1, 64, 16, dtype=dtype, device=device)
    query = torch.randn(sum(q_lens), 4, 64, device=device).to(dtype)
    out = _prefill(case, query, q_lens, 0.125, block_m=16, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.double(), dense_prefill(case, query, q_lens, 0.125), atol=atol, rtol=0
    )


# ---------------------------------------------------------------------- copy blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference(device, dtype):
    kcs = [torch.randn(6, 4, 2, 80, device=device).to(dtype) for _ in range(3)]
    vcs = [torch.randn(6, 4, 2, 80, device=device).to(dtype) for _ in range(3)]
    kcs2, vcs2 = [k.clone() for k in kcs], [v.clone() for v in vcs]
    mapping = torch.tensor([[0, 3], [5, 1], [0, 4]], device=device)
    kernels.copy_blocks(kcs, vcs, mapping, backend="triton")
    reference.copy_blocks(kcs2, vcs2, mapping)
    for a, b in zip(kcs + vcs, kcs2 + vcs2):
        assert torch.equal(a, b)
    kernels.copy_blocks(
        kcs, vcs, torch.empty(0, 2, dtype=torch.int64, device=device), backend="triton"
    )


# ----------------------------------------------------------------------- int64 pool
def test_kernels_address_a_pool_beyond_int32_offsets(device):
    """Every Triton kernel on a pool of more than 2**31 elements.

    Blocks at the top of the pool sit at element offsets above 2**31, which int32 address
    arithmetic would wrap (and fault on). The pool is only reserved as virtual memory:
    torch.empty does not touch its pages and the kernels touch only the blocks they use.
    """
    block_size, heads, dim = 16, 1, 64
    num_blocks = (2**31) // (block_size * heads * dim) + 4
    try:
        kc = torch.empty(num_blocks, block_size, heads, dim, dtype=torch.float16, device=device)
        vc = torch.empty_like(kc)
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve a 2 x 4 GiB pool here")
    top = [num_blocks - 1, num_blocks - 3]  # physical blocks of the sequence, in order
    seq_len = block_size + 5
    key = torch.randn(seq_len, heads, dim, device=device).half()
    value = torch.randn(seq_len, heads, dim, device=device).half()
    pos = torch.arange(seq_len, device=device)
    table = torch.tensor([top], dtype=torch.int32, device=device)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    kernels.store_kv_cache(key, value, kc, vc, slots, backend="triton")
    assert torch.equal(kc[top[1], 4], key[block_size + 4])

    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    query = torch.randn(1, 2, dim, device=device).half()
    args = (kc, vc, table, lens, 0.125)
    ref = reference.paged_decode_attention(query, *args)
    for splits in (1, 2):
        out = decode_triton.paged_decode_attention(query, *args, num_splits=splits, block_n=16)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    query = torch.randn(4, 2, dim, device=device).half()
    pargs = (query, kc, vc, table, cu, lens, 0.125)
    torch.testing.assert_close(
        prefill_triton.paged_prefill_attention(*pargs, block_m=16, block_n=16),
        reference.paged_prefill_attention(*pargs),
        atol=2e-3,
        rtol=0,
    )
    mapping = torch.tensor([[top[0], num_blocks - 2]], device=device)
    kernels.copy_blocks([kc], [vc], mapping, backend="triton")
    assert torch.equal(kc[num_blocks - 2], kc[top[0]])
    assert torch.equal(vc[num_blocks - 2], vc[top[0]])


def test_block_size_128(device):
    lens = [1, 127, 128, 129, 300]
    case = make_paged_case(lens, 2, 64, 128, device=device)
    query = torch.randn(len(lens), 6, 64, device=device)
    out = _decode(case, query, 0.125, num_splits=2)
    torch.testing.assert_close(out.double(), dense_decode(case, query, 0.125), atol=1e-5, rtol=1e-5)
    q_lens = [1, 3, 1, 129, 20]
    query = torch.randn(sum(q_lens), 6, 64, device=device)
    out = _prefill(case, query, q_lens, 0.125)
    expected = dense_prefill(case, query, q_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- strided queries
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_permuted_query_gives_the_same_output(device, backend):
    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 2, 16)  # num_blocks, block_size, kv_heads, head_dim
    k = torch.randn(shape, generator=g).to(device)
    v = torch.randn(shape, generator=g).to(device)
    q = torch.randn(2, 16, 4, device=device)  # [num_seqs, head_dim, num_heads]
    query = q.permute(0, 2, 1)  # [num_seqs, num_heads, head_dim], not contiguous
    assert not query.is_contiguous()
    tables = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32, device=device)
    out = kernels.paged_decode_attention(query, k, v, tables, seq_lens, 0.25, backend=backend)
    ref = kernels.paged_decode_attention(
        query.contiguous(), k, v, tables, seq_lens, 0.25, backend="torch"
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    out = kernels.paged_prefill_attention(query, k, v, tables, cu, seq_lens, 0.25, backend)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
