"""Prefill attention on tiles (``csrc/cpu_attention_amx.c``) for bf16 KV caches: AMX tiles
where :func:`cpu_native.amx_chosen`, else AVX512-BF16 (``VDPBF16PS``) register tiles.

Chunks of at least ``amx_min_rows`` query rows take the tile path: the queries and the
softmax probabilities are rounded to bf16, products summed in fp32, scores and softmax in
fp32. So its result is compared with the float64 oracle on the bf16-rounded queries (the
probabilities' rounding is the only error left); the shorter chunks of the same call take
the decode path (``csrc/cpu_attention_decode_bf16.c``, tested in
test_kernels_cpu_bf16dot_decode.py)."""

from __future__ import annotations

import pytest
import torch
from paged_kv_testlib import cu_seqlens, dense_prefill, make_paged_case

from pagedserve.kernels import cpu_native

pytestmark = pytest.mark.skipif(
    not cpu_native.available() or cpu_native.amx_attention_min_rows() == 0,
    reason="needs the CPU kernels on a CPU with AMX or AVX512-BF16 (and the path not off)",
)

# P rounded to bf16 (relative 2^-9 per probability) on outputs of magnitude ~1.
AMX_ATOL = 1e-2


def attend(query, case, q_lens, scale, amx_min_rows):
    return cpu_native.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, cu_seqlens(q_lens),
        case.seq_lens, scale, amx_min_rows=amx_min_rows,
    )  # fmt: skip


def rows_of(q_lens: list[int], keep) -> torch.Tensor:
    """The query rows of the chunks for which keep(q_len) holds."""
    idx, start = [], 0
    for n in q_lens:
        if keep(n):
            idx.extend(range(start, start + n))
        start += n
    return torch.tensor(idx, dtype=torch.int64)


@pytest.mark.parametrize(
    "num_kv_heads,ratio,head_dim,block_size",
    [(3, 3, 64, 16), (1, 8, 128, 16), (4, 1, 64, 1), (2, 2, 64, 32), (1, 2, 256, 16)],
)
def test_long_chunks_match_the_oracle_and_short_ones_take_the_decode_path(
    num_kv_heads, ratio, head_dim, block_size
):
    # whole prompts, chunks over cached contexts (partial blocks), a 65-row chunk (two
    # 64-row tasks), decodes and a 15-row chunk below the threshold
    lens = [16, 300, 50, 64, 200, 17, 90]
    q_lens = [16, 100, 1, 64, 65, 17, 15]
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=3)
    query = torch.randn(sum(q_lens), num_kv_heads * ratio, head_dim)
    scale = head_dim**-0.5
    out = attend(query, case, q_lens, scale, 16)
    exact = attend(query, case, q_lens, scale, 0)
    assert not out.isnan().any()
    long_rows, short_rows = rows_of(q_lens, lambda n: n >= 16), rows_of(q_lens, lambda n: n < 16)
    assert not torch.equal(out[short_rows], exact[short_rows])  # the decode path ran
    assert not torch.equal(out[long_rows], exact[long_rows])  # the AMX path really ran
    oracle = dense_prefill(case, query.bfloat16().float(), q_lens, scale)
    err = (out.double() - oracle).abs().max().item()
    assert err < AMX_ATOL
    # and the exact kernel is within the fp32 tolerance of the unrounded oracle
    torch.testing.assert_close(
        exact.double(), dense_prefill(case, query, q_lens, scale), atol=1e-5, rtol=1e-5
    )


def test_a_chunk_gives_the_same_bits_alone_and_in_a_batch():
    lens, q_lens = [40, 129, 33], [40, 97, 1]
    case = make_paged_case(lens, 3, 64, 16, torch.bfloat16, seed=11)
    query = torch.randn(sum(q_lens), 9, 64)
    batch = attend(query, case, q_lens, 0.125, 16)
    alone = cpu_native.paged_attention(
        query[40:137], case.key_cache, case.value_cache, case.block_tables[1:2],
        cu_seqlens([97]), case.seq_lens[1:2], 0.125, amx_min_rows=16,
    )  # fmt: skip
    assert torch.equal(batch[40:137], alone)


def test_threshold_and_head_dims_the_tiles_do_not_take():
    one = make_paged_case([31], 2, 64, 16, torch.bfloat16, seed=5)
    query = torch.randn(31, 4, 64)
    exact = attend(query, one, [31], 0.125, 0)
    below = attend(query, one, [31], 0.125, 32)  # 31 rows < 32: the decode path
    tiles = attend(query, one, [31], 0.125, 31)
    assert not torch.equal(tiles, exact) and not torch.equal(tiles, below)
    odd = make_paged_case([40], 2, 80, 16, torch.bfloat16, seed=5)  # 80 % 32 != 0
    q80 = torch.randn(40, 4, 80)
    assert torch.equal(attend(q80, odd, [40], 80**-0.5, 16), attend(q80, odd, [40], 80**-0.5, 0))
    with pytest.raises(ValueError, match="amx_min_rows"):
        attend(q80, odd, [40], 80**-0.5, -1)


def test_large_scores_stay_finite_and_close():
    # scores of magnitude ~60: the softmax must subtract each row's maximum
    case = make_paged_case([80], 1, 64, 16, torch.bfloat16, seed=9)
    query = 8 * torch.randn(80, 2, 64)
    out = attend(query, case, [80], 1.0, 16)
    assert torch.isfinite(out).all()
    oracle = dense_prefill(case, query.bfloat16().float(), [80], 1.0)
    assert (out.double() - oracle).abs().max().item() < AMX_ATOL
