"""The packed fp32 CPU GEMM (``pagedserve/kernels/csrc/cpu_gemm.c``) against a float64 reference, its
row (batch) invariance, and the model's linear layers moved onto it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.kernels import cpu_native
from pagedserve.worker.packed_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(
    not cpu_native.gemm_available(), reason="no C compiler: the CPU kernels cannot be built"
)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    bias = None if b is None else b.double()
    return F.linear(x.double(), w.double(), bias).float()


def test_packed_layout_is_panels_of_columns_zero_padded():
    width = cpu_native.panel_width()
    n, k = width + 3, 5
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    packed = cpu_native.pack_linear_weight(w).view(2, k, width)
    assert torch.equal(packed[0], w[:width].t())
    assert torch.equal(packed[1, :, :3], w[width:].t())
    assert torch.equal(packed[1, :, 3:], torch.zeros(k, width - 3))


# M covers every micro-kernel (1-8 rows; 1, 2 and 4 panels at once), a row-block tail and
# more than one outer block of 256 rows; N covers a partial last panel and a short group.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 300])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 13), (100, 64), (250, 96), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_packed_matches_float64(m: int, n: int, k: int, bias: bool):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    out = cpu_native.linear_packed(x, cpu_native.pack_linear_weight(w), n, b)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, reference(x, w, b), rtol=1e-5, atol=2e-5)


def test_rows_do_not_depend_on_the_batch_bitwise():
    """Each output element is one in-order sum over K: a row gives the same bits alone, at
    any position, and in a batch of any size."""
    gen = torch.Generator().manual_seed(0)
    k, n = 576, 960
    x = torch.randn(70, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    packed = cpu_native.pack_linear_weight(w)
    full = cpu_native.linear_packed(x, packed, n)
    for start, stop in [(0, 1), (5, 6), (69, 70), (3, 5), (10, 14), (1, 9), (20, 53), (0, 70)]:
        part = cpu_native.linear_packed(x[start:stop].clone(), packed, n)
        assert torch.equal(part, full[start:stop]), (start, stop)


@pytest.mark.parametrize("panels", [3, 5, 12, 13, 20])
def test_rows_and_threads_do_not_change_the_bits_when_panel_groups_shrink(panels: int):
    """One- to four-row calls take panels in groups, made smaller when the static split
    over threads would leave one idle (12 panels over 2 threads: groups of 2, not 4).
    Whatever the grouping, every element stays one in-order sum over K."""
    gen = torch.Generator().manual_seed(panels)
    n, k = panels * cpu_native.panel_width() - 5, 96
    x = torch.randn(9, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    packed = cpu_native.pack_linear_weight(w)
    saved = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            full = cpu_native.linear_packed(x, packed, n)
            for m in (1, 2, 3, 4):
                assert torch.equal(cpu_native.linear_packed(x[:m], packed, n), full[:m])
            outs.append(full)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(o, outs[0]) for o in outs)
    torch.testing.assert_close(outs[0], reference(x, w, None), rtol=1e-5, atol=2e-5)


def test_strided_rows_and_non_contiguous_weight():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 200, generator=gen)
    x = wide[:, 10:74]  # rows with stride 200
    w_t = torch.randn(64, 50, generator=gen)
    w = w_t.t()  # [50, 64], column stride 50: packed from a contiguous copy
    out = cpu_native.linear_packed(x, cpu_native.pack_linear_weight(w), 50)
    torch.testing.assert_close(out, reference(x, w, None), rtol=1e-5, atol=2e-5)
    empty = cpu_native.linear_packed(torch.empty(0, 64), cpu_native.pack_linear_weight(w), 50)
    assert empty.shape == (0, 50)


def test_bad_arguments_are_refused():
    w = torch.randn(10, 8)
    packed = cpu_native.pack_linear_weight(w)
    with pytest.raises(ValueError, match="2-D fp32 CPU"):
        cpu_native.pack_linear_weight(w.double())
    with pytest.raises(ValueError, match="2-D fp32 CPU"):
        cpu_native.pack_linear_weight(torch.randn(10))
    with pytest.raises(ValueError, match=r"does not hold a \[10, 9\]"):
        cpu_native.linear_packed(torch.randn(3, 9), packed, 10)
    wide = 2 * cpu_native.panel_width()  # more panels than were packed
    with pytest.raises(ValueError, match=rf"does not hold a \[{wide}, 8\]"):
        cpu_native.linear_packed(torch.randn(3, 8), packed, wide)
    with pytest.raises(ValueError, match="bias"):
        cpu_native.linear_packed(torch.randn(3, 8), packed, 10, torch.randn(9))
    with pytest.raises(ValueError, match="2-D"):
        cpu_native.linear_packed(torch.randn(2, 3, 8), packed, 10)


def test_pack_linears_replaces_every_linear_and_keeps_the_math():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 7, bias=False))
    x = torch.randn(3, 5, 16)
    want = model(x)
    assert pack_linears(model) == 2
    assert [type(m) for m in model] == [PackedLinear, nn.ReLU, PackedLinear]
    assert not hasattr(model[2], "weight")  # the row-major copy is gone
    got = model(x)
    assert got.shape == (3, 5, 7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pack_linears_refuses_non_fp32_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="fp32 CPU"):
        pack_linears(model)
    assert all(type(m) is nn.Linear for m in model)


# ------------------------------------------------ the register tile of each vector ISA
# The library is built with -march=native, so the suite above runs only this machine's
# tile. The source also has an AVX2 + FMA tile (8-float vectors, 4 rows per call) and a
# portable one (4-float vectors, multiply then add): each is built here from the same
# file at its x86-64 level and checked against float64 on this machine (a newer ISA runs
# the older code).
ISA_LEVELS = {"x86-64-v3": 24, "x86-64": 12}  # -march level -> panel width (3 vectors)


@pytest.fixture(scope="module", params=sorted(ISA_LEVELS))
def gemm_at_level(request, tmp_path_factory):
    import ctypes
    import platform
    import shutil
    import subprocess

    if platform.machine() != "x86_64":
        pytest.skip("the x86-64 ISA levels build only on x86_64")
    level = request.param
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no gcc")
    so = tmp_path_factory.mktemp("gemm") / f"gemm-{level}.so"
    flags = [f for f in cpu_native.CFLAGS if not f.startswith("-march")]
    subprocess.run(
        [compiler, *flags, f"-march={level}", str(cpu_native.CSRC / "cpu_gemm.c"), "-o", so],
        check=True,
        capture_output=True,
        timeout=120,
    )
    lib = ctypes.CDLL(str(so))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_panel_width.restype = i64
    lib.pack_weight_f32.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.linear_packed_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64]
    return level, lib


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 300])
@pytest.mark.parametrize(("n", "k"), [(7, 13), (100, 64), (250, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_isa_tile_matches_float64(gemm_at_level, m: int, n: int, k: int, threads: int):
    level, lib = gemm_at_level
    width = lib.gemm_panel_width()
    assert width == ISA_LEVELS[level]
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    packed = torch.empty(-(-n // width) * k * width)
    lib.pack_weight_f32(w.data_ptr(), n, k, k, packed.data_ptr(), threads)
    expected_layout = torch.zeros(-(-n // width) * width, k)
    expected_layout[:n] = w
    assert torch.equal(
        packed.view(-1, k, width), expected_layout.view(-1, width, k).transpose(1, 2)
    )
    for bias in (None, b):
        out = torch.full((m, n), float("nan"))
        lib.linear_packed_f32(
            x.data_ptr(), m, k, k, packed.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, threads,
        )  # fmt: skip
        torch.testing.assert_close(out, reference(x, w, bias), rtol=1e-5, atol=2e-5)
