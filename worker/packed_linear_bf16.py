"""Linear layers on bf16 weights for the bf16 CPU path (:class:`PackedLinearBf16`).

Each weight is rounded to bf16 once at load and packed into panels of bf16 pairs for
:func:`pagedserve.kernels.cpu_native.linear_packed_bf16`: fp32 or bf16 in, fp32 out, bf16
products summed in fp32 in an order fixed by K alone, so a row's result depends only on that
row (batch invariant). The kernel runs on AMX tiles (``TDPBF16PS``) where
:func:`~pagedserve.kernels.cpu_native.amx_chosen`, else on AVX512-BF16 (``VDPBF16PS``).

By default every call runs the packed kernel, from the one packed copy (2 bytes per
weight): on AMX it is faster than oneDNN's prepacked bf16 linear from 1 to 256 token rows and
level with it at 512 (``benchmarks/kernels/cpu_gemm_bf16.py``, benchmarks/RESULTS.md "Linear
layers in bf16"); on a CPU with AVX512-BF16 and no AMX, where oneDNN runs the same
``VDPBF16PS`` instructions, it is 1.45-1.6x faster at 1-16 rows, 1.33x at 32 and level at
256; oneDNN is 2-8% faster from 512 to 2048 rows, yet a whole 16 x 512 prefill on the fused C
call measured level with oneDNN's per-layer path, on one weight copy instead of two (RESULTS,
"On an AMD EPYC VM without AMX"). Where the CPU has AMX tiles the packed
kernel does not use (``PAGEDSERVE_CPU_AMX=0``, or a compiler without AMX), oneDNN still
does, and beats the AVX512-BF16 kernel from 16 rows up: there, by default, calls of
``M >= ONEDNN_MIN_ROWS`` rows run oneDNN's bf16 inner product on a second copy of
the weight reordered once (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``, what vLLM's CPU backend runs), x cast to bf16 first. Its output is bf16
(the op gives its input's dtype), cast back to fp32 (or kept, ``out_dtype=torch.bfloat16``),
the fp32 bias added after: it differs from the packed kernel by that rounding (relative
2^-9), and oneDNN chooses its blocking by shape, so that branch is **not** batch invariant.
:func:`default_onednn_min_rows` gives the default; ``onednn_min_rows=None`` keeps the packed
copy alone.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from pagedserve.kernels import cpu_native
from pagedserve.worker.precision import read_cpu_flags

# Token rows from which oneDNN's prepacked bf16 linear, running on AMX tiles, beats the
# AVX512-BF16 packed kernel (a CPU whose AMX the packed kernel does not use), over
# SmolLM2-135M's four layer shapes with weights from memory, 2 threads: that kernel is
# 1.05-1.4x oneDNN's speed at M = 1-8, even at 16, about half of it at 32 and beyond
# (benchmarks/kernels/cpu_gemm_bf16.py; benchmarks/RESULTS.md "Linear layers in bf16").
ONEDNN_MIN_ROWS = 16
# The batch size oneDNN is told when reordering a weight (it picks its layout by it): one
# reordered copy serves every M from the crossover up; the benchmark measures with it.
ONEDNN_BATCH_HINT = 128


def onednn_bf16_available() -> bool:
    """True when torch's oneDNN (mkldnn) is built in and runs bf16 on this CPU."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def default_onednn_min_rows(cpu_flags: frozenset[str] | None = None) -> int | None:
    """``onednn_min_rows`` of :class:`PackedLinearBf16` by default: :data:`ONEDNN_MIN_ROWS`
    where the CPU has AMX tiles (``amx_bf16`` among ``cpu_flags``, default
    :func:`~pagedserve.worker.precision.read_cpu_flags`) that the packed kernel does not
    run on (:func:`cpu_native.amx_chosen` false): oneDNN uses them. ``None`` (the packed
    kernel for every M) where the packed kernel runs on AMX, and on CPUs without AMX, where
    both run AVX512-BF16 (module docstring: the packed kernel ahead to 256 rows, oneDNN
    2-8% ahead from 512, a whole prefill level)."""
    if cpu_native.amx_chosen():
        return None
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    return ONEDNN_MIN_ROWS if "amx_bf16" in flags else None


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """:func:`read_cpu_flags`, read once per process (every layer asks)."""
    return read_cpu_flags()


class PackedLinearBf16(nn.Module):
    """``bf16(x) @ bf16(W).T + b`` with fp32 accumulation and fp32 output (or bf16, see
    :meth:`forward`), on CPU.

    Args:
        linear: the ``nn.Linear`` to replace (fp32 or bf16 weight, on CPU); the weight is
            rounded to bf16 (nearest even) and packed, the bias kept in fp32.
        onednn_min_rows: rows from which the call runs on oneDNN (see the module
            docstring); ``None`` never does (one bf16 copy of the weight, every call
            batch invariant); ``"auto"``: :func:`default_onednn_min_rows`. Ignored
            (``None``) where oneDNN has no bf16.

    Raises:
        ValueError: a weight that is not 2-D fp32/bf16 on CPU, or ``onednn_min_rows < 1``.
        RuntimeError: no AVX512-BF16 kernel (:func:`cpu_native.has_bf16_gemm`).
    """

    def __init__(
        self, linear: nn.Linear, onednn_min_rows: int | Literal["auto"] | None = "auto"
    ) -> None:
        super().__init__()
        if onednn_min_rows == "auto":
            onednn_min_rows = default_onednn_min_rows()
        if isinstance(onednn_min_rows, str) or (
            onednn_min_rows is not None and onednn_min_rows < 1
        ):
            raise ValueError(
                f"onednn_min_rows must be >= 1, None or 'auto', got {onednn_min_rows!r}"
            )
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed = cpu_native.pack_bf16_linear_weight(weight)
        self.packed: torch.Tensor
        self.register_buffer("packed", packed)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if onednn_min_rows is not None and not onednn_bf16_available():
            onednn_min_rows = None
        self.onednn_min_rows = onednn_min_rows
        # oneDNN's reordered weight is an opaque mkldnn tensor: an attribute, not a buffer
        # (state_dict and .to() cannot handle it).
        self._onednn = (
            None
            if onednn_min_rows is None
            else torch.ops.mkldnn._reorder_linear_weight(
                weight.to(torch.bfloat16).contiguous(), ONEDNN_BATCH_HINT
            )
        )
        # The per-call path reads plain attributes (see PackedLinear).
        self._fast = (cpu_native.linear_packed_bf16_fn(), packed, bias)

    def runs_onednn(self, rows: int) -> bool:
        """Whether a call of ``rows`` token rows runs on oneDNN (else the packed kernel)."""
        return self._onednn is not None and rows >= self.onednn_min_rows  # type: ignore[operator]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fp32 or bf16 ``[..., in_features]`` -> ``[..., out_features]`` of ``out_dtype``.

        Args:
            out_dtype: ``torch.float32`` (the fp32 sums, bias added in fp32), or
                ``torch.bfloat16``: those rounded to nearest even. On oneDNN without a bias
                that is the op's own bf16 output, no fp32 copy made (for a bf16 consumer
                such as :func:`cpu_native.silu_mul`).

        Raises:
            ValueError: ``x`` not fp32/bf16 on CPU or its last dimension not
                ``in_features``; ``out_dtype`` neither fp32 nor bf16.
        """
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        n = self.out_features
        flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        m = flat.shape[0]
        if self.runs_onednn(m):
            if (
                flat.dtype not in (torch.float32, torch.bfloat16)
                or flat.shape[1] != self.in_features
            ):
                raise ValueError(
                    f"x must be fp32 or bf16 [..., {self.in_features}], got {flat.dtype} "
                    f"{tuple(x.shape)}"
                )
            out = torch.ops.mkldnn._linear_pointwise(
                flat.to(torch.bfloat16), self._onednn, None, "none", [], ""
            )
            if out_dtype is torch.bfloat16 and self.bias is None:
                return out.view(*x.shape[:-1], n)
            out = out.float()
            if self.bias is not None:
                out.add_(self.bias)
        elif (
            flat.dtype in (torch.float32, torch.bfloat16)
            and flat.stride(1) == 1
            and flat.shape[1] == self.in_features
            and m > 0
        ):  # the serving path: checked once here
            fn, packed, bias = self._fast
            out = torch.empty((m, n), dtype=torch.float32)
            if fn(
                flat.data_ptr(), int(flat.dtype is torch.bfloat16), m, self.in_features,
                flat.stride(0), packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
                out.data_ptr(), n, torch.get_num_threads(),
            ):  # fmt: skip
                raise RuntimeError(f"linear_packed_bf16: no memory for {m} activation rows")
        else:
            out = cpu_native.linear_packed_bf16(flat, self.packed, n, self._fast[2])
        if out_dtype is torch.bfloat16:
            out = out.to(torch.bfloat16)
        return out.view(*x.shape[:-1], n)

    def pointer_tensors(self, name: str) -> dict[str, torch.Tensor | None]:
        """``{name: packed bf16 weight, name_bias: fp32 bias or None}``, for a C caller of
        ``linear_packed_bf16`` (``csrc/cpu_gemm_bf16.c``)."""
        _, packed, bias = self._fast
        return {name: packed, f"{name}_bias": bias}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bf16 packed, "
            f"onednn_min_rows={self.onednn_min_rows}"
        )


def pack_head_bf16(weight: torch.Tensor) -> torch.Tensor:
    """An LM head's ``weight [vocab_size, hidden]`` (fp32 or bf16, CPU) packed for
    :func:`packed_logits_bf16` (:func:`cpu_native.pack_bf16_linear_weight`; one bf16 copy:
    the head runs on one row per sequence, below the oneDNN crossover in decode).

    Raises:
        ValueError: a weight that is not 2-D fp32/bf16 on CPU.
        RuntimeError: no AVX512-BF16 kernel.
    """
    return cpu_native.pack_bf16_linear_weight(weight)


def packed_logits_bf16(
    hidden: torch.Tensor, packed_head: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """LM-head logits ``bf16(bf16(hidden) @ bf16(W).T)`` from a head packed by
    :func:`pack_head_bf16`: fp32 or bf16 ``[N, hidden]`` -> fp32 ``[N, vocab_size]`` holding
    bf16 values (batch invariant). The GEMM's fp32 sums are rounded to bf16 in place
    (:func:`cpu_native.round_to_bf16_`): the logits of a bf16 ``nn.Linear`` head, which
    HF transformers and vLLM return in bf16.

    Raises:
        ValueError: shapes or dtypes that do not match the packed head.
    """
    logits = cpu_native.linear_packed_bf16(hidden, packed_head, vocab_size)
    return cpu_native.round_to_bf16_(logits)


__all__ = [
    "ONEDNN_BATCH_HINT",
    "ONEDNN_MIN_ROWS",
    "PackedLinearBf16",
    "default_onednn_min_rows",
    "onednn_bf16_available",
    "pack_head_bf16",
    "packed_logits_bf16",
]
