"""Linear layers on packed weights for the CPU path (:func:`pack_linears`): fp32 here, bf16
in :mod:`pagedserve.worker.packed_linear_bf16`.

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
from pagedserve.worker.packed_linear_bf16 import PackedLinearBf16


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
        packed = cpu_native.pack_linear_weight(linear.weight.detach())
        self.packed: torch.Tensor
        self.register_buffer("packed", packed)
        self.bias = linear.bias
        # The per-call fast path (~120 calls per decode step) reads plain attributes, not
        # nn.Module's buffer/parameter lookups; the tensors are held here too, so they
        # stay alive whatever happens to the module's buffers.
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self._fast = (cpu_native.linear_packed_fn(), packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` fp32 -> ``[..., out_features]`` fp32."""
        n = self.out_features
        if (
            x.dim() == 2
            and x.dtype is torch.float32
            and x.stride(1) == 1
            and x.shape[1] == self.in_features
        ):  # the serving path: a flat token batch, checked once here
            fn, packed, bias = self._fast
            m = x.shape[0]
            out = torch.empty((m, n), dtype=torch.float32)
            if m:
                fn(
                    x.data_ptr(), m, self.in_features, x.stride(0), packed.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                    torch.get_num_threads(),
                )  # fmt: skip
            return out
        flat = x.reshape(-1, x.shape[-1])
        out = cpu_native.linear_packed(flat, self.packed, n, self.bias)
        return out.view(*x.shape[:-1], n)

    def pointer_tensors(self, name: str) -> dict[str, torch.Tensor | None]:
        """``{name: packed weight, name_bias: bias or None}``, for
        :func:`pagedserve.kernels.cpu_native.decoder_layer_array`."""
        _, packed, bias = self._fast
        return {name: packed, f"{name}_bias": bias}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a packed one, in place.

    Args:
        model: a module whose linear layers are on CPU.
        dtype: ``torch.float32``: :class:`PackedLinear` (fp32 weights only);
            ``torch.bfloat16``: :class:`~pagedserve.worker.packed_linear_bf16.PackedLinearBf16`
            (fp32 or bf16 weights, rounded to bf16; fp32 out).

    Returns:
        How many layers were replaced.

    Raises:
        ValueError: another ``dtype``, or a linear layer whose weight that ``dtype`` cannot
            take (nothing is replaced then).
        RuntimeError: ``torch.bfloat16`` without the AVX512-BF16 kernel
            (:func:`cpu_native.has_bf16_gemm`; nothing is replaced then).
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"packed linears are fp32 or bf16, got {dtype}")
    accepted = (torch.float32,) if dtype is torch.float32 else (torch.float32, torch.bfloat16)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for _, _, child in targets:
        if child.weight.dtype not in accepted or child.weight.device.type != "cpu":
            names = "fp32" if dtype is torch.float32 else "fp32 or bf16"
            raise ValueError(
                f"packed linears need {names} CPU weights, got {child.weight.dtype} "
                f"on {child.weight.device}"
            )
    if dtype is torch.bfloat16 and targets and not cpu_native.has_bf16_gemm():
        raise RuntimeError("bf16 packed linears need the AVX512-BF16 kernel (has_bf16_gemm)")
    for parent, name, child in targets:
        packed = PackedLinear(child) if dtype is torch.float32 else PackedLinearBf16(child)
        setattr(parent, name, packed)
    return len(targets)


def pack_head(weight: torch.Tensor) -> torch.Tensor:
    """A tied LM head's ``weight [vocab_size, hidden]`` (fp32, CPU) packed for
    :func:`packed_logits` (:func:`cpu_native.pack_linear_weight`).

    Raises:
        ValueError: a weight that is not 2-D fp32 on CPU.
    """
    return cpu_native.pack_linear_weight(weight)


def packed_logits(hidden: torch.Tensor, packed_head: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """LM-head logits ``hidden @ W.T`` from a head packed by
    :func:`cpu_native.pack_linear_weight`: fp32 ``[N, hidden]`` -> ``[N, vocab_size]``."""
    return cpu_native.linear_packed(hidden, packed_head, vocab_size)


__all__ = ["PackedLinear", "pack_head", "pack_linears", "packed_logits"]
