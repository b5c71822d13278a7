"""The model forward on the fused CPU kernels (:mod:`pagedserve.kernels.cpu_native`).

fp32 or bf16 weights (bf16: :class:`~pagedserve.worker.packed_linear_bf16.PackedLinearBf16`
layers and head, the embedding rows widened to fp32 once), fp32 activations, norms and
residual stream (the inputs of bf16 linear layers rounded to bf16, by the layer or, on the
per-layer path, by the norm or SiLU * up before it: the same bits); the KV caches fp32 or
bf16 (``kv_cache_dtype="bfloat16"``: K/V rounded to bf16 when stored, widened back to fp32
in the attention kernel, half the cache bytes read per step).

Two :class:`~pagedserve.worker.model.ModelForward` implementations of the same math, in
the same kernel order, giving the same bits:

* :class:`CpuLayerForward`: one Python call per kernel and layer. Per layer: RMSNorm fused
  with the residual add (vLLM's ``fused_add_rms_norm``), the qkv GEMM, rotary and the K/V
  store in one in-place pass over the qkv output (:func:`cpu_native.rope_store`), paged
  attention reading the query heads straight out of it, the o GEMM, RMSNorm + residual,
  the gate/up GEMM, SiLU * up, the down GEMM. The residual stream is kept apart: a layer
  maps ``(x, residual)`` to ``(mlp_out, residual')`` whose sum is the layer's output; fp32
  adds are commutative, so the sums equal the generic path's.
* :class:`FusedCpuForward`: every layer in one C call (:func:`cpu_native.decoder_layers`),
  without the ~9 ctypes calls and ~7 tensor allocations per layer of the above. It needs
  every linear layer packed, all fp32 (:mod:`pagedserve.worker.packed_linear`) or all bf16
  (the C call then runs ``linear_packed_bf16`` on their packed bf16 copies), one RMSNorm
  epsilon, contiguous KV caches of one dtype, and ``PAGEDSERVE_FUSED_LAYERS`` not 0; it is
  built for one set of KV caches (their data pointers go into the layer array). bf16
  layers that also hold a oneDNN copy (``onednn_min_rows`` set) run large steps faster on
  it than on the packed kernel, so this one forward, chosen once, picks per step by the
  step's token count (:func:`runs_fused`): below the layers' ``onednn_min_rows`` the C
  call, from it up the per-layer path above (whose linear layers then call oneDNN).

Both validate the step's indices (:func:`pagedserve.kernels.check_positions`,
:func:`pagedserve.kernels.check_indices`) once, before any kernel reads them, then convert
the metadata to the contiguous dtypes the C kernels read (int64 positions and slots,
int32 tables, lengths and offsets). In batch-invariant mode every query row attends as a
decode does (:func:`pagedserve.worker.batch_invariant.per_token_metadata`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from pagedserve import kernels
from pagedserve.kernels import cpu_native, int8
from pagedserve.worker.attention import AttentionMetadata
from pagedserve.worker.batch_invariant import per_token_metadata
from pagedserve.worker.layers import RMSNorm
from pagedserve.worker.model import KVCache, LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.worker.packed_linear import PackedLinear
from pagedserve.worker.packed_linear_bf16 import (
    PackedLinearBf16,
    default_onednn_min_rows,
    onednn_bf16_available,
)


def cpu_kernels_apply(model: LlamaForCausalLM) -> bool:
    """Whether ``model`` can run on the fused CPU kernels: CPU weights in fp32, or in bf16
    where the bf16 GEMM is built (:func:`bf16_cpu_path_available`), the library built,
    attention backend ``auto`` or ``cpu``, the rotary scratch big enough
    (``head_dim <= cpu_native.MAX_HEAD_DIM``), and eval mode (the kernels keep no
    autograd graph). With bf16 weights the activations, norms, rotary and attention
    arithmetic stay fp32; only the linear layers and the head read bf16."""
    weight = model.embed_tokens.weight
    dtype = weight.dtype
    if dtype == torch.bfloat16 and bf16_cpu_path_available():
        dtype = torch.float32  # the kernels around the GEMMs run fp32 activations
    return (
        kernels.uses_cpu_kernels(model.backend, weight.device, dtype)
        and model.arch.head_dim <= cpu_native.MAX_HEAD_DIM
        and not model.training
    )


def bf16_cpu_path_available() -> bool:
    """True when bf16 weights run fast on this CPU: the AVX512-BF16 GEMM is built
    (:func:`pagedserve.kernels.cpu_native.has_bf16_gemm`), and where the packed kernel
    leaves the CPU's AMX tiles to oneDNN for prefill-sized batches
    (:func:`~pagedserve.worker.packed_linear_bf16.default_onednn_min_rows` not ``None``),
    oneDNN's bf16 linear is there
    (:func:`~pagedserve.worker.packed_linear_bf16.onednn_bf16_available`). On AMX and on
    CPUs without it the packed kernel runs every batch size itself."""
    if not cpu_native.has_bf16_gemm():
        return False
    return default_onednn_min_rows() is None or onednn_bf16_available()


def prepare_metadata(
    model: LlamaForCausalLM,
    num_tokens: int,
    positions: torch.Tensor,
    kv_caches: Sequence[KVCache],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Validate the step's indices for the C kernels and convert them to their dtypes.

    Returns:
        ``(positions, meta)``: contiguous int64 positions and slots, int32 block tables,
        lengths and offsets (per-token metadata in batch-invariant mode).

    Raises:
        ValueError: from :func:`pagedserve.kernels.check_positions` /
            :func:`pagedserve.kernels.check_indices`, naming the bad argument.
    """
    kernels.check_positions(positions, model.rotary_emb.max_positions, num_tokens)
    num_blocks, block_size = kv_caches[0][0].shape[:2] if kv_caches else (0, 1)
    kernels.check_indices(
        meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        num_blocks, block_size, num_tokens,
    )  # fmt: skip
    positions = positions.to(torch.int64).contiguous()
    meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(torch.int64).contiguous(),
        block_tables=meta.block_tables.to(torch.int32).contiguous(),
        seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
        cu_seqlens_q=meta.cu_seqlens_q.to(torch.int32).contiguous(),
        max_query_len=meta.max_query_len,
    )
    if model.batch_invariant:  # positions were checked against the table, not seq_lens
        meta = per_token_metadata(meta, positions)
        kernels.check_indices(
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            num_blocks, block_size, num_tokens,
        )  # fmt: skip
    return positions, meta


def kernel_weights(model: LlamaForCausalLM) -> bool:
    """Whether the per-layer kernels can read ``model``'s weights: every RMSNorm weight fp32
    (the C norm reads fp32) and every linear layer packed or an fp32 ``nn.Linear`` (the
    activations are fp32). A bf16 model qualifies once :meth:`LlamaForCausalLM.pack_weights`
    has packed it (that widens its norm weights); unpacked (``PAGEDSERVE_CPU_GEMM=0``) it
    runs the generic path."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
            return False
        if isinstance(module, RMSNorm) and module.weight.dtype != torch.float32:
            return False
    return True


def final_logits(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    logits_indices: torch.Tensor,
) -> torch.Tensor:
    """Final RMSNorm (fused with the last residual add) and LM head of the selected rows:
    fp32 ``[T, hidden]`` x2 -> ``[num_out, vocab_size]``."""
    if residual is None:  # no layers
        residual = torch.zeros_like(hidden)
    rows = hidden.index_select(0, logits_indices)
    res = residual.index_select(0, logits_indices)
    rows = cpu_native.rms_norm(rows, model.norm.weight, model.norm.eps, residual=res)
    return model.lm_logits(rows)


def bf16_layer(layer: LlamaDecoderLayer) -> bool:
    """Whether every linear layer of ``layer`` is a :class:`PackedLinearBf16` (it then reads
    its input in bf16: the norms before them may round to bf16 themselves)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return all(isinstance(m, PackedLinearBf16) for m in linears)


def mlp_forward(layer: LlamaDecoderLayer, normed: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` of ``normed [T, hidden]`` -> fp32 ``[T, hidden]``.

    Both layers bf16 and packed (:class:`PackedLinearBf16`): where gate/up runs the packed
    kernel, one call (:func:`cpu_native.linear_packed_bf16_silu_mul`) computes gate/up,
    the SiLU product and its bf16 rounding, what ``cpu_decoder.c`` calls; where it runs on
    oneDNN without a bias (prefill-sized steps beside AMX), its bf16 output goes straight
    into :func:`cpu_native.silu_mul`. Either way the down layer reads the bf16 product: the
    bits of widening gate/up to fp32 first and rounding the product for the down GEMM (NaN
    payloads aside), without the fp32 copies."""
    mlp = layer.mlp
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if isinstance(gate_up, PackedLinearBf16) and isinstance(down, PackedLinearBf16):
        rows = normed.shape[0]
        if not gate_up.runs_onednn(rows):
            act = cpu_native.linear_packed_bf16_silu_mul(
                normed, gate_up.packed, gate_up.out_features // 2, gate_up.bias
            )
            if act is not None:
                return cast(torch.Tensor, down(act))
        elif gate_up.bias is None:
            act = cpu_native.silu_mul(gate_up(normed, out_dtype=torch.bfloat16))
            return cast(torch.Tensor, down(act))
    act = cpu_native.silu_mul(gate_up(normed))
    return cast(torch.Tensor, down(act))


def decoder_layer(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    model: LlamaForCausalLM,
    kv_cache: KVCache,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer on the C kernels: ``(x, residual) -> (mlp_out, residual')`` (see the
    module docstring); ``residual is None`` on the first layer (``x`` is then the
    embedding). ``positions`` and ``meta`` come from :func:`prepare_metadata`. The norms
    before bf16 layers (:func:`bf16_layer`) write bf16, what those layers round their
    input to (same bits)."""
    norm_dtype = torch.bfloat16 if bf16_layer(layer) else torch.float32
    norm = layer.input_layernorm
    if residual is None:
        residual = x.clone()
        normed = cpu_native.rms_norm(x, norm.weight, norm.eps, out_dtype=norm_dtype)
    else:
        normed = cpu_native.rms_norm(
            x, norm.weight, norm.eps, residual=residual, out_dtype=norm_dtype
        )
    attn = layer.self_attn
    num_tokens = normed.shape[0]
    qkv = attn.qkv_proj(normed)
    rope = model.rotary_emb
    cpu_native.rope_store(
        qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, rope.cos_table, rope.sin_table,
        positions, meta.slot_mapping, kv_cache[0], kv_cache[1],
    )  # fmt: skip
    q = qkv[:, : attn.q_size].view(num_tokens, attn.num_heads, attn.head_dim)
    out = cpu_native.paged_attention(
        q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
        attn.scale,
    )  # fmt: skip
    attn_out = attn.o_proj(out.view(num_tokens, attn.q_size))
    post = layer.post_attention_layernorm
    normed = cpu_native.rms_norm(
        attn_out, post.weight, post.eps, residual=residual, out_dtype=norm_dtype
    )
    return mlp_forward(layer, normed), residual


@dataclass(frozen=True)
class CpuLayerForward:
    """The fused CPU kernels called layer by layer (see the module docstring)."""

    name: str = "cpu-layers"

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_caches: Sequence[KVCache]) -> CpuLayerForward | None:
        """This forward, or ``None`` when :func:`cpu_kernels_apply` does not hold, a cache
        is of a dtype the kernels do not take (:data:`cpu_native.KV_DTYPES`), or the
        weights are not in the form the kernels read (:func:`kernel_weights`)."""
        kernel_caches = all(t.dtype in cpu_native.KV_DTYPES for cache in kv_caches for t in cache)
        ok = cpu_kernels_apply(model) and kernel_caches and kernel_weights(model)
        return cls() if ok else None

    def __call__(
        self,
        model: LlamaForCausalLM,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """See :class:`~pagedserve.worker.model.ModelForward`."""
        positions, meta = prepare_metadata(model, hidden.shape[0], positions, kv_caches, meta)
        hidden = hidden.float()  # bf16 weights: the embedding rows, widened exactly
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(model.layers, kv_caches):
            hidden, residual = decoder_layer(
                cast(LlamaDecoderLayer, layer), hidden, residual, positions, model, kv_cache, meta
            )
        return final_logits(model, hidden, residual, logits_indices)


def runs_fused(num_tokens: int, per_layer_from: int | None) -> bool:
    """Whether :class:`FusedCpuForward` runs a step of ``num_tokens`` rows in its one C
    call (else on the per-layer path): always when ``per_layer_from`` is ``None`` (fp32
    layers, or bf16 layers without a oneDNN copy), else below it (the bf16 layers'
    ``onednn_min_rows``, where the packed kernel is the faster GEMM)."""
    return per_layer_from is None or num_tokens < per_layer_from


def cache_key(kv_caches: Sequence[KVCache]) -> tuple[int, ...]:
    """The data pointers of every layer's K and V cache, in order."""
    return tuple(t.data_ptr() for cache in kv_caches for t in cache)


@dataclass(frozen=True, eq=False)
class FusedCpuForward:
    """Every decoder layer in one :func:`cpu_native.decoder_layers` call, for the KV
    caches it was built with (see the module docstring).

    Attributes:
        layers: the :func:`cpu_native.decoder_layer_array` of the model's layers and caches.
        caches: :func:`cache_key` of those caches.
        tensors: every tensor the array points into, kept alive with it.
        eps: the layers' RMSNorm epsilon.
        per_layer_from: token rows from which a step runs on the per-layer path
            (:func:`runs_fused`): the smallest ``onednn_min_rows`` of bf16 layers, ``None``
            for fp32 layers or bf16 ones without oneDNN copies.
    """

    layers: ctypes.Array[Any]
    caches: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]
    eps: float
    per_layer_from: int | None = None
    name: str = "cpu-fused"

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_caches: Sequence[KVCache]) -> FusedCpuForward | None:
        """This forward for ``kv_caches``, or ``None`` when it does not apply:
        :func:`cpu_kernels_apply` fails, ``PAGEDSERVE_FUSED_LAYERS=0`` (read here), no
        layers, a linear layer that is not packed, packed layers of both dtypes (fp32
        :class:`PackedLinear` and bf16 :class:`PackedLinearBf16`), layers whose norms differ
        in epsilon,
        a cache that is not contiguous, of the model's shape and of the first cache's
        dtype (fp32 or bf16), or a layer tensor that is not contiguous."""
        if not (cpu_kernels_apply(model) and cpu_native.fused_layers_enabled()) or not len(
            model.layers
        ):
            return None
        if len(kv_caches) != len(model.layers):
            return None
        arch = model.arch
        first = cast(LlamaDecoderLayer, model.layers[0])
        eps = first.input_layernorm.eps
        kv_dtype = kv_caches[0][0].dtype
        packed_type = type(first.self_attn.qkv_proj)
        if packed_type not in (PackedLinear, PackedLinearBf16):
            return None
        min_rows: set[int] = set()
        entries: list[dict[str, torch.Tensor | None]] = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            decoder = cast(LlamaDecoderLayer, layer)
            attn, mlp = decoder.self_attn, decoder.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (decoder.input_layernorm, decoder.post_attention_layernorm)
            if not all(type(m) is packed_type for m in linears) or any(n.eps != eps for n in norms):
                return None
            min_rows.update(
                m.onednn_min_rows
                for m in linears
                if isinstance(m, PackedLinearBf16) and m.onednn_min_rows is not None
            )
            for cache in (k_cache, v_cache):
                if (
                    cache.dtype != kv_dtype
                    or kv_dtype not in cpu_native.KV_DTYPES
                    or not cache.is_contiguous()
                    or cache.shape != kv_caches[0][0].shape
                    or cache.shape[2:]
                    != (arch.num_kv_heads, int8.stored_head_dim(arch.head_dim, kv_dtype))
                ):
                    return None
            qkv, o, gate_up, down = cast(tuple[PackedLinear | PackedLinearBf16, ...], linears)
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
        tensors = tuple(t for entry in entries for t in entry.values() if t is not None)
        if not all(t.is_contiguous() for t in tensors):
            return None
        array = cpu_native.decoder_layer_array(entries)
        return cls(array, cache_key(kv_caches), tensors, eps, min(min_rows, default=None))

    def __call__(
        self,
        model: LlamaForCausalLM,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """See :class:`~pagedserve.worker.model.ModelForward`.

        Raises:
            ValueError: ``kv_caches`` are not the caches this forward was built for, or
                from :func:`prepare_metadata`.
            RuntimeError: from :func:`cpu_native.decoder_layers` (a bf16 GEMM failed).
        """
        if cache_key(kv_caches) != self.caches:
            raise ValueError("FusedCpuForward got KV caches other than those it was built for")
        if not runs_fused(hidden.shape[0], self.per_layer_from):
            return CpuLayerForward()(model, hidden, positions, kv_caches, meta, logits_indices)
        hidden = hidden.float().contiguous()  # bf16 weights: the embedding rows, widened
        positions, meta = prepare_metadata(model, hidden.shape[0], positions, kv_caches, meta)
        arch = model.arch
        rope = model.rotary_emb
        residual = cpu_native.decoder_layers(
            self.layers, hidden,
            (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
             arch.intermediate_size),
            self.eps, arch.head_dim**-0.5, rope.cos_table, rope.sin_table,
            positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.cu_seqlens_q, kv_caches[0][0].shape[1],
        )  # fmt: skip
        return final_logits(model, hidden, residual, logits_indices)
