"""fp8 (e4m3fn) KV caches: the stores' bytes and the attention kernels against the torch
reference, which dequantises after its gather (:mod:`pagedserve.kernels.fp8`).

The Triton kernels run under TRITON_INTERPRET=1 without a GPU (tests/kernels/conftest.py),
so shapes are small.
"""

from __future__ import annotations

import pytest
import torch
from paged_kv_testlib import cu_seqlens, dense_decode, dense_prefill, make_paged_case

from pagedserve import kernels
from pagedserve.kernels import cpu_native, fp8
from pagedserve.worker.layers import RotaryEmbedding

FP8 = torch.float8_e4m3fn
SCALES = [(1.0, 1.0), (0.05, 0.3)]


def _hard_values(n: int, heads: int, dim: int) -> torch.Tensor:
    """Values over fp8's whole range: subnormals, exact ties, saturation, NaN, zeros."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, heads, dim, generator=gen) * torch.logspace(-5, 3.5, n)[:, None, None]
    sub = 2.0**-9
    ties = [1.0625, 1.1875, 1.5 * sub, 2.5 * sub, 0.5 * sub, 2.0**-6 - sub / 2, 248.0, 440.0]
    x[1, 0, : len(ties)] = torch.tensor(ties)
    x[1, 1, : len(ties)] = -torch.tensor(ties)
    x[0, 0, :5] = torch.tensor([float("nan"), 1e9, -1e9, 0.0, -0.0])
    return x


def test_quantize_is_torch_cast_saturated():
    x = _hard_values(8, 2, 16)
    q = fp8.quantize(x, 0.5)
    assert q.dtype == FP8
    bits = q.view(torch.uint8)
    assert int(bits[0, 0, 1]) == 0x7E and int(bits[0, 0, 2]) == 0xFE  # +-448
    assert int(bits[0, 0, 0]) & 0x7F == 0x7F  # NaN stays NaN
    # 1.5 * 2**-9 / 0.5 = 3 * 2**-9: the subnormal with mantissa 3.
    assert int(bits[1, 0, 2]) == 3
    finite = torch.isfinite(x)
    ref = (x / 0.5).clamp(-448, 448).to(FP8).float()
    assert torch.equal(q.float()[finite], ref[finite])
    assert torch.equal(fp8.dequantize(q, 0.5)[finite], ref[finite] * 0.5)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_gives_the_reference_bytes(device, k_scale, v_scale, src_dtype):
    heads, dim = 2, 48
    key = _hard_values(64, heads, dim).to(src_dtype).to(device)
    value = (torch.randn(64, heads, dim) * 3).to(src_dtype).to(device)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    slots[5] = -1
    slots = slots.to(device)
    kc = torch.zeros(5, 16, heads, dim, dtype=FP8, device=device)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    kw = {"k_scale": k_scale, "v_scale": v_scale}
    kernels.store_kv_cache(key, value, kc, vc, slots, backend="triton", **kw)
    kernels.store_kv_cache(key, value, kr, vr, slots, backend="torch", **kw)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    s = int(slots[7])
    want = fp8.quantize(value[7], v_scale).view(torch.uint8)
    assert torch.equal(vr.view(-1, heads, dim)[s].view(torch.uint8), want)


def _fp8_case(lens, heads, dim, block_size, device, k_scale, v_scale):
    """A paged fp8 case whose truth K/V are the dequantised cache contents."""
    case = make_paged_case(lens, heads, dim, block_size, device=device)
    kc = fp8.quantize(case.key_cache, k_scale)
    vc = fp8.quantize(case.value_cache, v_scale)
    case.key_cache, case.value_cache = kc, vc
    case.keys = [fp8.dequantize(fp8.quantize(k, k_scale), k_scale) for k in case.keys]
    case.values = [fp8.dequantize(fp8.quantize(v, v_scale), v_scale) for v in case.values]
    return case


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("q_dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_fp8_matches_reference_and_dense(device, k_scale, v_scale, q_dtype, atol):
    lens = [1, 15, 16, 17, 51]
    case = _fp8_case(lens, 2, 64, 16, device, k_scale, v_scale)
    query = torch.randn(len(lens), 6, 64, device=device).to(q_dtype)
    scale = 64**-0.5
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
    kw = {"k_scale": k_scale, "v_scale": v_scale}
    ref = kernels.paged_decode_attention(*args, backend="torch", **kw)
    assert ref.dtype == q_dtype
    dense = dense_decode(case, query.float(), scale)
    torch.testing.assert_close(ref.double(), dense, atol=atol, rtol=1e-5)
    for splits in (None, 3):
        out = kernels.paged_decode_attention(*args, backend="triton", **kw)
        if splits is not None:
            from pagedserve.kernels import decode_triton

            out = decode_triton.paged_decode_attention(*args, num_splits=splits, block_n=16, **kw)
        torch.testing.assert_close(out.double(), dense, atol=atol, rtol=1e-5)
    # The scales are read: a K/V cache read with scale 1 instead gives another answer.
    if (k_scale, v_scale) != (1.0, 1.0):
        wrong = kernels.paged_decode_attention(*args, backend="triton")
        assert not torch.allclose(wrong.double(), dense, atol=1e-2)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("q_dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_fp8_matches_reference_and_dense(device, k_scale, v_scale, q_dtype, atol):
    lens, q_lens = [17, 41, 1, 32], [17, 6, 1, 16]
    case = _fp8_case(lens, 1, 64, 16, device, k_scale, v_scale)
    query = torch.randn(sum(q_lens), 4, 64, device=device).to(q_dtype)
    cu = cu_seqlens(q_lens, device)
    args = (query, case.key_cache, case.value_cache, case.block_tables, cu, case.seq_lens, 0.125)
    kw = {"k_scale": k_scale, "v_scale": v_scale}
    dense = dense_prefill(case, query.float(), q_lens, 0.125)
    ref = kernels.paged_prefill_attention(*args, backend="torch", **kw)
    torch.testing.assert_close(ref.double(), dense, atol=atol, rtol=1e-5)
    out = kernels.paged_prefill_attention(*args, backend="triton", **kw)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense, atol=atol, rtol=1e-5)


def test_fp8_checks_name_the_argument(device):
    kc = torch.zeros(2, 16, 1, 16, dtype=FP8, device=device)
    key = torch.zeros(1, 1, 16, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"k_scale must be a finite number > 0"):
        kernels.store_kv_cache(key, key, kc, kc.clone(), slots, k_scale=0.0)
    with pytest.raises(ValueError, match=r"v_scale must be a finite number > 0"):
        kernels.store_kv_cache(key, key, kc, kc.clone(), slots, v_scale=float("inf"))
    with pytest.raises(ValueError, match=r"key dtype torch\.int32 must be fp32/fp16/bf16"):
        kernels.store_kv_cache(key.int(), key, kc, kc.clone(), slots)
    # A float cache still wants K/V in its own dtype.
    with pytest.raises(ValueError, match=r"key dtype torch\.float32 != key_cache dtype"):
        kernels.store_kv_cache(key, key, kc.float().bfloat16(), kc.float().bfloat16(), slots)


def test_copy_and_swap_units_keep_fp8_bytes(device):
    kcs = [fp8.quantize(torch.randn(4, 16, 2, 16) * 50).to(device) for _ in range(2)]
    vcs = [fp8.quantize(torch.randn(4, 16, 2, 16) * 50).to(device) for _ in range(2)]
    before = [c.view(torch.uint8).clone() for c in (*kcs, *vcs)]
    mapping = torch.tensor([[1, 3]], device=device)
    for backend in ("torch", "triton"):
        kernels.copy_blocks(kcs, vcs, mapping, backend=backend)
        for c, b in zip((*kcs, *vcs), before, strict=True):
            assert torch.equal(c.view(torch.uint8)[3], b[1])
    packed = kernels.gather_blocks(kcs, vcs, torch.tensor([1, 2], device=device))
    assert packed.dtype == FP8
    kernels.scatter_blocks(kcs, vcs, torch.tensor([0, 3], device=device), packed)
    for c, b in zip((*kcs, *vcs), before, strict=True):
        assert torch.equal(c.view(torch.uint8)[0], b[1]) and torch.equal(
            c.view(torch.uint8)[3], b[2]
        )


# ------------------------------------------------------------------- the CPU C kernels
needs_c = pytest.mark.skipif(not cpu_native.available(), reason="the C kernels do not build")


@needs_c
def test_c_widening_reads_every_byte_as_torch():
    """All 256 e4m3fn bytes through the C attention's loads: a one-key context returns
    that key's V row, so out == float(byte) exactly (NaN included)."""
    head_dim = 16
    values = torch.arange(256, dtype=torch.uint8).view(FP8).view(16, head_dim)
    # 16 one-token contexts, one per block: each query's output is its block's V row.
    kc = torch.zeros(16, 1, 1, head_dim, dtype=FP8)
    vc = values.view(16, 1, 1, head_dim).clone()
    tables = torch.arange(16, dtype=torch.int32)[:, None]
    lens = torch.ones(16, dtype=torch.int32)
    cu = torch.arange(17, dtype=torch.int32)
    out = cpu_native.paged_attention(torch.zeros(16, 1, head_dim), kc, vc, tables, cu, lens, 1.0)
    want = values.float().view(16, 1, head_dim)
    assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
    assert int(torch.isnan(out).sum()) == 2  # 0x7f and 0xff


@needs_c
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_c_rope_store_gives_the_reference_bytes(head_dim, k_scale, v_scale):
    heads, kv_heads, tokens = 6, 2, 13
    rope = RotaryEmbedding(head_dim, 128, {"rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    v_start = (heads + kv_heads) * head_dim
    qkv[:2, v_start : v_start + head_dim * kv_heads] = _hard_values(2, kv_heads, head_dim).view(
        2, -1
    )
    before = qkv.clone()
    slots = torch.randperm(6 * 8, generator=gen)[:tokens]
    slots[5] = -1
    shape = (6, 8, kv_heads, head_dim)
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    cpu_native.rope_store(qkv, heads, kv_heads, head_dim, rope.cos_table, rope.sin_table,
                          positions, slots, kc, vc, k_scale, v_scale)  # fmt: skip
    fp32_qkv = before.clone()
    kf, vf = torch.zeros(shape), torch.zeros(shape)
    cpu_native.rope_store(fp32_qkv, heads, kv_heads, head_dim, rope.cos_table, rope.sin_table,
                          positions, slots, kf, vf)  # fmt: skip
    assert torch.equal(qkv.view(torch.int32), fp32_qkv.view(torch.int32))
    assert torch.equal(kc.view(torch.uint8), fp8.quantize(kf, k_scale).view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), fp8.quantize(vf, v_scale).view(torch.uint8))
    assert int((vc.view(torch.uint8) == 0x7E).sum()) > 0  # the saturated values were stored


@needs_c
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_c_attention_fp8_matches_reference(head_dim, k_scale, v_scale):
    lens, q_lens = [17, 41, 1, 33, 5], [17, 6, 1, 1, 1]
    case = _fp8_case(lens, 2, head_dim, 16, "cpu", k_scale, v_scale)
    query = torch.randn(sum(q_lens), 6, head_dim)
    cu = cu_seqlens(q_lens)
    args = (query, case.key_cache, case.value_cache, case.block_tables, cu, case.seq_lens, 0.1)
    kw = {"k_scale": k_scale, "v_scale": v_scale}
    out = kernels.paged_prefill_attention(*args, backend="cpu", **kw)
    ref = kernels.paged_prefill_attention(*args, backend="torch", **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dec = (
        query[-3:],
        case.key_cache,
        case.value_cache,
        case.block_tables[-3:],
        case.seq_lens[-3:],
        0.1,
    )
    torch.testing.assert_close(
        kernels.paged_decode_attention(*dec, backend="cpu", **kw),
        kernels.paged_decode_attention(*dec, backend="torch", **kw),
        atol=1e-5,
        rtol=1e-5,
    )
    if (k_scale, v_scale) == (1.0, 1.0):
        # Widening is exact: the fp32 kernel on the dequantised cache gives the same bits.
        wide = (query, fp8.dequantize(case.key_cache), fp8.dequantize(case.value_cache),
                case.block_tables, cu, case.seq_lens, 0.1)  # fmt: skip
        assert torch.equal(out, kernels.paged_prefill_attention(*wide, backend="cpu"))
