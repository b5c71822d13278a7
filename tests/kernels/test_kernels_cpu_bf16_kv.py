"""The CPU kernels on bf16 KV caches (``paged_attention_bf16kv``, ``rope_store_bf16kv``):
fp32 queries, scores, softmax and sums over K/V widened from bf16.

Widening bf16 to fp32 is exact, so the bf16 kernel must give the fp32 kernel's bits on the
same cache upcast to fp32, and the torch reference's result on that upcast cache."""

from __future__ import annotations

import pytest
import torch
from paged_kv_testlib import cu_seqlens, dense_prefill, make_paged_case

from pagedserve import kernels
from pagedserve.kernels import cpu_native
from pagedserve.worker.layers import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="no C compiler: the CPU kernels cannot be built"
)


def bf16_case(lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    """A paged case whose caches are bf16 (unwritten slots NaN, as in make_paged_case)."""
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=seed)
    assert case.key_cache.dtype == torch.bfloat16
    return case


def attend(query, key_cache, value_cache, case, q_lens: list[int], scale: float):
    # amx_min_rows=0: the fp32-arithmetic kernel for every chunk (the AMX prefill path
    # rounds queries and probabilities to bf16: test_kernels_cpu_amx_attention.py)
    return cpu_native.paged_attention(
        query, key_cache, value_cache, case.block_tables, cu_seqlens(q_lens), case.seq_lens,
        scale, amx_min_rows=0,
    )  # fmt: skip


@pytest.mark.parametrize("num_kv_heads,ratio", [(2, 3), (1, 8), (4, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_equals_fp32_kernel_and_reference_on_the_upcast_cache(
    num_kv_heads, ratio, head_dim, block_size
):
    lens = [1, block_size + 1, 37, 5 * block_size + 7, 200]
    case = bf16_case(lens, num_kv_heads, head_dim, block_size, seed=head_dim + block_size)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim)
    scale = head_dim**-0.5
    out = attend(query, case.key_cache, case.value_cache, case, [1] * len(lens), scale)
    assert out.dtype == torch.float32 and not out.isnan().any()
    k32, v32 = case.key_cache.float(), case.value_cache.float()
    assert torch.equal(out, attend(query, k32, v32, case, [1] * len(lens), scale))
    ref = kernels.paged_decode_attention(
        query, k32, v32, case.block_tables, case.seq_lens, scale, backend="torch"
    )
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    # Not the fp32 answer: the cache really is read as bf16.
    exact = make_paged_case(lens, num_kv_heads, head_dim, block_size, seed=head_dim + block_size)
    fp32_out = attend(query, exact.key_cache, exact.value_cache, exact, [1] * len(lens), scale)
    assert not torch.equal(out, fp32_out)


@pytest.mark.parametrize("num_kv_heads,ratio,head_dim", [(2, 3, 64), (1, 4, 80), (3, 2, 40)])
def test_chunked_prefill_of_uneven_sequences(num_kv_heads, ratio, head_dim):
    # Full prefills (one over a 16-row query tile), chunks over cached prefixes, decodes.
    lens = [21, 50, 7, 40, 32, 37, 3]
    q_lens = [21, 17, 1, 1, 16, 37, 2]
    case = bf16_case(lens, num_kv_heads, head_dim, 16, seed=7)
    query = torch.randn(sum(q_lens), num_kv_heads * ratio, head_dim)
    out = attend(query, case.key_cache, case.value_cache, case, q_lens, 0.125)
    k32, v32 = case.key_cache.float(), case.value_cache.float()
    assert torch.equal(out, attend(query, k32, v32, case, q_lens, 0.125))
    ref = kernels.paged_prefill_attention(
        query, k32, v32, case.block_tables, cu_seqlens(q_lens), case.seq_lens, 0.125,
        backend="torch",
    )  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(
        out.double(), dense_prefill(case, query, q_lens, 0.125), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_store_writes_the_rounded_rows_into_their_slots_only(head_dim):
    heads, kv_heads, tokens = 6, 2, 13
    rope = RotaryEmbedding(head_dim, 128, {"rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    before = qkv.clone()
    slots = torch.randperm(6 * 8, generator=gen)[:tokens]
    slots[5] = -1  # padding: not stored
    shape = (6, 8, kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(torch.bfloat16)
    vc = torch.randn(shape, generator=gen).to(torch.bfloat16)
    kc_before, vc_before = kc.clone(), vc.clone()
    cpu_native.rope_store(qkv, heads, kv_heads, head_dim, rope.cos_table, rope.sin_table,
                          positions, slots, kc, vc)  # fmt: skip
    # qkv is rotated in fp32 exactly as the fp32 kernel rotates it.
    fp32_qkv = before.clone()
    cpu_native.rope_store(fp32_qkv, heads, kv_heads, head_dim, rope.cos_table, rope.sin_table,
                          positions, slots, torch.zeros(shape), torch.zeros(shape))  # fmt: skip
    assert torch.equal(qkv, fp32_qkv)
    cos, sin = rope(positions, torch.float32)
    k_start, v_start = heads * head_dim, (heads + kv_heads) * head_dim
    k = apply_rotary(before[:, k_start:v_start].view(tokens, kv_heads, head_dim), cos, sin)
    v = before[:, v_start:].view(tokens, kv_heads, head_dim)
    stored = slots >= 0
    flat_k, flat_v = kc.view(-1, kv_heads, head_dim), vc.view(-1, kv_heads, head_dim)
    # The bits of torch's round-to-nearest-even .to(bfloat16), compared as integers.
    want_k = k[stored].to(torch.bfloat16).view(torch.int16)
    want_v = v[stored].to(torch.bfloat16).view(torch.int16)
    assert torch.equal(flat_k[slots[stored]].view(torch.int16), want_k)
    assert torch.equal(flat_v[slots[stored]].view(torch.int16), want_v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[stored]] = False
    assert torch.equal(flat_k[untouched], kc_before.view(-1, kv_heads, head_dim)[untouched])
    assert torch.equal(flat_v[untouched], vc_before.view(-1, kv_heads, head_dim)[untouched])


def test_rounding_is_to_nearest_even_on_ties():
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one;
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6, rounded up.
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3e38, 0.0])
    kv_heads, head_dim = 1, 8
    qkv = torch.zeros(len(values), 3 * head_dim)
    qkv[:, 2 * head_dim] = values  # V column 0 (V is stored unrotated)
    shape = (1, len(values), kv_heads, head_dim)
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    rope = RotaryEmbedding(head_dim, 8, {"rope_theta": 10000.0})
    cpu_native.rope_store(qkv, 1, kv_heads, head_dim, rope.cos_table, rope.sin_table,
                          torch.zeros(len(values), dtype=torch.int64),
                          torch.arange(len(values)), kc, vc)  # fmt: skip
    got = vc[0, :, 0, 0]
    assert torch.equal(got.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    assert got[0].item() == 1.0 and got[1].item() == 1 + 2**-6


def test_other_cache_dtypes_are_rejected():
    case = make_paged_case([5], 1, 64, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32, bf16, fp8 or int8 KV caches"):
        attend(torch.randn(1, 2, 64), case.key_cache, case.value_cache, case, [1], 0.125)
    with pytest.raises(ValueError, match=r"value_cache torch\.float32"):
        attend(
            torch.randn(1, 2, 64), case.key_cache.bfloat16(), case.value_cache.float(), case,
            [1], 0.125,
        )  # fmt: skip
