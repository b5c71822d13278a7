"""A Llama-family causal LM in plain torch whose attention runs on the paged KV cache.

The model takes a flat batch of tokens from many sequences (prefill chunks and decodes
mixed) and returns logits only for the rows the sampler needs. Sequence structure (block
tables, lengths, slots) arrives in an explicit :class:`AttentionMetadata`.

Per decoder layer (Touvron et al., 2023, "LLaMA", sec. 2.2; pre-norm residual blocks)::

    h = x + o_proj(paged_attention(rope(q), rope(k), v))   q, k, v = qkv_proj(rmsnorm(x))
    y = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))

with grouped-query attention (Ainslie et al., 2023) and rotary position embeddings (Su et
al., 2021). q/k/v and gate/up projections are fused into single matmuls at load time
(:mod:`pagedserve.worker.weights`), as in vLLM's model implementations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.worker.arch import ModelArch
from pagedserve.worker.attention import AttentionMetadata, paged_attention
from pagedserve.worker.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, RoPE and the paged KV cache."""

    def __init__(self, arch: ModelArch, backend: str) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; stores the step's K/V into ``kv_cache``."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.backend)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm SwiGLU block, both residual."""

    def __init__(self, arch: ModelArch, backend: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLUMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus LM head, over a flat token batch and a paged KV cache.

    Parameter names follow HF's with ``model.`` dropped and q/k/v, gate/up fused
    (``layers.{i}.self_attn.qkv_proj``, ``layers.{i}.mlp.gate_up_proj``). With tied
    embeddings there is no ``lm_head`` module: logits use ``embed_tokens.weight``.

    Args:
        arch: architecture facts.
        max_positions: size of the RoPE table (the serving ``max_model_len``).
        backend: attention kernel backend (``"auto"``, ``"torch"``, ``"triton"``).
    """

    def __init__(self, arch: ModelArch, max_positions: int, backend: str = "auto") -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, backend) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        )
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        attn_metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step and return next-token logits for the selected rows.

        Args:
            input_ids: int64 ``[T]`` token ids of the flat batch.
            positions: int64 ``[T]`` position of each token in its sequence
                (``< max_positions``).
            kv_caches: per layer ``(key_cache, value_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype;
                the step's K/V are written into them.
            attn_metadata: slots, block tables and lengths of the step.
            logits_indices: int64 ``[num_out]`` rows of the batch whose logits are wanted
                (usually the last token of each sequence that samples).

        Returns:
            fp32 logits ``[num_out, vocab_size]``.

        Raises:
            ValueError: when ``kv_caches`` does not have one entry per layer, or from the
                kernels on shape/dtype mismatches.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, attn_metadata)
        return self.compute_logits(h.index_select(0, logits_indices))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head: ``[N, hidden]`` -> fp32 ``[N, vocab_size]``."""
        hidden = self.norm(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
