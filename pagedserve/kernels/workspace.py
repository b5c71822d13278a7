"""Preallocated scratch for the split-KV decode kernel (no Triton import here)."""

from __future__ import annotations

import torch

from pagedserve.kernels._math import next_pow2

__all__ = ["DecodeWorkspace"]


class DecodeWorkspace:
    """Scratch buffers for stage 1 of split-KV paged decode, allocated once.

    Passing the same workspace to every :func:`pagedserve.kernels.paged_decode_attention`
    call avoids per-call allocations and keeps buffer addresses fixed, which CUDA-graph
    capture needs (also pass ``max_seq_len`` so the split count does not depend on data).

    Attributes:
        part_out: fp32 ``[max_num_seqs, num_heads, max_splits, head_dim_pad]`` normalized
            partial outputs (``head_dim_pad`` = next power of two of ``head_dim``).
        part_lse: fp32 ``[max_num_seqs, num_heads, max_splits]`` per-split log-sum-exp
            (base 2, including the softmax scale).
    """

    def __init__(
        self,
        max_num_seqs: int,
        num_heads: int,
        head_dim: int,
        max_splits: int = 64,
        device: torch.device | str = "cuda",
    ) -> None:
        if min(max_num_seqs, num_heads, head_dim, max_splits) < 1:
            raise ValueError("DecodeWorkspace sizes must all be >= 1")
        self.max_num_seqs = int(max_num_seqs)
        self.num_heads = int(num_heads)
        self.head_dim = int(head_dim)
        self.max_splits = int(max_splits)
        dim_pad = max(16, next_pow2(head_dim))
        self.part_out = torch.empty(
            max_num_seqs, num_heads, max_splits, dim_pad, dtype=torch.float32, device=device
        )
        self.part_lse = torch.empty(
            max_num_seqs, num_heads, max_splits, dtype=torch.float32, device=device
        )

    def fits(self, num_seqs: int, num_heads: int, head_dim: int, device: torch.device) -> bool:
        """Whether a call with these sizes can use this workspace."""
        return (
            num_seqs <= self.max_num_seqs
            and num_heads == self.num_heads
            and head_dim == self.head_dim
            and self.part_out.device == device
        )
