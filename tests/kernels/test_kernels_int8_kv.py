"""int8 KV caches with their per-(slot, KV head) scales stored in the block
(:mod:`pagedserve.kernels.int8`): the quantiser, the torch reference store and attention,
the C and Triton stores and attention against them, and the block moves (copy-on-write,
the swap unit) carrying the scales. The Triton kernels run under TRITON_INTERPRET=1 without a
GPU (tests/kernels/conftest.py), so shapes are small.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import cpu_native, int8

needs_c = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the CPU kernels")
I8 = torch.int8


def _cache(num_blocks: int, block_size: int, heads: int, dim: int) -> torch.Tensor:
    return torch.zeros(num_blocks, block_size, heads, dim + 4, dtype=I8)


def test_quantize_is_absmax_over_127_rounded_to_even():
    # absmax 31.75: scale 0.25 exactly, so every quotient below is exact (ties included)
    x = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -2.5, 3.5, 0.0, -127.0]]]) * 0.25
    packed = int8.quantize(x)
    assert packed.shape == (1, 1, 12) and packed.dtype == I8
    scale = int8.scales(packed.view(1, 1, 1, 12))
    assert scale.item() == 0.25
    assert packed[0, 0, :8].tolist() == [127, 0, 2, 2, -2, 4, 0, -127]  # half to even
    assert torch.equal(int8.dequantize(packed), packed[..., :8].float() * 0.25)


def test_quantize_saturates_and_matches_the_fp32_quotient():
    x = torch.randn(16, 3, 8, generator=torch.Generator().manual_seed(2)) * 100
    packed = int8.quantize(x)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(int8.scales(packed.unsqueeze(0))[0], scale[..., 0])
    q = packed[..., :8]
    assert torch.equal(q, (x / scale).round().clamp(-127, 127).to(I8))
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127


def test_quantize_zero_vector_has_zero_scale_and_reads_zero():
    packed = int8.quantize(torch.zeros(2, 3, 8))
    assert torch.equal(packed, torch.zeros(2, 3, 12, dtype=I8))
    assert torch.equal(int8.dequantize(packed), torch.zeros(2, 3, 8))


def test_quantize_error_is_at_most_half_a_step():
    x = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(3)) * 5
    err = (int8.dequantize(int8.quantize(x)) - x).abs()
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool((err <= step * 0.5001).all())


def test_reference_store_round_trip_and_scale_per_slot_head():
    heads, dim = 2, 16
    kc, vc = _cache(4, 4, heads, dim), _cache(4, 4, heads, dim)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(5, heads, dim, generator=gen) * torch.tensor([1.0, 9.0])[None, :, None]
    value = torch.randn(5, heads, dim, generator=gen)
    slots = torch.tensor([6, 1, -1, 15, 8])
    kernels.store_kv_cache(key, value, kc, vc, slots, backend="torch")
    keep = slots >= 0
    s = slots[keep]
    blocks, offsets = s // 4, s % 4
    assert torch.equal(int8.scales(kc)[blocks, offsets], key[keep].abs().amax(-1) / 127)
    assert torch.equal(int8.scales(vc)[blocks, offsets], value[keep].abs().amax(-1) / 127)
    assert torch.equal(kc[blocks, offsets], int8.quantize(key[keep]))
    assert torch.equal(vc[blocks, offsets], int8.quantize(value[keep]))
    # untouched slots stay zero (the skipped token wrote nothing)
    written = torch.zeros(16, dtype=torch.bool)
    written[s] = True
    assert bool((kc.view(16, heads, dim + 4)[~written] == 0).all())


def _int8_case(lens: list[int], heads: int, q_heads: int, dim: int, block_size: int = 8):
    """A filled int8 cache pair, the fp32 caches of its dequantised values, block tables."""
    gen = torch.Generator().manual_seed(7)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    kc, vc = _cache(num_blocks, block_size, heads, dim), _cache(num_blocks, block_size, heads, dim)
    for s, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[s, pos // block_size].long() * block_size + pos % block_size
        key = torch.randn(n, heads, dim, generator=gen) * 4
        value = torch.randn(n, heads, dim, generator=gen)
        kernels.store_kv_cache(key, value, kc, vc, slots, backend="torch")
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (
        kc,
        vc,
        int8.dequantize(kc).contiguous(),
        int8.dequantize(vc).contiguous(),
        tables,
        seq_lens,
    )


@pytest.mark.parametrize("heads,q_heads", [(2, 6), (1, 1)])
def test_reference_attention_reads_the_dequantised_values(heads, q_heads):
    dim = 16
    kc, vc, kf, vf, tables, lens = _int8_case([11, 3, 20], heads, q_heads, dim)
    q = torch.randn(3, q_heads, dim)
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.25, backend="torch")
    want = kernels.paged_decode_attention(q, kf, vf, tables, lens, 0.25, backend="torch")
    assert torch.equal(got, want)
    qp = torch.randn(9, q_heads, dim)
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    got = kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens, 0.25, backend="torch")
    want = kernels.paged_prefill_attention(qp, kf, vf, tables, cu, lens, 0.25, backend="torch")
    assert torch.equal(got, want)


@needs_c
@pytest.mark.parametrize("dim,heads,q_heads", [(64, 2, 6), (128, 3, 3), (32, 1, 4), (20, 2, 4)])
def test_c_attention_int8_is_the_fp32_kernel_on_dequantised_caches(dim, heads, q_heads):
    """The C kernel widens q * scale in registers: the same bits as the fp32 kernel on the
    dequantised caches, for decode and for mixed prefill chunks."""
    kc, vc, kf, vf, tables, lens = _int8_case([37, 5, 70], heads, q_heads, dim)
    q = torch.randn(3, q_heads, dim)
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, backend="cpu")
    want = kernels.paged_decode_attention(q, kf, vf, tables, lens, 0.125, backend="cpu")
    assert torch.equal(got, want)
    ref = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, backend="torch")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    qp = torch.randn(26, q_heads, dim)
    cu = torch.tensor([0, 20, 21, 26], dtype=torch.int32)
    got = kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens, 0.125, backend="cpu")
    want = kernels.paged_prefill_attention(qp, kf, vf, tables, cu, lens, 0.125, backend="cpu")
    assert torch.equal(got, want)
    ref = kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens, 0.125, backend="torch")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("dim", [64, 20])
def test_c_rope_store_gives_the_reference_bytes(dim):
    heads, q_heads, t = 2, 4, 30
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, (q_heads + 2 * heads) * dim, generator=gen) * 3
    qkv[3, q_heads * dim : (q_heads + 1) * dim] = 0.0  # a zero K head: scale 0
    cos, sin = torch.randn(64, dim, generator=gen), torch.randn(64, dim, generator=gen)
    positions = torch.randint(0, 64, (t,), generator=gen)
    slots = torch.randperm(5 * 8, generator=gen)[:t]
    slots[7] = -1
    kc, vc = _cache(5, 8, heads, dim), _cache(5, 8, heads, dim)
    rotated = qkv.clone()
    cpu_native.rope_store(rotated, q_heads, heads, dim, cos, sin, positions, slots, kc, vc)
    # the fp32 store rotates identically; quantise its K/V rows with the reference
    kf, vf = torch.zeros(5, 8, heads, dim), torch.zeros(5, 8, heads, dim)
    cpu_native.rope_store(qkv.clone(), q_heads, heads, dim, cos, sin, positions, slots, kf, vf)
    kr, vr = _cache(5, 8, heads, dim), _cache(5, 8, heads, dim)
    keep = slots >= 0
    s = slots[keep]
    kernels.store_kv_cache(
        kf.view(-1, heads, dim)[s], vf.view(-1, heads, dim)[s], kr, vr, s, backend="torch"
    )
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert int8.scales(kc).view(-1, heads)[slots[3], 0].item() == 0.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_copy_blocks_carries_the_scales(device, backend):
    heads, dim = 2, 8
    kc, vc, _, _, tables, _ = _int8_case([16], heads, heads, dim)
    src = int(tables[0, 1])
    dst = next(b for b in range(kc.shape[0]) if b not in tables[0].tolist())
    kd, vd = kc.to(device), vc.to(device)
    kernels.copy_blocks([kd], [vd], torch.tensor([[src, dst]], device=device), backend=backend)
    kc, vc = kd.cpu(), vd.cpu()
    assert torch.equal(kc[dst], kc[src]) and torch.equal(vc[dst], vc[src])
    assert torch.equal(int8.scales(kc)[dst], int8.scales(kc)[src])
    assert bool((int8.scales(kc)[dst] > 0).all())


def test_swap_unit_round_trip_carries_the_scales():
    heads, dim = 2, 8
    kc, vc, _, _, tables, _ = _int8_case([16], heads, heads, dim)
    ids = tables[0].long()
    packed = kernels.gather_blocks([kc, kc.clone()], [vc, vc.clone()], ids)
    assert packed.dtype == I8 and packed.shape[-1] == dim + 4
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    kernels.scatter_blocks([k2, k2.clone()], [v2, v2.clone()], ids, packed)
    assert torch.equal(k2[ids], kc[ids]) and torch.equal(v2[ids], vc[ids])
    assert torch.equal(int8.scales(k2)[ids], int8.scales(kc)[ids])


def test_int8_checks_name_the_problem():
    kc = torch.zeros(2, 4, 2, 10, dtype=I8)  # 10: not head_dim + 4 with head_dim % 4 == 0
    with pytest.raises(ValueError, match="multiple of 4"):
        kernels.store_kv_cache(
            torch.zeros(1, 2, 6), torch.zeros(1, 2, 6), kc, kc.clone(), torch.tensor([0])
        )
    kc = _cache(2, 4, 2, 8)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode_attention(
            torch.zeros(1, 2, 12), kc, kc.clone(), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0, backend="torch",
        )  # fmt: skip
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        kernels.store_kv_cache(
            torch.zeros(1, 2, 8, dtype=I8), torch.zeros(1, 2, 8, dtype=I8), kc, kc.clone(),
            torch.tensor([0]),
        )  # fmt: skip


def test_stored_head_dim():
    assert int8.stored_head_dim(64, I8) == 68
    assert int8.stored_head_dim(64, torch.float32) == 64
    with pytest.raises(ValueError, match="multiple of 4"):
        int8.stored_head_dim(6, I8)


@pytest.mark.parametrize("dim", [16, 20])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_gives_the_reference_bytes(device, dim, src_dtype):
    heads = 2
    gen = torch.Generator().manual_seed(4)
    key = (torch.randn(24, heads, dim, generator=gen) * 3).to(src_dtype)
    key[2, 1] = 0.0  # scale 0
    key[3, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5]).to(src_dtype)  # exact ties
    key[3, 0, 4:] = 0.0
    value = torch.randn(24, heads, dim, generator=gen).to(src_dtype)
    slots = torch.randperm(32, generator=gen)[:24]
    slots[5] = -1
    kc, vc = _cache(4, 8, heads, dim).to(device), _cache(4, 8, heads, dim).to(device)
    kr, vr = kc.clone(), vc.clone()
    kernels.store_kv_cache(
        key.to(device), value.to(device), kc, vc, slots.to(device), backend="triton"
    )
    kr, vr = kr.cpu(), vr.cpu()
    kernels.store_kv_cache(key, value, kr, vr, slots, backend="torch")
    kc, vc = kc.cpu(), vc.cpu()
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert kc.view(-1, heads, dim + 4)[slots[3], 0, :4].tolist() == [127, 0, 2, -2]
    assert int8.scales(kc).view(-1, heads)[slots[2], 1].item() == 0.0


@pytest.mark.parametrize("q_dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_triton_attention_int8_matches_reference(device, q_dtype, atol):
    heads, q_heads, dim = 2, 4, 16
    kc, vc, _, _, tables, lens = _int8_case([13, 4, 22], heads, q_heads, dim)
    q = torch.randn(3, q_heads, dim, generator=torch.Generator().manual_seed(8))
    ref = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.25, backend="torch")
    on = {"device": device}
    got = kernels.paged_decode_attention(
        q.to(q_dtype).to(**on), kc.to(**on), vc.to(**on), tables.to(**on), lens.to(**on), 0.25,
        backend="triton",
    )  # fmt: skip
    torch.testing.assert_close(got.float().cpu(), ref, atol=atol, rtol=atol)
    qp = torch.randn(9, q_heads, dim, generator=torch.Generator().manual_seed(9))
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    ref = kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens, 0.25, backend="torch")
    got = kernels.paged_prefill_attention(
        qp.to(q_dtype).to(**on), kc.to(**on), vc.to(**on), tables.to(**on), cu.to(**on),
        lens.to(**on), 0.25, backend="triton",
    )  # fmt: skip
    torch.testing.assert_close(got.float().cpu(), ref, atol=atol, rtol=atol)


def test_triton_split_decode_int8_matches_reference(device):
    """The multi-split decode (per-split partial outputs, then the merge) on int8 tiles."""
    from pagedserve.kernels import decode_triton

    heads, q_heads, dim = 1, 3, 20
    kc, vc, _, _, tables, lens = _int8_case([40, 9], heads, q_heads, dim)
    q = torch.randn(2, q_heads, dim, generator=torch.Generator().manual_seed(10))
    ref = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.3, backend="torch")
    got = decode_triton.paged_decode_attention(
        q.to(device), kc.to(device), vc.to(device), tables.to(device), lens.to(device), 0.3,
        num_splits=3, block_n=16,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)
