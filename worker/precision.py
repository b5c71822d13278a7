"""The model and KV-cache dtypes a worker runs, resolved once from what was asked.

``dtype="auto"`` follows vLLM (``vllm/config/model.py``, ``_get_and_verify_dtype``): a
checkpoint's own 16-bit dtype (config.json ``torch_dtype``, or ``dtype`` in newer
transformers), and for an fp32 checkpoint bf16 where bf16 runs natively; here "natively"
means the forward the runner selects has a fast path for it on the device
(:func:`native_dtypes`). An fp32 checkpoint stays fp32 where bf16 would be emulated or
would fall to the generic (slow) layers.

On CUDA the generic layers (Triton kernels) run bf16, fp16 and fp32. On CPU the fast path
(the C kernels of :mod:`pagedserve.worker.cpu_forward`) runs fp32 and bf16 weights; the
runner says whether its bf16 GEMM is built
(:func:`pagedserve.worker.cpu_forward.bf16_cpu_path_available`, passed here as
``cpu_bf16_kernels``), and ``auto`` then picks bf16 on CPUs whose flags say bf16 is native
(:func:`cpu_has_native_bf16`: ``avx512_bf16`` or ``amx_bf16``), fp32 elsewhere.

``kv_cache_dtype="auto"`` is the model's resolved dtype; ``"fp8"`` (or ``"fp8_e4m3"``, vLLM's
names) is an 8-bit e4m3fn cache, named ``"float8_e4m3fn"`` (torch's name) once resolved,
which is the name GetStats, the block hash and every swap transfer carry; ``"int8"`` is an
8-bit integer cache with one fp32 scale per (slot, KV head) stored in the block
(:mod:`pagedserve.kernels.int8`). Everything here
works on dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``): no
torch, so it is a pure table.
"""

from __future__ import annotations

import json
import os

DTYPE_NAMES = ("float32", "float16", "bfloat16")
"""The concrete dtypes a model or a KV cache may run in."""

DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
"""What ``--dtype`` accepts."""

FP8_KV_NAME = "float8_e4m3fn"
"""The resolved name of an fp8 KV cache (torch's ``float8_e4m3fn``)."""

INT8_KV_NAME = "int8"
"""The name of an int8 KV cache (scales in the block)."""

KV_DTYPE_NAMES = (*DTYPE_NAMES, FP8_KV_NAME, INT8_KV_NAME)
"""The concrete dtypes a KV cache may hold."""

_FP8_ALIASES = ("fp8", "fp8_e4m3", FP8_KV_NAME)
KV_DTYPE_CHOICES = (*DTYPE_CHOICES, *_FP8_ALIASES, INT8_KV_NAME)
"""What ``--kv-cache-dtype`` accepts (``fp8`` and ``fp8_e4m3``: vLLM's names for e4m3; the
resolved name; ``int8``)."""

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# config.json spellings of a dtype -> its name here ("float" and "half" come from old exports).
_CHECKPOINT_NAMES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first ``flags`` line of ``/proc/cpuinfo`` text (empty
    when there is none, e.g. on a CPU that names them ``Features``)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """:func:`parse_cpu_flags` of ``path``; empty when it cannot be read (not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


def cpu_has_native_bf16(flags: frozenset[str]) -> bool:
    """True when the CPU computes bf16 in hardware (AVX512-BF16 dot products or AMX tiles)."""
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def native_dtypes(
    device_type: str,
    cpu_flags: frozenset[str],
    cpu_bf16_kernels: bool = False,
    cuda_bf16: bool = True,
) -> frozenset[str]:
    """The dtypes the forward selected on ``device_type`` runs on a fast path.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        cpu_flags: the CPU's flags (:func:`read_cpu_flags`); used on CPU only.
        cpu_bf16_kernels: whether the CPU forward's bf16 GEMM is built (the runner passes
            :func:`pagedserve.worker.cpu_forward.bf16_cpu_path_available`).
        cuda_bf16: whether the GPU computes bf16 natively (``torch.cuda.is_bf16_supported``;
            compute capability 8.0 and later); used on CUDA only.

    Returns:
        ``{"float32", "float16", "bfloat16"}`` on CUDA (without ``"bfloat16"`` when not
        ``cuda_bf16``, where vLLM also falls to fp16); on CPU ``{"float32"}``, plus
        ``"bfloat16"`` when ``cpu_bf16_kernels`` and the flags show native bf16.
    """
    if device_type == "cuda":
        return frozenset(DTYPE_NAMES) if cuda_bf16 else frozenset({"float32", "float16"})
    if cpu_bf16_kernels and cpu_has_native_bf16(cpu_flags):
        return frozenset({"float32", "bfloat16"})
    return frozenset({"float32"})


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype a Hugging Face folder's weights were saved in: config.json ``torch_dtype``
    (or ``dtype``), as a name of :data:`DTYPE_NAMES`; ``None`` when it says none, names
    another dtype, or there is no readable config.json."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    raw = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    if not isinstance(raw, str):
        return None
    return _CHECKPOINT_NAMES.get(raw.removeprefix("torch."))


def resolve_model_dtype(requested: str, checkpoint: str | None, native: frozenset[str]) -> str:
    """The model's dtype name for ``--dtype requested``.

    Args:
        requested: one of :data:`DTYPE_CHOICES`.
        checkpoint: :func:`checkpoint_dtype` of the model (``None``: unknown, as fp32).
        native: :func:`native_dtypes` of the device.

    Returns:
        ``requested`` unless it is ``"auto"``; for ``"auto"`` the checkpoint's 16-bit dtype
        when it is native, else the first native of ``"bfloat16"``, ``"float16"``,
        ``"float32"``.

    Raises:
        ValueError: ``requested`` is not one of :data:`DTYPE_CHOICES`.
    """
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    if requested != "auto":
        return requested
    if checkpoint in ("bfloat16", "float16") and checkpoint in native:
        return checkpoint
    if "bfloat16" in native:
        return "bfloat16"
    # NOTE: a GPU without bf16 runs 16-bit as fp16 (vLLM's rule on compute capability < 8).
    return "float16" if "float16" in native else "float32"


def resolve_kv_cache_dtype(requested: str, model_dtype: str) -> str:
    """The KV cache's dtype name (one of :data:`KV_DTYPE_NAMES`) for ``--kv-cache-dtype
    requested``: ``model_dtype`` for ``"auto"``, :data:`FP8_KV_NAME` for ``"fp8"`` /
    ``"fp8_e4m3"``, else ``requested``.

    Raises:
        ValueError: ``requested`` is not one of :data:`KV_DTYPE_CHOICES`.
    """
    if requested not in KV_DTYPE_CHOICES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, got {requested!r}"
        )
    if requested in _FP8_ALIASES:
        return FP8_KV_NAME
    return model_dtype if requested == "auto" else requested


__all__ = [
    "DTYPE_CHOICES",
    "DTYPE_NAMES",
    "FP8_KV_NAME",
    "INT8_KV_NAME",
    "KV_DTYPE_CHOICES",
    "KV_DTYPE_NAMES",
    "checkpoint_dtype",
    "cpu_has_native_bf16",
    "native_dtypes",
    "parse_cpu_flags",
    "read_cpu_flags",
    "resolve_kv_cache_dtype",
    "resolve_model_dtype",
]
