"""Building blocks of a Llama-family decoder in plain torch: RMSNorm, RoPE, SwiGLU MLP.

Every function works on a flat batch of tokens (no batch/sequence axes): hidden states are
``[num_tokens, hidden_size]`` and per-head tensors ``[num_tokens, num_heads, head_dim]``.
The arithmetic follows the Hugging Face Llama implementation operation by operation
(fp32 normalization, rotate-half RoPE with fp32 angles), so fp32 results match it to
rounding.

Sources: Llama (Touvron et al., 2023, "LLaMA: Open and Efficient Foundation Language
Models", sec. 2.2); RMSNorm (Zhang & Sennrich, 2019); RoPE (Su et al., 2021, "RoFormer",
sec. 3.4); SwiGLU (Shazeer, 2020); Llama 3 RoPE scaling (Meta, Llama 3.1 release, the
``apply_scaling`` of its reference code).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

SUPPORTED_ROPE_TYPES = ("default", "llama3")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``w * x / sqrt(mean(x**2) + eps)``.

    The statistic is computed in fp32 and the result cast back before the weight multiply
    (as HF Llama does). Input ``[..., hidden]`` of any float dtype; output same shape/dtype.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, rope_parameters: Mapping[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d)`` for i < d/2, with optional Llama 3 scaling.

    Args:
        head_dim: rotary dimension ``d`` (must be even).
        rope_parameters: the config's ``rope_parameters`` dict: ``rope_theta``,
            ``rope_type`` ("default" or "llama3"), and for "llama3" ``factor``,
            ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``.

    Returns:
        fp32 tensor ``[head_dim // 2]`` in radians per position.

    Raises:
        ValueError: for an odd head_dim, a missing theta, a partial rotary factor, an
            unsupported rope_type or missing llama3 keys.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = rope_parameters.get("rope_theta")
    if theta is None:
        raise ValueError("rope_parameters lacks rope_theta")
    if float(rope_parameters.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_parameters)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling.

    Wavelengths shorter than ``original_len / high_freq_factor`` are kept, those longer
    than ``original_len / low_freq_factor`` are divided by ``factor``, and the band in
    between is interpolated linearly in ``original_len / wavelength``.
    """
    try:
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        original_len = float(params["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"llama3 rope_parameters lacks {exc.args[0]!r}") from None
    if high <= low:
        raise ValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high}, {low}")
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_len / low
    short_wave = wavelen < original_len / high
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin table for positions ``[0, max_positions)``.

    The table is computed once in fp32 (``angle = position * inv_freq``, duplicated across
    the two halves of the head as in the rotate-half convention) and looked up by
    position at each forward.
    """

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, rope_parameters: Mapping[str, Any]
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, rope_parameters)  # fp32 [head_dim // 2], CPU
        shape = (max_positions, head_dim)
        self.register_buffer("cos_table", torch.empty(shape), persistent=False)
        self.register_buffer("sin_table", torch.empty(shape), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the fp32 tables on the buffers' device.

        Called at construction and again after a model built on the ``meta`` device is
        materialized with ``to_empty``, which leaves buffers uninitialized.
        """
        if self.cos_table.is_meta:
            return
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        angles = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        with torch.no_grad():
            self.cos_table.copy_(emb.cos())
            self.sin_table.copy_(emb.sin())

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, head_dim]`` in ``dtype`` for int64 ``positions [T]``."""
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the angles in ``cos``/``sin [T, 1, D]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    ``gate_up_proj.weight`` is ``[2 * intermediate, hidden]``: the HF ``gate_proj`` rows
    followed by the ``up_proj`` rows (see ``LlamaForCausalLM.load_weights``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
