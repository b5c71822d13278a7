"""The bf16-pair packed CPU GEMM (``pagedserve/kernels/csrc/cpu_gemm_bf16.c``) against torch on bf16-rounded
operands, its row (batch) invariance, its argument checks, and :class:`PackedLinearBf16`'s
dispatch between it and oneDNN."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.kernels import cpu_native
from pagedserve.worker.packed_linear import PackedLinear, pack_linears
from pagedserve.worker.packed_linear_bf16 import (
    PackedLinearBf16,
    onednn_bf16_available,
    pack_head_bf16,
    packed_logits_bf16,
)

pytestmark = pytest.mark.skipif(
    not cpu_native.has_bf16_gemm(),
    reason="no AVX512-BF16 kernel: the CPU lacks avx512_bf16, the compiler does not target it, "
    "or the C kernels cannot be built",
)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 math on the bf16-rounded operands, as the kernel sees them (float64 sum)."""
    out = x.bfloat16().double() @ w.bfloat16().double().T
    return (out if b is None else out + b.double()).float()


def close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within fp32 rounding of a K-term sum: |err| <= K * 2^-24 * sum_k |x_k w_k| (+ |b|)."""
    ref = reference(x, w, b)
    scale = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    if b is not None:
        scale = scale + b.double().abs()
    bound = (x.shape[1] + 2) * 2.0**-24 * scale + 1e-30
    err = (out.double() - ref.double()).abs()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool((err <= bound).all()), float((err / bound).max())


def test_packed_layout_is_panels_of_bf16_pairs_zero_padded():
    width = cpu_native.bf16_panel_width()
    n, k = width + 3, 5  # a partial second panel; K odd, padded to 6
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    packed = cpu_native.pack_bf16_linear_weight(w).view(2, 3, width, 2)
    padded = torch.zeros(2 * width, 6)
    padded[:n, :k] = w
    want = padded.view(2, width, 3, 2).permute(0, 2, 1, 3).bfloat16()
    assert torch.equal(packed, want)
    assert torch.equal(packed[1, :, 3:], torch.zeros(3, width - 3, 2, dtype=torch.bfloat16))


def test_fp32_rounds_to_nearest_even_as_torch():
    """Weights and activations round as ``tensor.bfloat16()`` does, ties and NaN included."""
    specials = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38, float("inf"), float("nan"),
         1.0 + 2**-8 + 2**-20, 1e-3, -7.25],
    )  # fmt: skip
    k = specials.numel()
    gen = torch.Generator().manual_seed(1)
    w = torch.cat([specials[None, :], torch.randn(4, k, generator=gen)])
    packed = cpu_native.pack_bf16_linear_weight(w)
    width = cpu_native.bf16_panel_width()
    got = packed.view(1, -1, width, 2)[0, :, 0, :].reshape(-1)[:k]
    want = specials.bfloat16()
    assert torch.equal(got.view(torch.int16)[:5], want.view(torch.int16)[:5])
    assert torch.isnan(got[5]) and torch.equal(got[6:], want[6:])
    # activations: one-hot weights read back each rounded x exactly
    eye = torch.eye(k)
    x = specials.clone()
    x[5] = 0.5  # keep NaN out of every output
    x[4] = 2.0
    out = cpu_native.linear_packed_bf16(x[None], cpu_native.pack_bf16_linear_weight(eye), k)
    assert torch.equal(out[0], x.bfloat16().float())


# M covers the micro-kernels (1-8 rows; 1, 2 and 4 panels at once), row-block tails and more
# than one outer block of 256 rows; N a partial last panel; K odd and even.
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 13), (100, 64), (250, 97), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_packed_bf16_matches_torch(m: int, n: int, k: int, bias: bool):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    out = cpu_native.linear_packed_bf16(x, cpu_native.pack_bf16_linear_weight(w), n, b)
    assert out.is_contiguous()
    close(out, x, w, b)
    torch.testing.assert_close(out, F.linear(x.bfloat16().float(), w.bfloat16().float(), b))


def test_bf16_input_strided_rows_and_bf16_weight_give_the_same_bits():
    gen = torch.Generator().manual_seed(3)
    m, n, k = 9, 130, 75
    base = torch.randn(m, k + 11, generator=gen)
    x = base[:, 4 : 4 + k]  # strided rows
    w = torch.randn(n, k, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(w)
    out = cpu_native.linear_packed_bf16(x, packed, n)
    close(out, x, w, None)
    assert torch.equal(packed, cpu_native.pack_bf16_linear_weight(w.bfloat16()))
    assert torch.equal(out, cpu_native.linear_packed_bf16(x.contiguous(), packed, n))
    assert torch.equal(out, cpu_native.linear_packed_bf16(x.bfloat16(), packed, n))


def test_rows_do_not_depend_on_the_batch_bitwise():
    gen = torch.Generator().manual_seed(0)
    k, n = 576, 960
    x = torch.randn(70, k, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(torch.randn(n, k, generator=gen) * 0.05)
    full = cpu_native.linear_packed_bf16(x, packed, n)
    for start, stop in [(0, 1), (5, 6), (69, 70), (3, 5), (10, 14), (1, 9), (20, 53)]:
        part = cpu_native.linear_packed_bf16(x[start:stop].clone(), packed, n)
        assert torch.equal(part, full[start:stop]), (start, stop)


def test_bad_arguments_raise_value_error():
    w = torch.randn(10, 6)
    packed = cpu_native.pack_bf16_linear_weight(w)
    x = torch.randn(3, 6)
    bad_calls = [
        lambda: cpu_native.pack_bf16_linear_weight(torch.randn(10, 6, dtype=torch.float64)),
        lambda: cpu_native.pack_bf16_linear_weight(torch.randn(10)),
        lambda: cpu_native.linear_packed_bf16(x.double(), packed, 10),
        lambda: cpu_native.linear_packed_bf16(x[0], packed, 10),
        lambda: cpu_native.linear_packed_bf16(torch.randn(3, 8), packed, 10),
        lambda: cpu_native.linear_packed_bf16(x, packed, 10 + cpu_native.bf16_panel_width()),
        lambda: cpu_native.linear_packed_bf16(x, packed, 0),
        lambda: cpu_native.linear_packed_bf16(x, packed.float(), 10),
        lambda: cpu_native.linear_packed_bf16(x, packed, 10, torch.randn(9)),
        lambda: cpu_native.linear_packed_bf16(x, packed, 10, torch.randn(10).bfloat16()),
        lambda: PackedLinearBf16(nn.Linear(6, 10), onednn_min_rows=0),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_dispatches_by_rows_across_the_crossover(dtype: torch.dtype):
    """Below ``onednn_min_rows`` the packed kernel's bits; from it, oneDNN's bf16 result
    (bf16 output rounding: within 2^-8 relative) plus the fp32 bias."""
    torch.manual_seed(5)
    linear = nn.Linear(97, 130, bias=True).to(dtype)
    layer = PackedLinearBf16(linear, onednn_min_rows=8)
    w = linear.weight.detach().float()
    b = linear.bias.detach().float()
    x = torch.randn(2, 6, 97).to(dtype)  # 12 rows: oneDNN
    out = layer(x)
    assert out.shape == (2, 6, 130) and out.dtype == torch.float32
    ref = reference(x.reshape(12, 97).float(), w, b).view(2, 6, 130)
    if onednn_bf16_available():
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-7)
    small = x.reshape(12, 97)[:7]  # 7 rows: the packed kernel, exact bits
    kernel = cpu_native.linear_packed_bf16(small, layer.packed, 130, b)
    assert torch.equal(layer(small), kernel)
    close(kernel, small.float(), w, b)
    only_kernel = PackedLinearBf16(linear, onednn_min_rows=None)
    assert torch.equal(only_kernel(x).view(12, 130)[:7], kernel)
    with pytest.raises(ValueError):
        layer(torch.randn(12, 96))


def test_pack_linears_bf16_replaces_every_linear_and_keeps_the_math():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5, bias=False))
    x = torch.randn(4, 20)
    want = model(x)
    assert pack_linears(model, dtype=torch.bfloat16) == 2
    assert isinstance(model[0], PackedLinearBf16) and isinstance(model[2], PackedLinearBf16)
    torch.testing.assert_close(model(x), want, rtol=0.05, atol=0.05)
    fp32 = nn.Sequential(nn.Linear(4, 4))
    assert pack_linears(fp32) == 1 and isinstance(fp32[0], PackedLinear)


def test_pack_linears_refuses_what_it_cannot_take_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).half())
    with pytest.raises(ValueError):
        pack_linears(model, dtype=torch.bfloat16)
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError):
        pack_linears(nn.Sequential(nn.Linear(4, 4).bfloat16()))  # fp32 packing
    with pytest.raises(ValueError):
        pack_linears(model, dtype=torch.float16)


def test_bf16_head_gives_its_fp32_sums_rounded_to_bf16():
    gen = torch.Generator().manual_seed(2)
    vocab, hidden = 1000, 64
    weight = torch.randn(vocab, hidden, generator=gen).bfloat16()
    packed = pack_head_bf16(weight)
    h = torch.randn(3, hidden, generator=gen)
    logits = packed_logits_bf16(h, packed, vocab)
    assert logits.shape == (3, vocab) and logits.dtype == torch.float32
    sums = cpu_native.linear_packed_bf16(h, packed, vocab)
    close(sums, h, weight.float(), None)
    assert not torch.equal(logits, sums)
    assert torch.equal(logits, sums.to(torch.bfloat16).float())


needs_amx = pytest.mark.skipif(
    not cpu_native.has_amx(),
    reason="no AMX kernel: the CPU lacks amx_tile/amx_bf16, the compiler does not target "
    "them, or Linux refused the tile state",
)
KERNELS = [pytest.param("amx", marks=needs_amx), "avx512"]


# M: a one-row tile, partial and whole 16-row tiles, tails past 16, more than one 256-row
# block; N: partial 16-column tiles and panels; K: whole 32-value tile steps (576, 1536), a
# partial last step (100: 50 pairs = 3 steps + 2 pairs), odd and under one step (31).
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 2, 3, 15, 16, 17, 33, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(49, 576), (130, 1536), (577, 100), (17, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_matches_torch(kernel: str, m: int, n: int, k: int, bias: bool):
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    packed = cpu_native.pack_bf16_linear_weight(w)
    out = cpu_native.linear_packed_bf16(x, packed, n, b, kernel=kernel)
    close(out, x, w, b)
    torch.testing.assert_close(out, F.linear(x.bfloat16().float(), w.bfloat16().float(), b))


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_takes_strided_and_bf16_rows_with_the_same_bits(kernel: str):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 21, 100, 99
    x = torch.randn(m, k + 9, generator=gen)[:, 5 : 5 + k]
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(w)
    out = cpu_native.linear_packed_bf16(x, packed, n, b, kernel=kernel)
    close(out, x, w, b)
    assert torch.equal(
        out, cpu_native.linear_packed_bf16(x.contiguous(), packed, n, b, kernel=kernel)
    )
    assert torch.equal(
        out, cpu_native.linear_packed_bf16(x.bfloat16(), packed, n, b, kernel=kernel)
    )


@pytest.mark.skipif(not cpu_native.has_amx(), reason="no AMX tiles")
@pytest.mark.parametrize("m", [32, 47, 64, 80, 161])
def test_amx_reads_bf16_rows_in_place_with_the_copys_bits(m: int) -> None:
    """K a multiple of 32 and bf16 rows: the whole 32-row blocks are read from x itself
    (strided rows too), the rest from the padded scratch; the bits are those of the fp32 rows
    (always converted into the scratch), the row results independent of M."""
    gen = torch.Generator().manual_seed(m)
    k, n = 96, 64
    wide = torch.randn(m, k + 32, generator=gen)
    x = wide[:, 16 : 16 + k]  # row stride k + 32
    w = torch.randn(n, k, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(w)
    want = cpu_native.linear_packed_bf16(x.bfloat16().float(), packed, n, kernel="amx")
    close(want, x.bfloat16().float(), w, None)
    xb = wide.bfloat16()[:, 16 : 16 + k]
    assert xb.stride(0) == k + 32
    assert torch.equal(cpu_native.linear_packed_bf16(xb, packed, n, kernel="amx"), want)
    assert torch.equal(cpu_native.linear_packed_bf16(xb[5:], packed, n, kernel="amx"), want[5:])
    gate_up = cpu_native.pack_bf16_linear_weight(torch.cat([w, w.flip(0)]))
    act = cpu_native.linear_packed_bf16_silu_mul(xb, gate_up, n)
    assert act is not None
    ref = cpu_native.silu_mul(torch.cat([want, want.flip(1)], 1)).bfloat16()
    assert torch.equal(act.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_is_batch_invariant_bitwise(kernel: str):
    """Row i's bits are the same alone and in batches of 5, 16, 17, 64 and 300 rows."""
    gen = torch.Generator().manual_seed(9)
    k, n = 1536, 200
    x = torch.randn(300, k, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(torch.randn(n, k, generator=gen) * 0.03)
    b = torch.randn(n, generator=gen)
    rows = (0, 1, 4, 15, 16, 17, 63, 64, 95, 150, 236, 283, 299)
    alone = {
        i: cpu_native.linear_packed_bf16(x[i : i + 1], packed, n, b, kernel=kernel) for i in rows
    }
    for size in (5, 16, 17, 64, 300):
        for start in (0, 300 - size, (300 - size) // 3):
            part = cpu_native.linear_packed_bf16(
                x[start : start + size], packed, n, b, kernel=kernel
            )
            for i in rows:
                if start <= i < start + size:
                    assert torch.equal(part[i - start : i - start + 1], alone[i]), (size, start, i)


@needs_amx
def test_amx_partial_k_step_reads_nothing_past_its_panel():
    """K = 34 (17 pairs: one pair in the last step); the next panel holds inf weights, which
    a tile reading past the panel would turn into NaN (0 * inf) in the first panel's columns."""
    width = cpu_native.bf16_panel_width()
    gen = torch.Generator().manual_seed(6)
    k = 34
    w = torch.randn(2 * width, k, generator=gen)
    w[width:] = float("inf")
    x = torch.randn(3, k, generator=gen)
    out = cpu_native.linear_packed_bf16(
        x, cpu_native.pack_bf16_linear_weight(w), 2 * width, kernel="amx"
    )
    close(out[:, :width], x, w[:width], None)


@needs_amx
def test_auto_runs_amx_and_the_module_keeps_one_copy():
    assert cpu_native.amx_chosen()  # PAGEDSERVE_CPU_AMX is not set in the test environment
    gen = torch.Generator().manual_seed(8)
    n, k = 130, 576
    x = torch.randn(40, k, generator=gen)
    linear = nn.Linear(k, n)
    packed = cpu_native.pack_bf16_linear_weight(linear.weight.detach())
    b = linear.bias.detach()
    amx = cpu_native.linear_packed_bf16(x, packed, n, b, kernel="amx")
    assert torch.equal(cpu_native.linear_packed_bf16(x, packed, n, b), amx)
    assert not torch.equal(cpu_native.linear_packed_bf16(x, packed, n, b, kernel="avx512"), amx)
    layer = PackedLinearBf16(linear)
    assert layer.onednn_min_rows is None and layer._onednn is None
    assert torch.equal(layer(x), amx)


def test_unknown_kernel_raises_value_error():
    packed = cpu_native.pack_bf16_linear_weight(torch.randn(10, 6))
    with pytest.raises(ValueError, match="kernel"):
        cpu_native.linear_packed_bf16(torch.randn(2, 6), packed, 10, kernel="amx512")
    with pytest.raises(ValueError):
        PackedLinearBf16(nn.Linear(6, 10), onednn_min_rows="never")  # type: ignore[arg-type]


@needs_amx
def test_env_switch_keeps_auto_on_avx512(tmp_path):
    """PAGEDSERVE_CPU_AMX=0 (read once by the library) sends ``auto`` to AVX512-BF16."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch\n"
        "from pagedserve.kernels import cpu_native as c\n"
        "from pagedserve.worker.packed_linear_bf16 import default_onednn_min_rows\n"
        "x = torch.randn(20, 64); p = c.pack_bf16_linear_weight(torch.randn(50, 64))\n"
        "same = torch.equal(c.linear_packed_bf16(x, p, 50), c.linear_packed_bf16(x, p, 50, kernel='avx512'))\n"
        "print(c.has_amx(), c.amx_chosen(), same, default_onednn_min_rows())\n"
    )
    env = {**os.environ, "PAGEDSERVE_CPU_AMX": "0"}
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split() == ["True", "False", "True", "16"]


def _two_calls(
    x: torch.Tensor, packed: torch.Tensor, inter: int, bias: torch.Tensor | None, kernel: str
) -> torch.Tensor:
    """What the fused call must equal: the same kernel's GEMM, silu_mul, then bf16 rounding."""
    gate_up = cpu_native.linear_packed_bf16(x, packed, 2 * inter, bias, kernel=kernel)
    return cpu_native.silu_mul(gate_up).bfloat16()


# (m, k, inter, bias): odd K, a partial last K step (K = 40, 130: 20 / 65 pairs), rows not a
# multiple of the tile heights (16 / 32 on AMX, 4 on AVX512-BF16) nor of the 256-row block;
# every count above both kernels' row thresholds (AMX > 16, AVX512-BF16 >= 65)
FUSED_CASES = [(67, 64, 32, False), (133, 40, 64, True), (100, 576, 96, False),
               (300, 130, 160, True), (65, 31, 32, False)]  # fmt: skip
# AVX512-BF16 only: widths that are multiples of 16 but not of 48 (a unit of 1 or 2 column
# vectors, up columns that start inside a panel), 512+ rows (several row blocks)
FUSED_CASES_AVX512 = [(66, 64, 16, True), (70, 576, 1536, False), (69, 40, 48, True),
                      (65, 70, 80, False), (71, 96, 112, True), (519, 96, 32, False)]  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("m", "k", "inter", "bias"), FUSED_CASES)
def test_fused_gate_up_silu_mul_equals_the_two_calls_bitwise(
    kernel: str, m: int, k: int, inter: int, bias: bool
) -> None:
    """The fused epilogue's bf16 activations are the two calls' bits, for fp32 and bf16 x,
    and within bf16 rounding of silu(gate) * up of the float64 product."""
    check_fused(kernel, m, k, inter, bias)


@pytest.mark.parametrize(("m", "k", "inter", "bias"), FUSED_CASES_AVX512)
def test_fused_gate_up_avx512_covers_every_row_count_and_width(
    m: int, k: int, inter: int, bias: bool
) -> None:
    check_fused("avx512", m, k, inter, bias)


def check_fused(kernel: str, m: int, k: int, inter: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + k + inter)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(2 * inter, k, generator=gen) * 0.3
    b = torch.randn(2 * inter, generator=gen) if bias else None
    packed = cpu_native.pack_bf16_linear_weight(w)
    got = cpu_native.linear_packed_bf16_silu_mul(x, packed, inter, b, kernel=kernel)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (m, inter)
    want = _two_calls(x, packed, inter, b, kernel)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # and bf16 rows in give what their fp32 values give
    xb = x.bfloat16()
    again = cpu_native.linear_packed_bf16_silu_mul(xb, packed, inter, b, kernel=kernel)
    assert again is not None
    assert torch.equal(
        again.view(torch.int16), _two_calls(xb, packed, inter, b, kernel).view(torch.int16)
    )
    # the value itself: silu(gate) * up of the float64 product, within bf16 rounding
    ref = reference(x, w, b).double()
    act = F.silu(ref[:, :inter]) * ref[:, inter:]
    assert torch.allclose(got.double(), act, rtol=2**-7, atol=1e-4)


def test_fused_gate_up_avx512_swapped_halves_are_caught() -> None:
    """Gate and up are not interchangeable: silu(up) * gate is a different function, and a
    kernel that paired column vector t of gate with another vector of up would fail here."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(69, 64, generator=gen)
    w = torch.randn(2 * 80, 64, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(w)
    got = cpu_native.linear_packed_bf16_silu_mul(x, packed, 80, kernel="avx512")
    assert got is not None
    ref = reference(x, w, None).double()
    for cols in (slice(0, 16), slice(32, 48), slice(64, 80)):  # first, middle, last vectors
        want = F.silu(ref[:, :80][:, cols]) * ref[:, 80:][:, cols]
        assert torch.allclose(got[:, cols].double(), want, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_gate_up_rows_do_not_depend_on_the_batch(kernel: str) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 96, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(torch.randn(128, 96, generator=gen))
    whole = cpu_native.linear_packed_bf16_silu_mul(x, packed, 64, kernel=kernel)
    for lo, hi in ((37, 108), (229, 299), (3, 300)):
        part = cpu_native.linear_packed_bf16_silu_mul(x[lo:hi], packed, 64, kernel=kernel)
        assert whole is not None and part is not None
        assert torch.equal(whole[lo:hi].view(torch.int16), part.view(torch.int16))


def test_fused_gate_up_declines_what_it_does_not_cover() -> None:
    """AVX512-BF16: fewer than 65 rows, or a width not a multiple of 16; AMX: 16 rows or
    fewer, or a width not a multiple of 32: None (the caller runs two calls); a weight of
    another shape: ValueError; an unknown kernel: ValueError; AMX absent: RuntimeError."""
    gen = torch.Generator().manual_seed(3)
    packed = cpu_native.pack_bf16_linear_weight(torch.randn(96, 64, generator=gen))
    fused = cpu_native.linear_packed_bf16_silu_mul
    assert fused(torch.randn(65, 64), packed, 48, kernel="avx512") is not None
    assert fused(torch.randn(64, 64), packed, 48, kernel="avx512") is None
    packed40 = cpu_native.pack_bf16_linear_weight(torch.randn(80, 64, generator=gen))
    assert fused(torch.randn(70, 64), packed40, 40, kernel="avx512") is None
    if cpu_native.has_amx():
        assert fused(torch.randn(70, 64), packed, 48, kernel="amx") is None
        packed64 = cpu_native.pack_bf16_linear_weight(torch.randn(128, 64, generator=gen))
        assert fused(torch.randn(16, 64), packed64, 64, kernel="amx") is None
        assert fused(torch.randn(17, 64), packed64, 64, kernel="amx") is not None
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            fused(torch.randn(70, 64), packed40, 40, kernel="amx")
    with pytest.raises(ValueError):
        fused(torch.randn(70, 64), packed40, 64)
    with pytest.raises(ValueError, match="kernel"):
        fused(torch.randn(70, 64), packed40, 40, kernel="tiles")


def test_fused_mlp_env_switch_declines(tmp_path):
    """PAGEDSERVE_CPU_FUSED_MLP=0 (read once by the library): the fused call declines."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch\n"
        "from pagedserve.kernels import cpu_native as c\n"
        "p = c.pack_bf16_linear_weight(torch.randn(96, 64))\n"
        "x = torch.randn(70, 64)\n"
        "print(c.linear_packed_bf16_silu_mul(x, p, 48, kernel='avx512') is None)\n"
    )
    env = {**os.environ, "PAGEDSERVE_CPU_FUSED_MLP": "0"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["True"]


@pytest.mark.parametrize("k", [64, 70, 33])
def test_avx512_bf16_rows_in_place_or_copied_give_the_fp32_rows_bits(k: int) -> None:
    """bf16 x is read in place where its rows allow (even K, even row stride, 4-byte aligned)
    and copied otherwise (odd K, a view starting at an odd element): every layout gives the
    bits of the same values passed as fp32, in the GEMM and in the fused gate_up call."""
    gen = torch.Generator().manual_seed(k)
    wide = torch.randn(70, k + 8, generator=gen).bfloat16()
    w = torch.randn(2 * 48, k, generator=gen)
    packed = cpu_native.pack_bf16_linear_weight(w)
    layouts = {
        "contiguous": wide[:, :k].contiguous(),
        "row stride k + 8": wide[:, :k],
        "odd start": wide[:, 1 : k + 1],
    }
    for name, xb in layouts.items():
        xf = xb.float()
        got = cpu_native.linear_packed_bf16(xb, packed, 96, kernel="avx512")
        want = cpu_native.linear_packed_bf16(xf, packed, 96, kernel="avx512")
        assert torch.equal(got, want), name
        act = cpu_native.linear_packed_bf16_silu_mul(xb, packed, 48, kernel="avx512")
        act_f = cpu_native.linear_packed_bf16_silu_mul(xf, packed, 48, kernel="avx512")
        assert act is not None and act_f is not None
        assert torch.equal(act.view(torch.int16), act_f.view(torch.int16)), name
    close(got, layouts["odd start"].float(), w, None)
