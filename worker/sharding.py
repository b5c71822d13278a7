"""Megatron-style sharding of the Llama-family model over a tensor-parallel group.

Shoeybi et al., 2019 ("Megatron-LM", sec. 3) split each transformer block so that one
all-reduce follows each of its two halves; vLLM's ``ColumnParallelLinear`` /
``RowParallelLinear`` / ``VocabParallelEmbedding`` do the same. Rank ``r`` of ``T``:

* **column-parallel** q/k/v and gate/up: the rows of the rank's query heads, KV heads and
  ``intermediate / T`` MLP columns (biases the same rows); attention runs on the rank's
  heads alone, over its own KV pool.
* **row-parallel** o_proj and down_proj: the matching input columns; each rank's partial
  product is summed by an all-reduce, then the bias (held whole) is added once.
* **vocab-parallel** embedding and LM head: rows ``[r * Vp, (r + 1) * Vp)`` of the
  vocabulary (``Vp = ceil(V / T)``, the last rank's tail zero-padded); a token outside the
  rank's rows looks up zeros and the all-reduce sums the one rank that holds it (exact), and
  the logits ``[N, Vp]`` of every rank are gathered on rank 0 (``[N, V]`` after the pad is
  cut). Each logit is one rank's full dot product, so the head adds no rounding of its own.

Heads: ``T`` must divide the query heads; KV heads are split when ``T`` divides them and
replicated when their count divides ``T`` (rank ``r`` holds KV head ``r // (T / Hkv)``,
which the rank's query heads use), as vLLM does. Anything else is a ``ValueError``.

Each rank reads only its slices from the safetensors files (``safe_open(...).get_slice``):
no rank materialises the whole model. A ``.gguf`` model is converted once to an fp32
safetensors folder (:mod:`pagedserve.worker.model_store`) and read the same way.

The sharded model runs on :class:`TensorParallelForward` (the generic per-layer forward
with the gather of the logits): the fused CPU forwards run all layers in one C call, which
cannot all-reduce inside, so they are not used at ``T > 1``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.worker.arch import ModelArch
from pagedserve.worker.attention import AttentionMetadata
from pagedserve.worker.model import KVCache, LayerForward, LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.worker.parallel import TensorParallelGroup
from pagedserve.worker.weights import load_weights

_LAYER = re.compile(r"^layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds of a model of architecture ``arch``.

    Attributes:
        arch: the whole model's architecture.
        rank, size: the rank and the group size ``T``.

    Raises:
        ValueError: ``T`` does not divide the query heads or the MLP width, or neither
            divides the other of ``T`` and the KV heads.
    """

    arch: ModelArch
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        a, t = self.arch, self.size
        if a.num_heads % t:
            raise ValueError(
                f"tensor_parallel_size {t} must divide the model's {a.num_heads} attention heads"
            )
        if a.num_kv_heads % t and t % a.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {t} and the model's {a.num_kv_heads} KV heads: one "
                "must divide the other (KV heads are split, or replicated over the ranks)"
            )
        if a.intermediate_size % t:
            raise ValueError(
                f"tensor_parallel_size {t} must divide the MLP width {a.intermediate_size}"
            )

    @property
    def heads(self) -> range:
        """The rank's query heads."""
        n = self.arch.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """The rank's KV heads (one replicated head when ``T`` exceeds their count)."""
        hkv, t = self.arch.num_kv_heads, self.size
        if hkv >= t:
            n = hkv // t
            return range(self.rank * n, (self.rank + 1) * n)
        first = self.rank // (t // hkv)
        return range(first, first + 1)

    @property
    def vocab_rows(self) -> int:
        """``Vp``: vocabulary rows per rank (``ceil(V / T)``)."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_range(self) -> range:
        """The vocabulary ids the rank holds (the last rank's may be short)."""
        vp = self.vocab_rows
        return range(min(self.rank * vp, self.arch.vocab_size),
                     min((self.rank + 1) * vp, self.arch.vocab_size))  # fmt: skip

    @property
    def local_arch(self) -> ModelArch:
        """The architecture of the rank's slice: its heads, KV heads, MLP width and
        vocabulary rows (what its modules and its KV pool are shaped by)."""
        a = self.arch
        return dataclasses.replace(
            a,
            num_heads=len(self.heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=a.intermediate_size // self.size,
            vocab_size=self.vocab_rows,
        )

    def rows(self, module: str, shard: str) -> tuple[int, slice] | None:
        """Which axis and range of the HF tensor ``{module}.{shard}_proj`` the rank reads:
        ``(0, rows)`` for column-parallel, ``(1, columns)`` for row-parallel weights;
        ``None`` for a tensor read whole."""
        d, inter = self.arch.head_dim, self.arch.intermediate_size // self.size
        if shard == "q":
            return 0, slice(self.heads.start * d, self.heads.stop * d)
        if shard in ("k", "v"):
            return 0, slice(self.kv_heads.start * d, self.kv_heads.stop * d)
        if shard == "o":
            return 1, slice(self.heads.start * d, self.heads.stop * d)
        if shard in ("gate", "up"):
            return 0, slice(self.rank * inter, (self.rank + 1) * inter)
        if shard == "down":
            return 1, slice(self.rank * inter, (self.rank + 1) * inter)
        return None

    def read(self, f: Any, hf_name: str, name: str) -> torch.Tensor:
        """The rank's slice of tensor ``hf_name`` (our name ``name``) of the open
        safetensors file ``f``, reading only those bytes."""
        if name in ("embed_tokens.weight", "lm_head.weight"):
            vr = self.vocab_range
            part = f.get_slice(hf_name)[vr.start : vr.stop]
            if len(vr) < self.vocab_rows:  # the last rank's zero tail
                pad = part.new_zeros((self.vocab_rows - len(vr), *part.shape[1:]))
                part = torch.cat([part, pad])
            return part
        layer = _LAYER.match(name)
        where = self.rows(layer.group(1), layer.group(2)) if layer else None
        if where is None or (layer is not None and layer.group(3) == "bias" and where[0] == 1):
            return f.get_tensor(hf_name)  # norms, row-parallel biases: whole
        axis, span = where
        sl = f.get_slice(hf_name)
        return sl[span] if axis == 0 else sl[:, span]


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x @ W_r^T) + b``: the rank's input columns ``W_r [out, in / T]``,
    the bias (whole, ``[out]``) added once after the sum. ``x [N, in / T]`` -> ``[N, out]``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Embedding):
    """The rank's vocabulary rows ``[start, start + Vp)`` of the embedding: ids outside
    them look up zeros and the all-reduce takes each id's row from the rank that holds it.
    int64 ``ids [N]`` -> ``[N, hidden]``."""

    def __init__(self, rows: int, hidden: int, start: int, group: TensorParallelGroup) -> None:
        super().__init__(rows, hidden)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


@dataclass(frozen=True)
class TensorParallelForward:
    """The generic per-layer forward of a sharded model: the layers in turn (each
    row-parallel layer all-reduces), the rank's LM-head rows, then the logits gathered on
    rank 0: fp32 ``[num_out, vocab_size]`` there, an empty ``[num_out, 0]`` on the other
    ranks (which do not sample)."""

    group: TensorParallelGroup
    vocab_size: int
    name: str = "tensor-parallel"

    def __call__(
        self,
        model: LlamaForCausalLM,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        local = LayerForward()(model, hidden, positions, kv_caches, meta, logits_indices)
        logits = self.group.gather_last(local)
        if logits is None:
            return local[:, :0]
        return logits[:, : self.vocab_size]


def shard_modules(model: LlamaForCausalLM, plan: ShardPlan, group: TensorParallelGroup) -> None:
    """Replace ``model``'s o_proj, down_proj and embedding (built on ``plan.local_arch``,
    on the ``meta`` device) by their row- and vocab-parallel forms, in place."""
    a = plan.arch
    local = plan.local_arch
    q_size = local.num_heads * local.head_dim
    for module in model.layers:
        layer = cast(LlamaDecoderLayer, module)
        layer.self_attn.o_proj = RowParallelLinear(q_size, a.hidden_size, a.o_bias, group)
        layer.mlp.down_proj = RowParallelLinear(
            local.intermediate_size, a.hidden_size, a.mlp_bias, group
        )
    model.embed_tokens = VocabParallelEmbedding(
        plan.vocab_rows, a.hidden_size, plan.vocab_range.start, group
    )


def load_sharded_model(
    model_dir: str | os.PathLike[str],
    plan: ShardPlan,
    group: TensorParallelGroup,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "auto",
) -> LlamaForCausalLM:
    """Create rank ``plan.rank``'s slice of the model on ``device`` in ``dtype``, load its
    slices of the weights (eval mode) and install :class:`TensorParallelForward`.

    ``model.arch`` is the rank's :attr:`ShardPlan.local_arch`.

    Raises:
        see :func:`pagedserve.worker.weights.load_weights`.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(plan.local_arch, max_positions, backend)
        shard_modules(model, plan, group)
    model = model.to_empty(device=device)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.rotary_emb.reset_tables()
    with torch.no_grad():
        load_weights(model, model_dir, read=plan.read)
    model.use_forward(TensorParallelForward(group, plan.arch.vocab_size))
    return model.eval().requires_grad_(False)
