"""Decode and short-chunk attention on bf16 KV caches with AVX512-BF16 dot products
(``csrc/cpu_attention_decode_bf16.c``).

With the bf16-product attention on (``amx_min_rows > 0``), the chunks shorter than
``amx_min_rows`` take this path: queries and softmax probabilities rounded to bf16, products
summed in fp32, the softmax in fp32, the output divided by the fp32 sum of the unrounded
exps. It is compared with a float64 oracle that rounds Q and P the same way: what is left
is the fp32 rounding of the sums (~1e-6) and probabilities that sit on a bf16 rounding tie
(fp32 exp vs the oracle's), for which the tolerance adds their one-ulp effect."""

from __future__ import annotations

import pytest
import torch
from paged_kv_testlib import cu_seqlens, dense_prefill, make_paged_case

from pagedserve.kernels import cpu_native

pytestmark = pytest.mark.skipif(
    not cpu_native.available() or not cpu_native.has_bf16_gemm(),
    reason="needs the CPU kernels built for AVX512-BF16",
)

MIN_ROWS = 16
# Against the fp32 oracle on the unrounded queries: Q rounded to bf16 moves a score by up to
# 2^-9 x sum_d |q_d k_d| x scale (~0.02-0.05 for unit-normal q, k at head_dim 32-256), and P's
# rounding adds 2^-9 relative per probability, on outputs of magnitude ~1: a sanity bound
# (a skipped or wrong key moves an output by ~1); the bf16 oracle above is the tight check.
FP32_ORACLE_ATOL = 3e-2


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws its queries from torch's global generator: seed it per test, so a
    test's data do not depend on which tests ran before it in the process."""
    torch.manual_seed(0)


def attend(query, case, q_lens, scale, min_rows=MIN_ROWS):
    return cpu_native.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, cu_seqlens(q_lens),
        case.seq_lens, scale, amx_min_rows=min_rows,
    )  # fmt: skip


def bf16_oracle(case, query, q_lens, scale):
    """float64 attention with Q and P = bf16(fp32(exp((s - max) * scale))) rounded to bf16
    and the sum of the unrounded exps; also the bound of what a P element on a bf16
    rounding tie can move each output element by (one bf16 ulp of it times |v| / sum)."""
    outs, slack = [], []
    start = 0
    for k, v, q_len in zip(case.keys, case.values, q_lens):
        n = k.shape[0]
        group = query.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [n, H, D]
        vv = v.double().repeat_interleave(group, dim=1)
        q = query[start : start + q_len].bfloat16().double()
        s = torch.einsum("thd,lhd->htl", q, kk)
        pos = torch.arange(n - q_len, n)
        future = torch.arange(n)[None, :] > pos[:, None]
        s = s.masked_fill(future[None], float("-inf"))
        e = torch.exp((s - s.amax(-1, keepdim=True)) * scale)
        e32 = e.float()
        p = e32.bfloat16().double()
        total = e.sum(-1, keepdim=True)
        outs.append(torch.einsum("htl,lhd->thd", p / total, vv))
        low = e32.view(torch.int32) & 0xFFFF
        tie = ((low - 0x8000).abs() <= 256) & (e32 > 0)
        ulp = torch.where(tie, torch.exp2(torch.floor(torch.log2(e32.double())) - 7), 0.0)
        slack.append(torch.einsum("htl,lhd->thd", ulp / total, vv.abs()))
        start += q_len
    return torch.cat(outs), torch.cat(slack)


def check_bf16_contract(out, case, query, q_lens, scale, fp32_on_bf16_q=False):
    """out within the bf16 oracle's tolerance, and within FP32_ORACLE_ATOL of the float64
    oracle on the unrounded queries (or on the bf16 ones: large scores)."""
    oracle, slack = bf16_oracle(case, query, q_lens, scale)
    err = (out.double() - oracle).abs()
    bound = 1e-5 * (1 + oracle.abs()) + slack
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"
    fp32 = dense_prefill(case, query.bfloat16().float() if fp32_on_bf16_q else query, q_lens, scale)
    assert (out.double() - fp32).abs().max().item() < FP32_ORACLE_ATOL


@pytest.mark.parametrize(
    "num_kv_heads,ratio,head_dim,block_size",
    [
        (3, 3, 64, 16),  # SmolLM2-135M
        (1, 8, 128, 16),
        (4, 1, 32, 5),  # no GQA, a block size not dividing 16
        (2, 4, 64, 1),
        (1, 3, 96, 7),
        (2, 2, 256, 16),
    ],
)
def test_decode_and_short_chunks_match_the_bf16_oracle(num_kv_heads, ratio, head_dim, block_size):
    # decodes at 1, 16, 17, 33 and 1100 keys (partial key groups, odd and even counts) and
    # chunks of 2..15 rows over cached contexts (each row its own causal limit)
    lens = [1, 16, 17, 33, 1100, 2, 40, 15, 600]
    q_lens = [1, 1, 1, 1, 1, 2, 7, 15, 3]
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=7)
    query = torch.randn(sum(q_lens), num_kv_heads * ratio, head_dim)
    scale = head_dim**-0.5
    out = attend(query, case, q_lens, scale)
    assert torch.isfinite(out).all()
    check_bf16_contract(out, case, query, q_lens, scale)
    assert not torch.equal(out, attend(query, case, q_lens, scale, 0))  # the path ran


def test_min_rows_zero_keeps_the_exact_kernel():
    lens, q_lens = [50, 200, 9], [1, 5, 9]
    case = make_paged_case(lens, 3, 64, 16, torch.bfloat16, seed=2)
    query = torch.randn(sum(q_lens), 9, 64)
    exact = attend(query, case, q_lens, 0.125, 0)
    torch.testing.assert_close(
        exact.double(), dense_prefill(case, query, q_lens, 0.125), atol=1e-5, rtol=1e-5
    )
    if cpu_native.amx_attention_min_rows() > 0:  # the process default is the new contract
        default = attend(query, case, q_lens, 0.125, None)
        assert torch.equal(
            default, attend(query, case, q_lens, 0.125, cpu_native.amx_attention_min_rows())
        )


def test_needles_catch_skipped_keys_rows_and_heads():
    """Each (row, query head) looks for one key (its query is twice that key, so its score
    beats every other by ~50 and the softmax is one-hot in bf16): the row's own last
    visible key for head 0 (the causal limit, a partial key group, an odd last key), earlier
    ones for the other heads of the group. The output must be that key's value; a key, row
    or head skipped, or one head's or row's data used for another, gives another value."""
    lens, q_lens = [33, 70, 1000, 18], [1, 6, 1, 15]
    ratio, head_dim = 4, 64
    case = make_paged_case(lens, 2, head_dim, 16, torch.bfloat16, seed=13)
    query = torch.empty(sum(q_lens), 2 * ratio, head_dim)
    want = torch.empty_like(query)
    t = 0
    for k, v, n, q_len in zip(case.keys, case.values, lens, q_lens):
        for i in range(q_len):
            pos = n - q_len + i
            for h in range(2 * ratio):
                key = max(pos - 3 * (h % ratio), 0)
                query[t, h] = 2 * k[key, h // ratio].float()
                want[t, h] = v[key, h // ratio].float()
            t += 1
    out = attend(query, case, q_lens, 1.0)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_a_row_gives_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    lens, q_lens = [40, 129, 33, 700, 5], [1, 1, 3, 1, 5]
    case = make_paged_case(lens, 3, 64, 16, torch.bfloat16, seed=11)
    query = torch.randn(sum(q_lens), 9, 64)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(attend(query, case, q_lens, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    batch = runs[0]
    # alone: one sequence's 3 KV heads are fewer tasks than the threads want, so its query
    # heads are split across tasks; in the batch they are not
    start = 0
    for s, q_len in enumerate(q_lens):
        alone = cpu_native.paged_attention(
            query[start : start + q_len], case.key_cache, case.value_cache,
            case.block_tables[s : s + 1], cu_seqlens([q_len]), case.seq_lens[s : s + 1],
            0.125, amx_min_rows=MIN_ROWS,
        )  # fmt: skip
        assert torch.equal(batch[start : start + q_len], alone)
        start += q_len


def test_long_chunks_in_the_same_call_take_the_prefill_path():
    lens, q_lens = [300, 50, 64], [100, 1, 4]
    case = make_paged_case(lens, 2, 64, 16, torch.bfloat16, seed=4)
    query = torch.randn(sum(q_lens), 4, 64)
    out = attend(query, case, q_lens, 0.125)
    short = attend(query[100:], make_sub(case, [1, 2]), [1, 4], 0.125)
    assert torch.equal(out[100:], short)
    long = attend(query[:100], make_sub(case, [0]), [100], 0.125)
    assert torch.equal(out[:100], long)
    check_bf16_contract(out[100:], make_sub(case, [1, 2]), query[100:], [1, 4], 0.125)


def make_sub(case, idx):
    """The case restricted to sequences idx (same caches)."""
    return type(case)(
        case.key_cache, case.value_cache, case.block_tables[idx].contiguous(),
        case.seq_lens[idx].contiguous(), [case.keys[i] for i in idx],
        [case.values[i] for i in idx],
    )  # fmt: skip


@pytest.mark.parametrize("head_dim", [48, 80, 320])
def test_head_dims_the_path_refuses_keep_the_exact_kernel(head_dim):
    case = make_paged_case([40, 7], 2, head_dim, 16, torch.bfloat16, seed=5)
    query = torch.randn(3, 4, head_dim)
    scale = head_dim**-0.5
    assert torch.equal(attend(query, case, [1, 2], scale), attend(query, case, [1, 2], scale, 0))


def test_large_scores_stay_finite_and_close():
    # scores of magnitude ~60: the softmax must subtract each row's maximum
    case = make_paged_case([80, 20], 1, 64, 16, torch.bfloat16, seed=9)
    query = 8 * torch.randn(4, 2, 64)
    out = attend(query, case, [1, 3], 1.0)
    assert torch.isfinite(out).all()
    check_bf16_contract(out, case, query, [1, 3], 1.0, fp32_on_bf16_q=True)


@pytest.mark.parametrize("rows", [1, 8, 32])  # decode, a short chunk, a tile-path chunk
def test_a_nan_query_gives_a_nan_row_as_the_exact_kernel_does(rows: int) -> None:
    """A NaN in one query head's row propagates to that row and head only (exp of a NaN
    score stays NaN), on both bf16-product paths, as on the fp32-arithmetic kernel."""
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, head_dim, block = 2, 1, 64, 16
    kc = torch.randn(3, block, kv_heads, head_dim, generator=gen).bfloat16()
    vc = torch.randn(3, block, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    q[rows - 1, 0, 5] = float("nan")
    cu = torch.tensor([0, rows], dtype=torch.int32)
    lens = torch.tensor([40], dtype=torch.int32)
    for min_rows in (16, 0):
        out = cpu_native.paged_attention(q, kc, vc, table, cu, lens, 0.125, amx_min_rows=min_rows)
        assert out[rows - 1, 0].isnan().all(), min_rows
        assert out[rows - 1, 1].isfinite().all() and out[: rows - 1].isfinite().all(), min_rows
