"""The fp8 e4m3 KV-cache format: constants and the torch quantise / dequantise rules.

An fp8 KV cache holds ``torch.float8_e4m3fn`` elements (OCP FP8 E4M3, "fn": finite, no
infinities, NaN = ``0x7f``/``0xff``; largest finite +-448, smallest subnormal 2**-9), the
format of vLLM's ``--kv-cache-dtype fp8`` / ``fp8_e4m3``. A stored element is
``q = fp8_rne(clamp(x / scale, -448, 448))`` (round to nearest even, saturated; NaN stays
NaN) and reads back as ``float(q) * scale``, with one fp32 ``scale`` per layer for K and
one for V (vLLM's per-tensor ``k_scale`` / ``v_scale``, 1.0 when a checkpoint carries
none). These functions are the reference every kernel's store and load is tested against
(the C and Triton stores give the same bytes).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
"""The element type of an fp8 KV cache."""

FP8_MAX = 448.0
"""The largest finite e4m3 magnitude: stores saturate to +-FP8_MAX."""

__all__ = ["FP8_DTYPE", "FP8_MAX", "check_scale", "dequantize", "is_fp8", "quantize"]


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 KV element type."""
    return dtype == FP8_DTYPE


def check_scale(name: str, scale: float) -> float:
    """``scale`` as a float.

    Raises:
        ValueError: ``scale`` is not a finite number ``> 0`` (the message names ``name``).
    """
    value = float(scale)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {scale!r}")
    return value


def quantize(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x`` (any float dtype) as fp8 e4m3 elements of ``x / scale``: computed in fp32,
    saturated to +-448, rounded to nearest even. Same shape as ``x``."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fp32 ``float(q) * scale`` of fp8 elements (exact for ``scale == 1``)."""
    return q.float() * scale
