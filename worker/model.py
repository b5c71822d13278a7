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

import ctypes
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve import kernels
from pagedserve.kernels import cpu_native
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.attention import AttentionMetadata, paged_attention
from pagedserve.worker.batch_invariant import invariant_linear, per_token_metadata
from pagedserve.worker.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary
from pagedserve.worker.packed_linear import PackedLinear, pack_linears, packed_logits

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

    def forward_cpu(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """:meth:`forward` with the fused fp32 CPU kernels (:mod:`pagedserve.kernels.cpu_native`).

        Rotary and the K/V store are one in-place pass over the qkv output, and attention
        reads the query heads straight out of it (no split, no copies).
        """
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        cpu_native.rope_store(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.cos_table,
            rope.sin_table, positions, meta.slot_mapping, kv_cache[0], kv_cache[1],
        )  # fmt: skip
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        out = cpu_native.paged_attention(
            q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
            self.scale,
        )  # fmt: skip
        return self.o_proj(out.view(num_tokens, self.q_size))


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

    def forward_cpu(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the fused CPU kernels, with the residual stream kept apart.

        ``(x, residual) -> (mlp_out, residual')`` where the layer's true output is
        ``mlp_out + residual'``: each residual add is fused into the next RMSNorm (vLLM's
        ``fused_add_rms_norm``). ``residual is None`` on the first layer (``x`` is then the
        embedding). fp32 adds are commutative, so the sums equal :meth:`forward`'s.
        """
        if residual is None:
            residual = x.clone()
            normed = cpu_native.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            normed = cpu_native.rms_norm(
                x, self.input_layernorm.weight, self.input_layernorm.eps, residual=residual
            )
        attn = self.self_attn.forward_cpu(normed, positions, rope, kv_cache, meta)
        post = self.post_attention_layernorm
        normed = cpu_native.rms_norm(attn, post.weight, post.eps, residual=residual)
        mlp = self.mlp
        act = cpu_native.silu_mul(mlp.gate_up_proj(normed))
        return mlp.down_proj(act), residual


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
        # Set by pagedserve.worker.batch_invariant.make_batch_invariant: fixed-shape matmuls.
        self.batch_invariant = False
        # Set by pack_weights: the tied LM head packed for the CPU GEMM (untied: lm_head
        # itself becomes a PackedLinear).
        self.packed_head: torch.Tensor | None = None
        # (KV cache pointers, layer array) for cpu_native.decoder_layers; see _fused_layers.
        self._fused: tuple[tuple[int, ...], ctypes.Array[Any]] | None = None

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
        if self.uses_cpu_kernels(h):
            return self._forward_cpu(h, positions, kv_caches, attn_metadata, logits_indices)
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, attn_metadata)
        return self.compute_logits(h.index_select(0, logits_indices))

    def uses_cpu_kernels(self, hidden: torch.Tensor) -> bool:
        """Whether a forward on ``hidden`` runs the fused CPU kernels (fp32 on CPU, the
        library built, backend ``auto`` or ``cpu``, the per-head scratch big enough)."""
        return (
            kernels.uses_cpu_kernels(self.backend, hidden.device, hidden.dtype)
            and self.arch.head_dim <= cpu_native.MAX_HEAD_DIM
            and not self.training
        )

    def _forward_cpu(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` on the fused CPU kernels (see :meth:`LlamaDecoderLayer.forward_cpu`).

        The metadata tensors are made contiguous with the dtypes the C kernels read
        (int64 positions and slots, int32 tables, lengths and offsets) once per step.
        """
        positions = positions.to(torch.int64).contiguous()
        # The C kernels index without bounds checks: validate what they will read.
        if positions.numel() and (
            int(positions.min()) < 0 or int(positions.max()) >= self.rotary_emb.max_positions
        ):
            raise ValueError(f"positions must be in [0, {self.rotary_emb.max_positions})")
        num_blocks, block_size = kv_caches[0][0].shape[:2] if kv_caches else (0, 1)
        slots = meta.slot_mapping
        if slots.numel() and int(slots.max()) >= num_blocks * block_size:
            raise ValueError(f"slot_mapping holds slots beyond the {num_blocks}-block cache")
        cpu_native.check_bounds(meta.block_tables, meta.seq_lens, num_blocks, block_size)
        meta = AttentionMetadata(
            slot_mapping=meta.slot_mapping.to(torch.int64).contiguous(),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
            seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
            cu_seqlens_q=meta.cu_seqlens_q.to(torch.int32).contiguous(),
            max_query_len=meta.max_query_len,
        )
        if self.batch_invariant:  # every token attends as a decode does
            meta = per_token_metadata(meta, positions)
        residual: torch.Tensor | None = None
        fused = self._fused_layers(kv_caches)
        if fused is not None:  # all layers in one C call, the same kernels and bits
            arch = self.arch
            residual = cpu_native.decoder_layers(
                fused, h,
                (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                 arch.intermediate_size),
                cast(LlamaDecoderLayer, self.layers[0]).input_layernorm.eps,
                arch.head_dim**-0.5, self.rotary_emb.cos_table, self.rotary_emb.sin_table,
                positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                meta.cu_seqlens_q, block_size,
            )  # fmt: skip
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                decoder = cast(LlamaDecoderLayer, layer)
                h, residual = decoder.forward_cpu(
                    h, residual, positions, self.rotary_emb, kv_cache, meta
                )
        if residual is None:  # no layers
            residual = torch.zeros_like(h)
        hidden = h.index_select(0, logits_indices)
        res = residual.index_select(0, logits_indices)
        hidden = cpu_native.rms_norm(hidden, self.norm.weight, self.norm.eps, residual=res)
        return self._lm_head(hidden)

    def _fused_layers(self, kv_caches: Sequence[KVCache]) -> ctypes.Array[Any] | None:
        """The layers' tensors for :func:`cpu_native.decoder_layers`, or ``None`` when
        that path does not apply: no layers, a linear layer that is not packed, layers
        whose norms differ in epsilon, a cache that is not contiguous fp32 of the model's
        shape, or ``PAGEDSERVE_FUSED_LAYERS=0``. Built on the first step with a given set
        of KV caches (the environment is read then) and kept until the caches or the
        packed weights change."""
        key = tuple(t.data_ptr() for cache in kv_caches for t in cache)
        if self._fused is not None and self._fused[0] == key:
            return self._fused[1]
        self._fused = None
        if not self.layers or not cpu_native.fused_layers_enabled():
            return None
        entries: list[dict[str, torch.Tensor | None]] = []
        eps = cast(LlamaDecoderLayer, self.layers[0]).input_layernorm.eps
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            decoder = cast(LlamaDecoderLayer, layer)
            attn, mlp = decoder.self_attn, decoder.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (decoder.input_layernorm, decoder.post_attention_layernorm)
            if not all(isinstance(m, PackedLinear) for m in linears) or any(
                n.eps != eps for n in norms
            ):
                return None
            for cache in (k_cache, v_cache):
                if (
                    cache.dtype != torch.float32
                    or not cache.is_contiguous()
                    or cache.shape != kv_caches[0][0].shape
                    or cache.shape[2:] != (self.arch.num_kv_heads, self.arch.head_dim)
                ):
                    return None
            qkv, o, gate_up, down = cast(tuple[PackedLinear, ...], linears)
            entries.append(
                {
                    "input_norm": norms[0].weight.detach(),
                    "post_norm": norms[1].weight.detach(),
                    **qkv.pointer_tensors("qkv"),
                    **o.pointer_tensors("o"),
                    **gate_up.pointer_tensors("gate_up"),
                    **down.pointer_tensors("down"),
                    "k_cache": k_cache,
                    "v_cache": v_cache,
                }
            )
        for entry in entries:
            for tensor in entry.values():
                if tensor is not None and not tensor.is_contiguous():
                    return None
        self._fused = (key, cpu_native.decoder_layer_array(entries))
        return self._fused[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head: ``[N, hidden]`` -> fp32 ``[N, vocab_size]``."""
        return self._lm_head(self.norm(hidden)).float()

    def pack_weights(self) -> int:
        """Move every linear layer and the LM head to the packed CPU GEMM
        (:mod:`pagedserve.worker.packed_linear`), in place; returns the layers packed.

        Raises:
            ValueError: weights that are not fp32 on CPU (nothing is packed then).
        """
        self._fused = None
        if self.lm_head is None:
            self.packed_head = cpu_native.pack_linear_weight(self.embed_tokens.weight.detach())
        return pack_linears(self)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            if isinstance(self.lm_head, PackedLinear):
                return self.lm_head(hidden)
            weight = self.lm_head.weight
        elif self.packed_head is not None:
            return packed_logits(hidden, self.packed_head, self.arch.vocab_size)
        else:
            weight = self.embed_tokens.weight
        if self.batch_invariant:
            return invariant_linear(hidden, weight)
        return F.linear(hidden, weight)
