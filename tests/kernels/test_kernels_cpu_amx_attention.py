"""Prefill attention on tiles (``csrc/cpu_attention_amx.c``) for bf16 KV caches: AMX tiles
where :func:`cpu_native.amx_chosen`, else AVX512-BF16 (``VDPBF16PS``) register tiles.

Chunks of at least ``amx_min_rows`` query rows take the tile path: the queries and the
softmax probabilities are rounded to bf16, products summed in fp32, scores and softmax in
fp32. So its result is compared with the float64 oracle on the bf16-rounded queries (the
probabilities' rounding is the only error left) and with :func:`contract_oracle`, which
rounds the probabilities as the path does (left: fp32 sums, the fp32 exp); the shorter
chunks of the same call take the decode path (``csrc/cpu_attention_decode_bf16.c``, tested
in test_kernels_cpu_bf16dot_decode.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from paged_kv_testlib import cu_seqlens, dense_prefill, make_paged_case

import pagedserve
from pagedserve.kernels import cpu_native

pytestmark = pytest.mark.skipif(
    not cpu_native.available() or cpu_native.amx_attention_min_rows() == 0,
    reason="needs the CPU kernels on a CPU with AMX or AVX512-BF16 (and the path not off)",
)

ROOT = os.path.dirname(os.path.dirname(pagedserve.__file__))  # for the subprocesses' imports
# P rounded to bf16 (relative 2^-9 per probability) on outputs of magnitude ~1.
AMX_ATOL = 1e-2
# Against contract_oracle: a probability whose fp32 exp lands on the other side of a bf16
# rounding boundary moves its row by up to 2^-8 of its weight (rare, largest in short rows);
# the mean error is ~4e-8 (a probability rounded toward zero instead: ~1e-4).
CONTRACT_ATOL, CONTRACT_MEAN = 3e-3, 1e-6


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Tests draw queries from torch's global generator: seed it per test, so a test's data
    do not depend on which tests ran before it in the process."""
    torch.manual_seed(0)


def attend(query, case, q_lens, scale, amx_min_rows):
    return cpu_native.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, cu_seqlens(q_lens),
        case.seq_lens, scale, amx_min_rows=amx_min_rows,
    )  # fmt: skip


def contract_oracle(case, query, q_lens, scale) -> torch.Tensor:
    """The path's arithmetic in float64: Q rounded to bf16, P = bf16(exp((s - max) * scale))
    (zero past each row's position), divided by the sum of the unrounded exps."""
    outs, start = [], 0
    q_bf16 = query.bfloat16().double()
    for k, v, q_len in zip(case.keys, case.values, q_lens):
        n, group = k.shape[0], query.shape[1] // k.shape[1]
        k64 = k.double().repeat_interleave(group, 1)
        v64 = v.double().repeat_interleave(group, 1)
        s = torch.einsum("thd,lhd->htl", q_bf16[start : start + q_len], k64)
        future = torch.arange(n)[None, :] > torch.arange(n - q_len, n)[:, None]
        s = s.masked_fill(future[None], float("-inf"))
        e = torch.exp((s - s.amax(-1, keepdim=True)) * scale)
        p = e.float().bfloat16().double()
        outs.append(torch.einsum("htl,lhd->thd", p, v64) / e.sum(-1).transpose(0, 1)[..., None])
        start += q_len
    return torch.cat(outs)


def assert_contract(out: torch.Tensor, case, query, q_lens, scale) -> None:
    err = (out.double() - contract_oracle(case, query, q_lens, scale)).abs()
    assert err.max().item() < CONTRACT_ATOL
    assert err.mean().item() < CONTRACT_MEAN


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


# chunk lengths around the 16-row tiles, the 8-row register blocks and the 64-row tasks
# (one row past a tile, block or task: a last block of a single row), and the contexts
# already cached before each chunk (0: a whole prompt; odd ones end inside a key group and
# a 32-key pair group)
PARTIAL_Q_LENS = [16, 17, 31, 33, 64, 65, 97, 130, 23]
PARTIAL_CACHED = [0, 40, 7, 0, 200, 3, 0, 100, 1]


@pytest.mark.parametrize(
    "num_kv_heads,ratio,head_dim",
    [(3, 3, 64), (2, 1, 32), (1, 4, 128), (2, 3, 96), (1, 1, 256)],
)
def test_partial_tiles_and_cached_contexts_follow_the_contract(num_kv_heads, ratio, head_dim):
    """Every row is written (out starts as NaN), and each one matches the contract's float64
    oracle: a skipped key group, dimension tile or last row block, or rows mixed up within
    a register block, would leave NaN or move the mean error by orders of magnitude."""
    lens = [q + c for q, c in zip(PARTIAL_Q_LENS, PARTIAL_CACHED)]
    case = make_paged_case(lens, num_kv_heads, head_dim, 16, torch.bfloat16, seed=head_dim)
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(sum(PARTIAL_Q_LENS), num_kv_heads * ratio, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    cpu_native.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables,
        cu_seqlens(PARTIAL_Q_LENS), case.seq_lens, scale, out=out, amx_min_rows=16,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    assert_contract(out, case, query, PARTIAL_Q_LENS, scale)
    oracle = dense_prefill(case, query.bfloat16().float(), PARTIAL_Q_LENS, scale)
    assert (out.double() - oracle).abs().max().item() < AMX_ATOL


def test_queries_round_to_nearest_even():
    """The path rounds Q as torch's ``.bfloat16()`` does (nearest even): the same bits from
    the fp32 queries as from their bf16 values."""
    case = make_paged_case([90, 40], 3, 64, 16, torch.bfloat16, seed=2)
    query = torch.randn(70, 9, 64)
    rounded = query.bfloat16().float()
    assert not torch.equal(query, rounded)
    assert torch.equal(
        attend(query, case, [50, 20], 0.125, 16), attend(rounded, case, [50, 20], 0.125, 16)
    )


def _near_half_ulp_exps() -> list[float]:
    """bf16 scores x in [-3.1, -0.08) whose exp(x) in fp32 lies well inside the upper half between two bf16
    values: nearest-even rounds it up, truncation down, and 1-2 ulp of fp32 exp error cannot
    move it across."""
    xs = (torch.arange(-400, -10).double() / 128).bfloat16().double().unique()
    low = torch.exp(xs).float().view(torch.int32) & 0xFFFF
    return xs[(low > 0x9000) & (low < 0xF000)][:16].tolist()


def test_probabilities_round_to_nearest_even_and_divide_by_the_unrounded_sum():
    """Two keys, the first with score 0 (P = 1) and the second with score x: the second row
    of the chunk must give exactly bf16(exp(x)) / (1 + exp(x)) in dimension 1, the first row
    exactly V[0] (P = 1 and nothing past its causal limit)."""
    xs = _near_half_ulp_exps()
    assert len(xs) == 16
    head_dim = 64
    case = make_paged_case([2] * 16, 1, head_dim, 16, torch.bfloat16, seed=0)
    query = torch.zeros(32, 1, head_dim)
    query[:, 0, 0] = 1.0
    for s, x in enumerate(xs):
        k = torch.zeros(2, 1, head_dim)
        k[1, 0, 0] = x
        v = torch.zeros(2, 1, head_dim)
        v[0, 0, 0] = v[1, 0, 1] = 1.0
        block = case.block_tables[s, 0]
        case.key_cache[block, :2] = k.bfloat16()
        case.value_cache[block, :2] = v.bfloat16()
    out = attend(query, case, [2] * 16, 1.0, 2)
    e = torch.exp(torch.tensor(xs, dtype=torch.float64)).float()
    expected = e.bfloat16().float() * (1.0 / (1.0 + e))
    truncated = (e.view(torch.int32) & ~0xFFFF).view(torch.float32) * (1.0 / (1.0 + e))
    second = out[1::2, 0, 1]
    torch.testing.assert_close(second, expected, rtol=2e-7, atol=0)
    assert ((second - truncated).abs() > 1e-3 * expected).all()
    first = out[0::2, 0]
    assert torch.equal(first, torch.eye(head_dim)[0].expand(16, head_dim))


@pytest.mark.parametrize("ratio", [1, 3, 4])
def test_rows_keep_their_bits_whatever_the_batch_and_threads(ratio):
    """Each chunk's rows alone (one thread) and in a batch with other chunks, decodes and a
    chunk below the threshold (two and three threads): the same bits."""
    q_lens = [97, 1, 33, 17, 130, 5, 64]
    lens = [97, 80, 50, 17, 200, 30, 70]
    case = make_paged_case(lens, 2, 64, 16, torch.bfloat16, seed=ratio)
    query = torch.randn(sum(q_lens), 2 * ratio, 64)
    saved = torch.get_num_threads()
    try:
        batches = []
        for threads in (2, 3):
            torch.set_num_threads(threads)
            batches.append(attend(query, case, q_lens, 0.125, 16))
        torch.set_num_threads(1)
        start = 0
        for s, q_len in enumerate(q_lens):
            if q_len >= 16:
                alone = cpu_native.paged_attention(
                    query[start : start + q_len], case.key_cache, case.value_cache,
                    case.block_tables[s : s + 1], cu_seqlens([q_len]), case.seq_lens[s : s + 1],
                    0.125, amx_min_rows=16,
                )  # fmt: skip
                for batch in batches:
                    assert torch.equal(batch[start : start + q_len], alone), (s, q_len)
            start += q_len
    finally:
        torch.set_num_threads(saved)


def test_env_switches(tmp_path):
    """``PAGEDSERVE_CPU_AMX_ATTENTION`` (read once per process) sets min_rows or turns the path
    off; ``PAGEDSERVE_CPU_AMX=0`` keeps it on, on AVX512-BF16 register tiles (the same bits
    as in this process where AMX is not chosen here either)."""
    lens, q_lens = [70, 40], [50, 40]
    case = make_paged_case(lens, 3, 64, 16, torch.bfloat16, seed=4)
    query = torch.randn(90, 9, 64)
    torch.save((case, query), tmp_path / "case.pt")
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from paged_kv_testlib import cu_seqlens\n"
        "from pagedserve.kernels import cpu_native as c\n"
        f"case, query = torch.load({str(tmp_path / 'case.pt')!r}, weights_only=False)\n"
        "out = c.paged_attention(query, case.key_cache, case.value_cache, case.block_tables,\n"
        f"    cu_seqlens({q_lens}), case.seq_lens, 0.125)\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"
        "print(c.amx_attention_min_rows(), c.amx_chosen())\n"
    )

    def run(**env: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, str(script)], env={**os.environ, "PYTHONPATH": ROOT, **env},
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return done.stdout.split()

    def same_as(min_rows: int) -> bool:
        out = torch.load(tmp_path / "out.pt")
        return torch.equal(out, attend(query, case, q_lens, 0.125, min_rows))

    assert run(PAGEDSERVE_CPU_AMX_ATTENTION="0")[0] == "0" and same_as(0)
    assert run(PAGEDSERVE_CPU_AMX_ATTENTION="off")[0] == "0" and same_as(0)
    # 45 rows: the 50-row chunk on tiles, not the 40-row one
    assert run(PAGEDSERVE_CPU_AMX_ATTENTION="45")[0] == "45" and same_as(45)
    assert run(PAGEDSERVE_CPU_AMX="0", PAGEDSERVE_CPU_AMX_ATTENTION="") == ["16", "False"]
    assert_contract(torch.load(tmp_path / "out.pt"), case, query, q_lens, 0.125)
    if not cpu_native.amx_chosen():
        assert same_as(16)
