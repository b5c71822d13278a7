"""Linear layers on packed weights for the fp32 CPU path (:func:`pack_linears`).

A decode step multiplies a handful of token rows by every weight of the model, so on CPU
its time is the time to stream the weights from memory, and torch's ``F.linear`` (MKL's
sgemm) re-packs the weight on every call at these shapes. :func:`pack_linears` packs every
``nn.Linear`` once at load (:func:`pagedserve.kernels.cpu_native.pack_linear_weight`) and
replaces it by a :class:`PackedLinear`, which keeps only the packed copy (the row-major
weight is dropped, so memory does not grow), plus one packed copy of the LM head (with tied
embeddings the embedding table stays for the lookup). vLLM's CPU backend does the same with
prepacked oneDNN weights.

The packed kernel sums each output element over K in order, so a row's result depends only
on that row: the batch-invariant mode (:mod:`pagedserve.worker.batch_invariant`) uses it
as is.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import cpu_native


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` held only in packed form (fp32, CPU).

    Args:
        linear: the ``nn.Linear`` to replace (fp32, CPU); its weight is packed, its bias
            kept as a parameter.

    Raises:
        ValueError: from :func:`cpu_native.pack_linear_weight` on a non-fp32 / non-CPU
            weight.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed", cpu_native.pack_linear_weight(linear.weight.detach()))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` fp32 -> ``[..., out_features]`` fp32."""
        if x.dim() == 2:  # the serving path: a flat token batch, no reshapes
            return cpu_native.linear_packed(x, self.packed, self.out_features, self.bias)
        flat = x.reshape(-1, self.in_features)
        out = cpu_native.linear_packed(flat, self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    Args:
        model: a module whose linear layers are fp32 on CPU.

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: a linear layer that is not fp32 on CPU (nothing is replaced then).
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for _, _, child in targets:
        if child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
            raise ValueError(
                f"packed linears need fp32 CPU weights, got {child.weight.dtype} "
                f"on {child.weight.device}"
            )
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def packed_logits(hidden: torch.Tensor, packed_head: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """LM-head logits ``hidden @ W.T`` from a head packed by
    :func:`cpu_native.pack_linear_weight`: fp32 ``[N, hidden]`` -> ``[N, vocab_size]``."""
    return cpu_native.linear_packed(hidden, packed_head, vocab_size)


__all__ = ["PackedLinear", "pack_linears", "packed_logits"]
