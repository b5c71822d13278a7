"""The fused fp32 CPU kernels (``pagedserve/kernels/cpu_native.py``) against dense attention and the
torch layers they replace."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from paged_kv_testlib import cu_seqlens, dense_decode, dense_prefill, edge_lengths, make_paged_case

from pagedserve import kernels
from pagedserve.kernels import cpu_native
from pagedserve.worker.layers import RMSNorm, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="no C compiler: the CPU kernels cannot be built"
)
HEADS = [(2, 1), (3, 3), (1, 4), (2, 8), (8, 1)]


def test_auto_backend_uses_them_for_fp32_cpu_only():
    cpu = torch.device("cpu")
    assert kernels.uses_cpu_kernels("auto", cpu, torch.float32)
    assert kernels.uses_cpu_kernels("cpu", cpu, torch.float32)
    assert not kernels.uses_cpu_kernels("torch", cpu, torch.float32)
    assert not kernels.uses_cpu_kernels("auto", cpu, torch.bfloat16)
    assert not kernels.uses_cpu_kernels("auto", torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("num_kv_heads,ratio", HEADS)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_matches_dense(num_kv_heads, ratio, head_dim, block_size):
    lens = edge_lengths(block_size, long=5 * block_size + 7)
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, seed=block_size)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim)
    scale = head_dim**-0.5
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
    out = kernels.paged_decode_attention(*args, backend="cpu")
    assert out.shape == query.shape and out.dtype == torch.float32
    assert not out.isnan().any()  # unwritten (NaN) slots are never read
    torch.testing.assert_close(out.double(), dense_decode(case, query, scale), atol=1e-5, rtol=1e-5)
    ref = kernels.paged_decode_attention(*args, backend="torch")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("num_kv_heads,ratio", HEADS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_mixed_batch_matches_dense(num_kv_heads, ratio, block_size):
    # Full prefills (one longer than a 16-row query tile), a chunk over a cached prefix,
    # two decodes, a chunk ending on a block edge.
    lens = [block_size + 5, 3 * block_size + 2, 7, 40, 2 * block_size, 37]
    q_lens = [block_size + 5, block_size + 1, 1, 1, block_size, 37]
    case = make_paged_case(lens, num_kv_heads, 64, block_size, seed=3)
    query = torch.randn(sum(q_lens), num_kv_heads * ratio, 64)
    out = kernels.paged_prefill_attention(
        query, case.key_cache, case.value_cache, case.block_tables, cu_seqlens(q_lens),
        case.seq_lens, 0.125, backend="cpu",
    )  # fmt: skip
    torch.testing.assert_close(
        out.double(), dense_prefill(case, query, q_lens, 0.125), atol=1e-5, rtol=1e-5
    )


def test_query_may_be_a_strided_view_of_qkv():
    case = make_paged_case([9, 20], 2, 64, 4, seed=1)
    qkv = torch.randn(2, (4 + 2 * 2) * 64)
    query = qkv[:, : 4 * 64].view(2, 4, 64)  # row stride 512, not 256
    got = cpu_native.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, cu_seqlens([1, 1]),
        case.seq_lens, 0.125,
    )  # fmt: skip
    want = dense_decode(case, query.contiguous(), 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_empty_context_gives_zeros_and_bad_tables_are_rejected():
    case = make_paged_case([5, 3], 1, 64, 4, seed=2)
    query = torch.randn(2, 2, 64)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    out = kernels.paged_decode_attention(
        query, case.key_cache, case.value_cache, case.block_tables, lens, 0.125, backend="cpu"
    )
    assert torch.equal(out[1], torch.zeros(2, 64))
    want = dense_decode(case, query, 0.125)[:1]
    torch.testing.assert_close(out[:1].double(), want, atol=1e-5, rtol=1e-5)
    bad = case.block_tables.clone()
    bad[0, 1] = 999
    with pytest.raises(ValueError, match="outside"):
        kernels.paged_decode_attention(
            query, case.key_cache, case.value_cache, bad, case.seq_lens, 0.125, backend="cpu"
        )
    with pytest.raises(ValueError, match="columns"):
        kernels.paged_decode_attention(
            query, case.key_cache, case.value_cache, case.block_tables[:, :1],
            torch.tensor([9, 3], dtype=torch.int32), 0.125, backend="cpu",
        )  # fmt: skip


def test_rope_store_equals_apply_rotary_and_store_bit_for_bit():
    heads, kv_heads, dim, tokens = 9, 3, 64, 11
    rope = RotaryEmbedding(dim, 128, {"rope_theta": 100000.0})
    positions = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(0))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    before = qkv.clone()
    slots = torch.randperm(8 * 16)[:tokens]
    slots[4] = -1  # padding: not stored
    kc, vc = torch.zeros(8, 16, kv_heads, dim), torch.zeros(8, 16, kv_heads, dim)
    cpu_native.rope_store(qkv, heads, kv_heads, dim, rope.cos_table, rope.sin_table,
                          positions, slots, kc, vc)  # fmt: skip
    cos, sin = rope(positions, torch.float32)
    q = apply_rotary(before[:, : heads * dim].view(tokens, heads, dim), cos, sin)
    k = apply_rotary(before[:, heads * dim : (heads + kv_heads) * dim].view(tokens, 3, dim),
                     cos, sin)  # fmt: skip
    v = before[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    assert torch.equal(qkv[:, : heads * dim], q.reshape(tokens, -1))
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    kernels.store_kv_cache(k, v, ref_k, ref_v, slots, backend="torch")
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_rms_norm_and_fused_residual_add():
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x, residual = torch.randn(33, 576), torch.randn(33, 576)
    with torch.no_grad():
        torch.testing.assert_close(cpu_native.rms_norm(x, norm.weight, 1e-5), norm(x))
        summed = residual.clone()
        out = cpu_native.rms_norm(x, norm.weight, 1e-5, residual=summed)
        assert torch.equal(summed, residual + x)
        torch.testing.assert_close(out, norm(residual + x))


def test_silu_mul():
    gate_up = torch.randn(7, 2 * 100) * 6
    want = torch.nn.functional.silu(gate_up[:, :100]) * gate_up[:, 100:]
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), want, atol=1e-6, rtol=1e-5)


def test_silu_mul_vector_lanes_equal_the_scalar_tail_bit_for_bit():
    # inter = 31: columns 0-15 go through the 16-lane exp, 16-30 through the scalar one.
    values = torch.cat([torch.linspace(-120, 120, 2001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    values = torch.cat([values, values[:5]])  # 2010 = 134 rows of 15
    gate = values.view(-1, 15)
    up = torch.randn_like(gate)
    rows = gate.shape[0]
    gate_up = torch.zeros(rows, 62)
    gate_up[:, :15], gate_up[:, 16:31] = gate, gate
    gate_up[:, 31:46], gate_up[:, 47:62] = up, up
    out = cpu_native.silu_mul(gate_up)
    assert torch.equal(out[:, :15], out[:, 16:31])
    want = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(out[:, :15].double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,inter", [(1, 31), (19, 100), (3, 1536), (2, 1111)])
def test_silu_mul_of_bf16_is_the_fp32_result_rounded_bit_for_bit(rows, inter):
    # inter 1536 and 1111 span several of the kernel's 512-element pieces (1111: a ragged
    # last piece whose own tail is scalar); specials and large values included.
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 8).to(torch.bfloat16)
    flat = gate_up.view(-1)
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-40]
    flat[: len(specials)] = torch.tensor(specials, dtype=torch.bfloat16)
    out = cpu_native.silu_mul(gate_up)
    want = cpu_native.silu_mul(gate_up.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, inter)
    # NaN payloads differ between conversions (torch's vector path keeps the sign): a NaN
    # where torch has one, equal bits everywhere else.
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan) and nan.any()
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_silu_mul_refuses_other_dtypes_and_odd_widths():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        cpu_native.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        cpu_native.silu_mul(torch.zeros(2, 7))


@pytest.mark.parametrize("n", [1, 37, (1 << 20) + 17])  # the last one takes the threaded loop
def test_round_to_bf16_is_torchs_rounding_in_place(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-140, 127, (n,), generator=gen))
    specials = [
        float("nan"),
        float("inf"),
        -float("inf"),
        0.0,
        -0.0,
        3.4e38,
        -1e-45,
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-8,
        1.0 + 2.0**-8 + 2.0**-20,
    ]  # ties, above
    k = min(n, len(specials))
    x[:k] = torch.tensor(specials[:k])
    want = x.to(torch.bfloat16).float()
    got = cpu_native.round_to_bf16_(x)
    assert got is x
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert (got[~nan].view(torch.int32) & 0xFFFF).eq(0).all()
    if n > len(specials):  # ties to even: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6; 3.4e38 -> inf
        assert got[7].item() == 1.0 and got[8].item() == 1.0 + 2.0**-6
        assert got[5].item() == float("inf") and got[9].item() == 1.0 + 2.0**-7


def test_round_to_bf16_refuses_other_tensors():
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_native.round_to_bf16_(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_native.round_to_bf16_(torch.zeros(4, 4).t())


def test_rms_norm_to_bf16_is_the_fp32_result_rounded_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(70, 576, generator=gen), torch.randn(70, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    want_res = residual.clone()
    want = cpu_native.rms_norm(x, weight, 1e-5, residual=want_res).to(torch.bfloat16)
    got_res = residual.clone()
    got = cpu_native.rms_norm(x, weight, 1e-5, residual=got_res, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got_res, want_res)
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_native.rms_norm(x, weight, 1e-5, out_dtype=torch.float16)


@pytest.mark.parametrize("num_kv_heads,ratio,head_dim", [(3, 3, 64), (1, 12, 64), (2, 4, 80)])
def test_one_sequence_alone_equals_its_row_in_a_batch_bit_for_bit(num_kv_heads, ratio, head_dim):
    # Alone, a sequence's KV group is split over several tasks (too few tasks for the
    # threads); in a batch of 12 it is not. The split must not change a bit.
    lens = [1, 5, 16, 17, 40, 100, 333, 64, 9, 12, 30, 31]
    case = make_paged_case(lens, num_kv_heads, head_dim, 16, seed=4)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim)
    tables = case.block_tables.to(torch.int32).contiguous()
    seq_lens = case.seq_lens.to(torch.int32).contiguous()
    batch = cpu_native.paged_attention(
        query, case.key_cache, case.value_cache, tables, cu_seqlens([1] * len(lens)),
        seq_lens, 0.125,
    )  # fmt: skip
    for i in range(len(lens)):
        alone = cpu_native.paged_attention(
            query[i : i + 1], case.key_cache, case.value_cache, tables[i : i + 1].contiguous(),
            cu_seqlens([1]), seq_lens[i : i + 1].contiguous(), 0.125,
        )  # fmt: skip
        assert torch.equal(alone[0], batch[i]), i
    torch.testing.assert_close(
        batch.double(), dense_decode(case, query, 0.125), atol=1e-5, rtol=1e-5
    )


def test_disabled_by_environment_falls_back_to_torch():
    code = (
        "import torch\n"
        "from pagedserve import kernels\n"
        "from pagedserve.kernels import cpu_native\n"
        "assert cpu_native.load() is None\n"
        "assert not kernels.uses_cpu_kernels('auto', torch.device('cpu'), torch.float32)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PAGEDSERVE_CPU_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_argmax_rows_equals_torch_argmax_on_ties_nans_and_infinities():
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(5, 49152, generator=gen), torch.randn(3, 7, generator=gen)]
    for width in (1, 15, 16, 17, 33, 100):
        ties = torch.randint(-2, 3, (6, width), generator=gen).float()  # many equal maxima
        cases.append(ties)
        nan = ties.clone()
        nan[1, width // 2] = float("nan")
        nan[2, width - 1] = float("nan")
        cases.append(nan)
        cases.append(torch.full((2, width), float("-inf")))
        signed_zeros = torch.zeros(2, width)
        signed_zeros[0, ::2] = -0.0
        cases.append(signed_zeros)
        inf = ties.clone()
        inf[3, width - 1] = float("inf")
        cases.append(inf)
    cases.append(torch.randn(8, 64, generator=gen)[:, ::2])  # row and column strides
    for logits in cases:
        assert torch.equal(cpu_native.argmax_rows(logits), logits.argmax(dim=-1)), logits


@pytest.mark.parametrize("length,head_dim,block_size", [(40, 64, 16), (100, 64, 8), (37, 80, 16)])
def test_a_token_gets_the_same_bits_in_a_prefill_tile_a_chunk_and_as_a_decode(
    length, head_dim, block_size
):
    # Scores in groups of 16 keys from key 0 and a softmax ordered by the row's key count
    # alone: how a step cuts the sequence does not change a token's attention output.
    case = make_paged_case([length], 3, head_dim, block_size, seed=1)
    query = torch.randn(length, 9, head_dim)
    table = case.block_tables.to(torch.int32).contiguous()
    args = (case.key_cache, case.value_cache)
    prefill = cpu_native.paged_attention(
        query, *args, table, cu_seqlens([length]), torch.tensor([length], dtype=torch.int32), 0.125
    )
    decodes = cpu_native.paged_attention(
        query, *args, table.expand(length, -1).contiguous(), cu_seqlens([1] * length),
        torch.arange(1, length + 1, dtype=torch.int32), 0.125,
    )  # fmt: skip
    chunk = cpu_native.paged_attention(
        query[-7:], *args, table, cu_seqlens([7]), torch.tensor([length], dtype=torch.int32), 0.125
    )
    assert torch.equal(prefill, decodes)
    assert torch.equal(chunk, decodes[-7:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ratio", [2, 3, 5, 8])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_heads_scored_together_equal_each_head_alone_bit_for_bit(head_dim, ratio, kv_dtype):
    # For head_dim 64 / 128 pass 1 scores up to 4 / 2 query heads of a KV group per load of
    # the K rows (dot16x16_heads); each head must get the bits it gets alone (ratio 1).
    lens, q_lens = [37, 70], [37, 5]
    case = make_paged_case(lens, 2, head_dim, 16, seed=ratio, dtype=kv_dtype)
    query = torch.randn(sum(q_lens), 2 * ratio, head_dim)
    args = (
        case.key_cache, case.value_cache, case.block_tables.to(torch.int32).contiguous(),
        cu_seqlens(q_lens), torch.tensor(lens, dtype=torch.int32), head_dim**-0.5,
    )  # fmt: skip
    grouped = cpu_native.paged_attention(query, *args)
    for j in range(ratio):
        alone = cpu_native.paged_attention(query[:, j::ratio].contiguous(), *args)
        assert torch.equal(grouped[:, j::ratio], alone), j
    if kv_dtype == torch.float32:
        ref = dense_prefill(case, query, q_lens, head_dim**-0.5)
        torch.testing.assert_close(grouped, ref.float(), rtol=2e-5, atol=2e-5)
