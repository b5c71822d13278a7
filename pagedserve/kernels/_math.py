"""Integer helpers shared by the kernel modules (pure Python: no torch, no Triton)."""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for a positive ``b`` (same as ``triton.cdiv``)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()
