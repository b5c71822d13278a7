"""Host-side helpers shared by the Triton kernel modules (no kernels in here).

Importing this module imports Triton; it is only imported from the ``*_triton`` modules,
which :mod:`pagedserve.kernels` loads lazily.
"""

from __future__ import annotations

import functools

import torch
import triton

from pagedserve.kernels._math import cdiv, next_pow2

__all__ = [
    "MAX_HEAD_DIM",
    "cdiv",
    "check_head_dim",
    "check_triton_device",
    "compute_in_fp32",
    "dot_precision",
    "interpreting",
    "next_pow2",
    "sm_count",
]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors of ``device``; a small constant off CUDA.

    The constant (4) only shapes the launch grid under the interpreter, where it keeps
    grids tiny while still exercising the split-KV path.
    """
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else 0)
    return 4


def check_triton_device(device: torch.device, kernel: object) -> None:
    """Raise ``RuntimeError`` unless ``kernel`` can run on tensors of ``device``.

    CPU tensors need the kernel to have been defined under the interpreter, i.e. the
    ``*_triton`` module imported while ``TRITON_INTERPRET=1`` was set.
    """
    if device.type == "cuda":
        return
    if type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "the Triton kernels were imported without TRITON_INTERPRET=1, so they cannot "
            f"run on {device.type} tensors; set TRITON_INTERPRET=1 before the first "
            "Triton backend call (or use backend='torch')"
        )


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: IEEE fp32 (no TF32) so fp32 caches match torch.

    It only changes fp32 x fp32 dots; fp16/bf16 dots always use the tensor cores.
    """
    del dtype
    return "ieee"


def compute_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast operands to fp32 before ``tl.dot``.

    Always for fp32 caches (no-op); for bf16 under the interpreter, whose bf16 dot is wrong.
    fp16 and (on GPU) bf16 keep their native tensor-core dot with fp32 accumulation.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


MAX_HEAD_DIM = 256


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` for head dims the Triton attention kernels do not tile."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the Triton backend; "
            "use backend='torch'"
        )
