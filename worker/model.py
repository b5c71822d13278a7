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

How a step runs the layers and the head is a :class:`ModelForward`, chosen once by the
model runner (:func:`pagedserve.worker.forward.select_forward`) and installed with
:meth:`LlamaForCausalLM.use_forward`; this module holds the generic one,
:class:`LayerForward` (the modules below, attention through the validated kernel API, any
device and dtype). The fused fp32 CPU forwards live in :mod:`pagedserve.worker.cpu_forward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve import kernels
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.attention import AttentionMetadata, paged_attention
from pagedserve.worker.batch_invariant import invariant_linear
from pagedserve.worker.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary
from pagedserve.worker.packed_linear import PackedLinear, pack_head, pack_linears, packed_logits
from pagedserve.worker.packed_linear_bf16 import (
    PackedLinearBf16,
    pack_head_bf16,
    packed_logits_bf16,
)

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
        checked: kernels.CheckedIndices | None = None,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; stores the step's K/V into ``kv_cache``.

        ``checked`` is the step's :func:`pagedserve.kernels.check_indices` result, passed
        to the kernels so that they do not validate the same indices again.
        """
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.backend, checked
        )
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
        checked: kernels.CheckedIndices | None = None,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (see :meth:`LlamaAttention.forward`)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, checked)
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
        self.backend = backend
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
        # Set by pagedserve.worker.batch_invariant.make_batch_invariant (fixed-shape
        # matmuls) or the runner (packed GEMM; the CPU forwards then attend per token).
        self.batch_invariant = False
        # Set by pack_weights: the tied LM head packed for the CPU GEMM (untied: lm_head
        # itself becomes a PackedLinear).
        self.packed_head: torch.Tensor | None = None
        self.model_forward: ModelForward = LayerForward()

    def use_forward(self, model_forward: ModelForward) -> None:
        """Run every later :meth:`forward` with ``model_forward`` (see
        :func:`pagedserve.worker.forward.select_forward`)."""
        self.model_forward = model_forward

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        attn_metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step and return next-token logits for the selected rows.

        The layers and the head run as :attr:`model_forward` says (:class:`LayerForward`
        until the runner installs its choice).

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
            ValueError: when ``kv_caches`` does not have one entry per layer, from
                :func:`pagedserve.kernels.check_indices` on slots, block tables or
                ``cu_seqlens_q`` that do not fit the caches, or from the kernels on
                shape/dtype mismatches.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        return self.model_forward(self, hidden, positions, kv_caches, attn_metadata, logits_indices)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head: ``[N, hidden]`` -> fp32 ``[N, vocab_size]``."""
        return self.lm_logits(self.norm(hidden)).float()

    def pack_weights(self) -> int:
        """Move every linear layer and the LM head to the packed CPU GEMM, in place; returns
        the layers packed.

        fp32 weights: :class:`~pagedserve.worker.packed_linear.PackedLinear`. bf16 weights:
        :class:`~pagedserve.worker.packed_linear_bf16.PackedLinearBf16` (fp32 out), the head
        packed in bf16, and the RMSNorm weights widened to fp32 (exactly: every bf16 is an
        fp32), since the CPU forwards keep the residual stream and the norms in fp32.

        Resets :attr:`model_forward` to :class:`LayerForward` (a forward built on the
        unpacked layers no longer applies): choose it again afterwards.

        Raises:
            ValueError: weights that are not fp32 or bf16 on CPU (nothing is packed then).
            RuntimeError: bf16 weights without the AVX512-BF16 kernel.
        """
        self.model_forward = LayerForward()
        dtype = self.embed_tokens.weight.dtype
        if dtype == torch.bfloat16:
            count = pack_linears(self, dtype=torch.bfloat16)
            if self.lm_head is None:
                self.packed_head = pack_head_bf16(self.embed_tokens.weight.detach())
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data = module.weight.data.float()
            return count
        if self.lm_head is None:
            self.packed_head = pack_head(self.embed_tokens.weight.detach())
        return pack_linears(self)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head alone on final-normed ``hidden [N, hidden]`` -> ``[N, vocab_size]``
        logits of the model dtype's precision (packed, tied, or batch-invariant tiles as
        configured; the packed heads return them in an fp32 tensor).

        The packed GEMMs sum in fp32: fp32 heads return those sums; bf16 heads return them
        rounded to bf16 (in an fp32 tensor; :func:`packed_logits_bf16`), the logits an
        unpacked bf16 head gives and HF transformers' and vLLM's bf16 heads return (greedy
        then takes the lowest id of a bf16 tie, as theirs does)."""
        if self.lm_head is not None:
            if isinstance(self.lm_head, PackedLinearBf16):
                return self.lm_head(hidden, out_dtype=torch.bfloat16).float()
            if isinstance(self.lm_head, PackedLinear):
                return self.lm_head(hidden)
            weight = self.lm_head.weight
        elif self.packed_head is not None:
            if self.packed_head.dtype == torch.bfloat16:
                return packed_logits_bf16(hidden, self.packed_head, self.arch.vocab_size)
            return packed_logits(hidden, self.packed_head, self.arch.vocab_size)
        else:
            weight = self.embed_tokens.weight
        if self.batch_invariant:
            return invariant_linear(hidden, weight)
        return F.linear(hidden, weight)


class ModelForward(Protocol):
    """How :meth:`LlamaForCausalLM.forward` runs the decoder layers and the head.

    Called with the model, the embeddings ``hidden [T, hidden]`` and the rest of
    :meth:`LlamaForCausalLM.forward`'s arguments (``kv_caches`` already matched to the
    layers); returns the fp32 logits ``[num_out, vocab_size]`` of the
    ``logits_indices`` rows. ``name`` identifies it (logs, tests).
    """

    @property
    def name(self) -> str: ...

    def __call__(
        self,
        model: LlamaForCausalLM,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerForward:
    """The generic forward: each :class:`LlamaDecoderLayer` in turn, attention through the
    validated kernel API (:mod:`pagedserve.kernels`: torch, Triton or the C attention
    kernel, per the layers' attention backend), then :meth:`LlamaForCausalLM.compute_logits`.

    Works for any device and dtype. The step's positions and attention indices are
    validated once (:func:`pagedserve.kernels.check_positions`,
    :func:`pagedserve.kernels.check_indices`; on CUDA each reads its result back, a sync at
    the start of the step) and the result handed to every layer's kernel calls.
    """

    name: str = "layers"

    def __call__(
        self,
        model: LlamaForCausalLM,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        kernels.check_positions(positions, model.rotary_emb.max_positions, hidden.shape[0])
        checked = None
        if kv_caches:
            num_blocks, block_size = kv_caches[0][0].shape[:2]
            checked = kernels.check_indices(
                meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                num_blocks, block_size, hidden.shape[0],
            )  # fmt: skip
        cos, sin = model.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(model.layers, kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, meta, checked)
        return model.compute_logits(hidden.index_select(0, logits_indices))
