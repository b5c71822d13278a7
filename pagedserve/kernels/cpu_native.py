"""Fused fp32 CPU kernels (``csrc/cpu_kernels.c``), compiled on first use and called by ctypes.

Why: on CPU the serving step of a small model is dominated not by its GEMMs but by the
dozens of small torch ops around them (a gather of every sequence's K/V per layer, masks,
softmax, RMSNorm, rotary, each op paying dispatch and an OpenMP barrier). These kernels do
the same math in one pass each, as vLLM's CPU backend does with its C++ ops
(``csrc/cpu/attention.cpp``, ``layernorm.cpp``, ``pos_encoding.cpp``):

* :func:`paged_attention`: decode and chunked-prefill attention straight through the
  block tables (no gather), one task per (sequence, KV head, tile of 16 query rows), the
  KV group's query heads split over tasks when there are too few tasks for the threads;
  K rows are prefetched ahead of use (one KV head's rows are strided in the cache);
* :func:`rope_store`: rotary on the q/k heads of the fused qkv output, in place, and the
  K/V rows written to their slots;
* both on fp32 or bf16 KV caches (:data:`KV_DTYPES`): with bf16 the K/V elements are
  widened to fp32 in registers (exact) and rounded to bf16 (nearest even, as
  ``.to(torch.bfloat16)``) when stored; queries, scores, softmax and sums stay fp32, as
  vLLM's CPU attention does with a 16-bit cache (half the bytes read per key); and on fp8
  e4m3fn caches (a quarter of the bytes): elements widened exactly in registers, the
  per-tensor ``k_scale`` folded into the softmax scale and ``v_scale`` into the output,
  and stored as :func:`pagedserve.kernels.fp8.quantize` gives them (the same bytes);
* :func:`rms_norm`: RMSNorm, optionally fused with the residual add;
* :func:`silu_mul`: ``silu(gate) * up`` of the fused gate/up output;
* :func:`decoder_layers` (``csrc/cpu_decoder.c``): all decoder layers of a step in one
  call, the kernels above in the order the per-layer Python path calls them (the same
  bits), without its ~9 ctypes calls and ~7 tensor allocations per layer;
* :func:`argmax_rows`: the greedy sampler's argmax over the vocabulary (torch's CPU argmax
  is a scalar reduction: ~1 ms for 32 rows of 49,152);
* :func:`pack_linear_weight` / :func:`linear_packed` (``csrc/cpu_gemm.c``): the linear
  layers' GEMM on weights packed once into column panels, each streamed from memory once
  per call (a BLAS sgemm re-packs the weight on every small-M call; vLLM's CPU backend
  uses prepacked oneDNN weights for the same reason). Each output element is one in-order
  sum over K, so a row's result does not depend on the other rows (batch invariant);
* :func:`pack_bf16_linear_weight` / :func:`linear_packed_bf16` (``csrc/cpu_gemm_bf16.c``):
  the same on weights packed into panels of bf16 pairs, fp32 or bf16 activations rounded to
  bf16, products summed in fp32 on AMX tiles (``TDPBF16PS``, where :func:`amx_chosen`) or by
  AVX512-BF16's ``VDPBF16PS``, fp32 out; compiled in only where the compiler targets
  AVX512-BF16 (:func:`has_bf16_gemm`), the AMX kernel where it targets AMX (:func:`has_amx`).

The library is built with the system C compiler (``$CC``, default ``gcc``) into
``$PAGEDSERVE_CACHE/kernels`` (default ``~/.cache/pagedserve/kernels``), keyed by a hash of
the source, flags and CPU, so a rebuild happens only when one of those changes; a build is
written to a temporary name and renamed, so concurrent workers never load a partial file.
When no compiler is found or the build fails, :func:`load` returns ``None`` and callers use
the torch reference (:mod:`pagedserve.kernels.reference`, ``worker/layers.py``). Set
``PAGEDSERVE_CPU_KERNELS=0`` to force that fallback, or ``PAGEDSERVE_CPU_GEMM=0`` to keep
the fused kernels but run the linear layers on torch's ``F.linear`` (MKL / oneDNN) for fp32
weights (a bf16 model then runs the generic torch path: its norms and layers stay bf16).

All tensors must be fp32 (the KV caches fp32 or bf16), on CPU, and contiguous where the docstrings say so. The kernels
index without bounds checks: every caller (:mod:`pagedserve.kernels.ops`, the model's CPU
forward in ``worker/cpu_forward.py``) validates the indices first with the functions of
:mod:`pagedserve.kernels._checks`, which also hold this module's own argument checks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedserve.kernels._checks import (
    check_linear_weight,
    check_linear_weight_bf16,
    check_packed_linear,
    check_packed_linear_bf16,
)

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC / "cpu_kernels.c",
    CSRC / "cpu_gemm.c",
    CSRC / "cpu_gemm_bf16.c",
    CSRC / "cpu_decoder.c",
    CSRC / "cpu_attention_amx.c",
    CSRC / "cpu_attention_decode_bf16.c",
)
HEADERS = (CSRC / "cpu_common.h",)  # included by the sources: part of the build key
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
MAX_HEAD_DIM = 512  # rope_store's per-head scratch
# KV cache element types of the C kernels (fp8: e4m3fn with per-tensor scales; int8: each
# head vector followed by its fp32 scale, pagedserve.kernels.int8)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
_KV_SUFFIX = {
    torch.float32: "f32",
    torch.bfloat16: "bf16kv",
    torch.float8_e4m3fn: "fp8kv",
    torch.int8: "int8kv",
}
_FALSY = ("0", "false", "off", "no")

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_f32 = ctypes.c_float
_SIGNATURES = {
    "paged_attention_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64,
                            _i64, _i64, _f32, _ptr, _i64],
    "paged_attention_bf16kv": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                               _i64, _i64, _i64, _f32, _ptr, _i64],
    "paged_attention_bf16kv_rows": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                                    _i64, _i64, _i64, _i64, _f32, _ptr, _i64, _i64],
    "rope_store_f32": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr],
    "rope_store_bf16kv": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                          _ptr],
    "paged_attention_fp8kv": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                              _i64, _i64, _i64, _f32, _f32, _f32, _ptr, _i64],
    "rope_store_fp8kv": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                         _ptr, _f32, _f32],
    "paged_attention_int8kv": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                               _i64, _i64, _i64, _f32, _ptr, _i64],
    "rope_store_int8kv": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                          _ptr],
    "rms_norm_f32": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "rms_norm_f32_to_bf16": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "silu_mul_f32": [_ptr, _ptr, _i64, _i64],
    "round_f32_to_bf16": [_ptr, _i64],
    "silu_mul_bf16": [_ptr, _ptr, _i64, _i64],
    "pack_weight_f32": [_ptr, _i64, _i64, _i64, _ptr, _i64],
    "linear_packed_f32": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64],
    "gemm_panel_width": [],
    "pack_weight_bf16": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64],
    "linear_packed_bf16": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64],
    "linear_packed_bf16_avx512": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                                  _i64],
    "linear_packed_bf16_amx": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                               _i64],
    "linear_packed_bf16_silu_mul_amx": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                                        _i64, _i64],
    "linear_packed_bf16_silu_mul_avx512": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr,
                                           _ptr, _i64, _i64],
    "linear_packed_bf16_silu_mul": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                                    _i64, _i64],
    "gemm_bf16_panel_width": [],
    "gemm_bf16_supported": [],
    "gemm_bf16_amx_supported": [],
    "gemm_bf16_amx_chosen": [],
    "argmax_rows_f32": [_ptr, _i64, _i64, _i64, _ptr, _i64],
    "attention_amx_min_rows": [],
    "decoder_layers_f32": [_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _ptr,
                           _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr,
                           _ptr, _i64],
}  # fmt: skip
_RESTYPES = {
    "gemm_panel_width": _i64,
    "attention_amx_min_rows": _i64,
    "linear_packed_bf16": _i64,
    "decoder_layers_f32": _i64,
    "linear_packed_bf16_avx512": _i64,
    "linear_packed_bf16_amx": _i64,
    "linear_packed_bf16_silu_mul_amx": _i64,
    "linear_packed_bf16_silu_mul_avx512": _i64,
    "linear_packed_bf16_silu_mul": _i64,
    "gemm_bf16_panel_width": _i64,
    "gemm_bf16_supported": _i64,
    "gemm_bf16_amx_supported": _i64,
    "gemm_bf16_amx_chosen": _i64,
}


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or str(Path.home() / ".cache" / "pagedserve")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """The CPU's feature flags (``-march=native`` code is only valid on such a CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(CFLAGS).encode(), compiler.encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library (built on the first call), or ``None`` when unavailable.

    Unavailable means: ``PAGEDSERVE_CPU_KERNELS=0``, a non-x86_64/aarch64 Linux host, no
    C compiler, or a failed build (logged once as a warning with the compiler's output).
    """
    if not _flag("PAGEDSERVE_CPU_KERNELS"):
        return None
    if platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        log.warning("no C compiler found: CPU kernels fall back to the torch reference")
        return None
    try:
        path = _build(compiler)
        # torch has already loaded its libgomp.so.1: the library's libgomp.so.1 dependency
        # resolves to that copy, so both share one OpenMP thread pool and thread count.
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU kernels failed (%s): using the torch reference", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RESTYPES.get(name)
    return lib


def _flag(name: str) -> bool:
    """An on-by-default switch: False when the variable ``name`` is one of ``_FALSY``."""
    return os.environ.get(name, "1").strip().lower() not in _FALSY


def available() -> bool:
    """True when :func:`load` gives a library."""
    return load() is not None


def gemm_available() -> bool:
    """True when the library is built and ``PAGEDSERVE_CPU_GEMM`` is not falsy."""
    return _flag("PAGEDSERVE_CPU_GEMM") and available()


def fused_layers_enabled() -> bool:
    """True when the library is built and ``PAGEDSERVE_FUSED_LAYERS`` is not falsy (read
    once, when the model runner chooses its forward: ``pagedserve.worker.forward``)."""
    return _flag("PAGEDSERVE_FUSED_LAYERS") and available()


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (see cpu_native.load)")
    return lib


def _kv_suffix(key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """The C entry points' suffix for the caches' element type: ``f32``, ``bf16kv``,
    ``fp8kv`` or ``int8kv``.

    Raises:
        ValueError: a dtype not in :data:`KV_DTYPES`, or K and V of different dtypes.
    """
    if key_cache.dtype not in KV_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"the CPU kernels take fp32, bf16, fp8 or int8 KV caches of one dtype, got key_cache "
            f"{key_cache.dtype} and value_cache {value_cache.dtype}"
        )
    return _KV_SUFFIX[key_cache.dtype]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    amx_min_rows: int | None = None,
) -> torch.Tensor:
    """Causal paged attention of ragged chunks (decode = chunk of 1) on CPU.

    Args:
        query: fp32 ``[T, num_heads, head_dim]``; rows may be strided (e.g. a view into
            the fused qkv output); other layouts are copied to contiguous first.
        key_cache, value_cache: contiguous fp32, bf16 or fp8 e4m3fn ``[num_blocks,
            block_size, num_kv_heads, head_dim]`` (bf16, fp8: widened to fp32 per element;
            scores, softmax and the weighted sum in fp32), or int8 ``[num_blocks,
            block_size, num_kv_heads, head_dim + 4]`` (:mod:`pagedserve.kernels.int8`: each
            element read as ``float(q) * scale`` of its head's stored scale).
        block_tables: contiguous int32 ``[num_seqs, max_blocks]``.
        cu_seqlens_q: contiguous int32 ``[num_seqs + 1]``.
        seq_lens: contiguous int32 ``[num_seqs]`` (context + chunk, >= chunk length).
        scale: softmax scale.
        k_scale, v_scale: an fp8 cache's per-tensor scales (unused for the others).
        out: optional contiguous ``[T, num_heads, head_dim]`` destination.
        amx_min_rows: bf16 caches only: chunks of at least this many query rows run on
            tiles (``csrc/cpu_attention_amx.c``: Q and the probabilities rounded to bf16,
            fp32 sums; AMX tiles where :func:`amx_chosen`, else AVX512-BF16 (``VDPBF16PS``)
            register tiles), the shorter ones with the same contract on
            ``csrc/cpu_attention_decode_bf16.c``, both where the build targets AVX512-BF16
            and head_dim is a multiple of 32 up to 256, else on the fp32-arithmetic kernel;
            ``0``: all on the fp32-arithmetic kernel; ``None``: the process's setting,
            :func:`amx_attention_min_rows`.

    Returns:
        ``[T, num_heads, head_dim]`` fp32, contiguous.

    Raises:
        ValueError: from :func:`_kv_suffix` (a cache dtype the kernels do not take), or
            ``amx_min_rows < 0``.
    """
    suffix = _kv_suffix(key_cache, value_cache)
    if amx_min_rows is not None and amx_min_rows < 0:
        raise ValueError(f"amx_min_rows must be >= 0 or None, got {amx_min_rows}")
    rows = () if amx_min_rows is None or suffix != "bf16kv" else (amx_min_rows,)
    kernel = getattr(_lib(), "paged_attention_" + suffix + ("_rows" if rows else ""))
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    if num_tokens == 0:
        return out
    scales = (k_scale, v_scale) if key_cache.dtype == torch.float8_e4m3fn else ()
    kernel(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        cu_seqlens_q.data_ptr(), seq_lens.shape[0], num_heads, num_kv_heads, head_dim,
        block_size, scale, *scales, out.data_ptr(), torch.get_num_threads(), *rows,
    )  # fmt: skip
    return out


def amx_attention_min_rows() -> int:
    """Query rows from which a bf16-KV chunk's attention runs on tiles in this process
    (``PAGEDSERVE_CPU_AMX_ATTENTION``: ``0``/``off`` never, ``N`` from N rows, default 16),
    or 0 where the build does not target AVX512-BF16. The tiles are AMX tiles where
    :func:`amx_chosen`, else AVX512-BF16 (``VDPBF16PS``) register tiles (no AMX, or
    ``PAGEDSERVE_CPU_AMX=0``): the same contract, other bits. Where it is > 0 the shorter
    chunks (decode rows included) take the same contract on AVX512-BF16 dot products
    (``csrc/cpu_attention_decode_bf16.c``); where 0, every chunk runs on the
    fp32-arithmetic kernel. Read once per process; the :func:`paged_attention` default
    (``amx_min_rows=None``)."""
    return int(_lib().attention_amx_min_rows())


def rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotate the q and k heads of ``qkv`` in place, then store its K/V rows in the cache
    (into a bf16 cache rounded to nearest even: the bits of ``.to(torch.bfloat16)``; into
    an fp8 cache the bytes of :func:`pagedserve.kernels.fp8.quantize` of ``K / k_scale``
    and ``V / v_scale``; into an int8 cache those of :func:`pagedserve.kernels.int8.quantize`,
    each head vector with its scale).

    Args:
        qkv: contiguous fp32 ``[T, (num_heads + 2 * num_kv_heads) * head_dim]``.
        cos_table, sin_table: contiguous fp32 ``[max_positions, head_dim]``.
        positions: contiguous int64 ``[T]`` (``< max_positions``).
        slot_mapping: contiguous int64 ``[T]``; negative slots are not stored.
        key_cache, value_cache: contiguous fp32, bf16 or fp8 e4m3fn ``[num_blocks,
            block_size, num_kv_heads, head_dim]``, or int8 with ``head_dim + 4``.
        k_scale, v_scale: an fp8 cache's per-tensor scales (unused for the others).

    Raises:
        ValueError: from :func:`_kv_suffix` (a cache dtype the kernels do not take).
    """
    kernel = getattr(_lib(), "rope_store_" + _kv_suffix(key_cache, value_cache))
    kernel(
        qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim,
        cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(),
        slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        *((k_scale, v_scale) if key_cache.dtype == torch.float8_e4m3fn else ()),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` per row of contiguous fp32 ``x [N, hidden]``
    (fp32 ``weight [hidden]``).

    With ``residual`` (contiguous fp32 ``[N, hidden]``) it computes ``residual += x`` in
    place first and normalizes that sum (vLLM's ``fused_add_rms_norm``).

    Args:
        out_dtype: ``torch.float32``, or ``torch.bfloat16``: each fp32 result rounded to
            nearest even (the bits of the fp32 result's ``.to(torch.bfloat16)``, a NaN
            as ``0x7fc0``), the input a bf16 GEMM reads.

    Returns:
        A new ``[N, hidden]`` tensor of ``out_dtype``.

    Raises:
        ValueError: ``out_dtype`` neither fp32 nor bf16.
    """
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rms_norm: out_dtype must be float32 or bfloat16, got {out_dtype}")
    out = torch.empty(x.shape, dtype=out_dtype)
    fn = _lib().rms_norm_f32 if out_dtype == torch.float32 else _lib().rms_norm_f32_to_bf16
    fn(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.shape[0], x.shape[1], eps,
    )  # fmt: skip
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 CPU ``[N, V]`` with unit column stride, with
    torch's result: the lowest index of the maximum, a NaN counting as the maximum.

    Returns:
        int64 ``[N]``.
    """
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _lib().argmax_rows_f32(
            logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def round_to_bf16_(x: torch.Tensor) -> torch.Tensor:
    """Round each element of contiguous fp32 ``x`` to bf16 in place and return ``x``: the
    values of ``x.to(torch.bfloat16).float()`` (round to nearest even; a NaN stays a NaN,
    written as ``0x7fc0``, where torch's conversion may give another NaN pattern) without
    the two copies, in one pass (threaded above 2**20 elements).

    Raises:
        ValueError: ``x`` not a contiguous fp32 tensor.
    """
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(
            f"round_to_bf16_ takes a contiguous fp32 tensor, got {x.dtype} "
            f"{'contiguous' if x.is_contiguous() else 'non-contiguous'}"
        )
    if x.numel():
        _lib().round_f32_to_bf16(x.data_ptr(), x.numel())
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous ``gate_up [N, 2 * inter]`` -> ``[N, inter]`` of
    its dtype, fp32 or bf16. The arithmetic is fp32 either way: a bf16 input is widened
    exactly and each result rounded to nearest even, the bits of
    ``silu_mul(gate_up.float()).to(torch.bfloat16)`` (a NaN as ``0x7fc0``, where torch's
    vector conversion may keep its sign).

    Raises:
        ValueError: a dtype other than fp32/bf16, or an odd width.
    """
    rows, width = gate_up.shape
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or width % 2:
        raise ValueError(
            f"silu_mul takes fp32 or bf16 [N, 2 * inter], got {gate_up.dtype} "
            f"{tuple(gate_up.shape)}"
        )
    gate_up = gate_up.contiguous()
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    fn = _lib().silu_mul_f32 if gate_up.dtype == torch.float32 else _lib().silu_mul_bf16
    fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack an ``nn.Linear`` weight for :func:`linear_packed`.

    Args:
        weight: fp32 CPU ``[N, K]`` (``out_features x in_features``) with unit column
            stride.

    Returns:
        A new contiguous fp32 1-D tensor of ``ceil(N / NR) * K * NR`` floats (``NR`` =
        :func:`panel_width`): panel ``p`` holds ``packed[p, k, j] = weight[p * NR + j, k]``,
        zero past ``N``.

    Raises:
        ValueError: a weight that is not 2-D fp32 on CPU with unit column stride.
    """
    check_linear_weight(weight)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    width = panel_width()
    packed = torch.empty(((n + width - 1) // width) * k * width, dtype=torch.float32)
    _lib().pack_weight_f32(
        weight.data_ptr(), n, k, weight.stride(0), packed.data_ptr(), torch.get_num_threads()
    )
    return packed


@functools.cache
def panel_width() -> int:
    """Output columns per packed panel (``NR`` of ``csrc/cpu_gemm.c``)."""
    return int(_lib().gemm_panel_width())


def linear_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``weight`` packed by :func:`pack_linear_weight`.

    Args:
        x: fp32 ``[M, K]`` with unit column stride (rows may be strided).
        packed: the packed weight of an ``[out_features, K]`` matrix.
        out_features: ``N``.
        bias: optional contiguous fp32 ``[N]``.

    Returns:
        A new contiguous fp32 ``[M, N]``.

    Raises:
        ValueError: shapes that do not match the packed weight.
    """
    check_packed_linear(x, packed, out_features, bias, panel_width())
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, out_features), dtype=torch.float32)
    if m:
        linear_packed_fn()(
            x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


@functools.cache
def linear_packed_fn() -> Any:
    """The C entry point of :func:`linear_packed`, looked up once (it is called ~120 times
    per decode step): ``fn(x_ptr, m, k, ldx, packed_ptr, n, bias_ptr_or_None, out_ptr,
    ldo, num_threads)``. Callers must pass what :func:`linear_packed` checks."""
    return _lib().linear_packed_f32


@functools.cache
def has_bf16_gemm() -> bool:
    """True when the library is built and holds the AVX512-BF16 kernel of
    ``csrc/cpu_gemm_bf16.c`` (the compiler targets AVX512-BF16: ``-march=native`` on a CPU
    with ``avx512_bf16``). Where False, :func:`pack_bf16_linear_weight` and
    :func:`linear_packed_bf16` raise ``RuntimeError``."""
    lib = load()
    return lib is not None and bool(lib.gemm_bf16_supported())


@functools.cache
def has_amx() -> bool:
    """True when the bf16 GEMM can run on AMX tiles: the library holds the AMX kernel of
    ``csrc/cpu_gemm_bf16.c`` (the compiler targets AMX-TILE and AMX-BF16: ``-march=native`` on
    a CPU with ``amx_tile`` and ``amx_bf16``) and Linux granted the process the tile state
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, requested once by the library)."""
    return has_bf16_gemm() and bool(_lib().gemm_bf16_amx_supported())


def amx_chosen() -> bool:
    """True when :func:`linear_packed_bf16`'s ``kernel="auto"`` (and every C caller of
    ``linear_packed_bf16``) runs on AMX: :func:`has_amx` and ``PAGEDSERVE_CPU_AMX`` not
    falsy (read once per process, by the library)."""
    return has_amx() and bool(_lib().gemm_bf16_amx_chosen())


BF16_GEMM_KERNELS = ("auto", "amx", "avx512")


def _bf16_lib() -> ctypes.CDLL:
    if not has_bf16_gemm():
        raise RuntimeError("the AVX512-BF16 GEMM is not available (see cpu_native.has_bf16_gemm)")
    return _lib()


@functools.cache
def bf16_panel_width() -> int:
    """Output columns per bf16 panel (``NR`` of ``csrc/cpu_gemm_bf16.c``)."""
    return int(_lib().gemm_bf16_panel_width())


def bf16_packed_numel(out_features: int, in_features: int) -> int:
    """bf16 values in the packed form of an ``[out_features, in_features]`` weight:
    ``ceil(N / NR) * ceil(K / 2) * 2 * NR``."""
    width = bf16_panel_width()
    return -(-out_features // width) * -(-in_features // 2) * 2 * width


def pack_bf16_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack an ``nn.Linear`` weight into panels of bf16 pairs for :func:`linear_packed_bf16`.

    Args:
        weight: fp32 or bf16 CPU ``[N, K]`` (``out_features x in_features``) with unit
            column stride; fp32 is rounded to bf16 (nearest even, as ``weight.bfloat16()``).

    Returns:
        A new contiguous bf16 1-D tensor of :func:`bf16_packed_numel` values:
        ``packed.view(P, ceil(K / 2), NR, 2)[p, kk, j, e] = weight[p * NR + j, 2 * kk + e]``
        (``NR`` = :func:`bf16_panel_width`), zero past ``N`` and past ``K``.

    Raises:
        ValueError: a weight that is not 2-D fp32/bf16 on CPU.
        RuntimeError: no AVX512-BF16 kernel (:func:`has_bf16_gemm`).
    """
    check_linear_weight_bf16(weight)
    lib = _bf16_lib()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(bf16_packed_numel(n, k), dtype=torch.bfloat16)
    lib.pack_weight_bf16(
        weight.data_ptr(), int(weight.dtype is torch.bfloat16), n, k, weight.stride(0),
        packed.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return packed


def linear_packed_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """``bf16(x) @ bf16(weight).T + bias`` in fp32, ``weight`` packed by
    :func:`pack_bf16_linear_weight`.

    Each output element is an fp32 sum over K of exact bf16 products in an order fixed by K
    alone (see ``csrc/cpu_gemm_bf16.c``), so a row's result does not depend on the other
    rows; the AMX and AVX512-BF16 kernels round differently (both within fp32 rounding of
    the exact sum).

    Args:
        x: fp32 or bf16 ``[M, K]`` with unit column stride (rows may be strided); fp32 is
            rounded to bf16 (nearest even) inside the call.
        packed: the packed weight of an ``[out_features, K]`` matrix.
        out_features: ``N``.
        bias: optional contiguous fp32 ``[N]``.
        kernel: one of :data:`BF16_GEMM_KERNELS`: ``"auto"`` (AMX where :func:`amx_chosen`,
            else AVX512-BF16), ``"amx"`` or ``"avx512"`` (forced, for tests and A/B).

    Returns:
        A new contiguous fp32 ``[M, N]``.

    Raises:
        ValueError: dtypes or shapes that do not match the packed weight, or an unknown
            ``kernel``.
        RuntimeError: no AVX512-BF16 kernel, ``kernel="amx"`` without :func:`has_amx`, or
            the scratch could not be allocated.
    """
    check_packed_linear_bf16(x, packed, out_features, bias, bf16_panel_width())
    fn = linear_packed_bf16_fn(kernel)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, out_features), dtype=torch.float32)
    if m and fn(
        x.data_ptr(), int(x.dtype is torch.bfloat16), m, k, x.stride(0), packed.data_ptr(),
        out_features, None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
        torch.get_num_threads(),
    ):  # fmt: skip
        raise RuntimeError(f"linear_packed_bf16: no memory for {m} x {k} bf16 activations")
    return out


def linear_packed_bf16_silu_mul(
    x: torch.Tensor,
    packed: torch.Tensor,
    intermediate_size: int,
    bias: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor | None:
    """``bf16(silu(gate) * up)`` for ``[gate | up] = bf16(x) @ bf16(W_gate_up).T + bias``,
    in one call that never writes the ``[M, 2 * intermediate_size]`` fp32 product.

    The bits equal :func:`linear_packed_bf16` with the same ``kernel`` followed by
    :func:`silu_mul` and ``.to(torch.bfloat16)``: the epilogue runs the same SiLU on the
    fp32 sums and the same round-to-nearest-even (``csrc/cpu_gemm_bf16.c``,
    ``linear_packed_bf16_silu_mul_amx`` on tiles, ``linear_packed_bf16_silu_mul_avx512`` on
    AVX512-BF16 registers: a unit pairs 48 gate columns with the same 48 up columns; the
    fusion of vLLM's and SGLang's CPU MLP kernels).

    Args:
        x: fp32 or bf16 ``[M, K]`` with unit column stride.
        packed: the packed ``[2 * intermediate_size, K]`` gate_up weight
            (:func:`pack_bf16_linear_weight`: gate rows first, then up).
        intermediate_size: the MLP width ``I``.
        bias: optional contiguous fp32 ``[2 * I]``.
        kernel: ``"auto"`` (the kernel :func:`linear_packed_bf16` runs: AMX where
            :func:`amx_chosen`, else AVX512-BF16), ``"amx"`` or ``"avx512"``.

    Returns:
        bf16 ``[M, I]``, or None where the fused call does not apply (AMX: M <= 16 or ``I``
        not a multiple of 32; AVX512-BF16: M < 65, where the two calls are as fast, or
        ``I`` not a multiple of 16; either: ``PAGEDSERVE_CPU_FUSED_MLP=0``): the caller
        then runs the two calls.

    Raises:
        ValueError: as :func:`linear_packed_bf16` for ``N = 2 * I``; an unknown ``kernel``.
        RuntimeError: the activation scratch could not be allocated, or ``kernel="amx"``
            without :func:`has_amx`.
    """
    check_packed_linear_bf16(x, packed, 2 * intermediate_size, bias, bf16_panel_width())
    if kernel not in BF16_GEMM_KERNELS:
        raise ValueError(f"kernel must be one of {BF16_GEMM_KERNELS}, got {kernel!r}")
    if kernel == "amx" and not has_amx():
        raise RuntimeError("the AMX bf16 GEMM is not available (see cpu_native.has_amx)")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    lib = _lib()
    fn = {
        "auto": lib.linear_packed_bf16_silu_mul,
        "amx": lib.linear_packed_bf16_silu_mul_amx,
        "avx512": lib.linear_packed_bf16_silu_mul_avx512,
    }[kernel]
    act = torch.empty((m, intermediate_size), dtype=torch.bfloat16)
    rc = fn(
        x.data_ptr(), int(x.dtype is torch.bfloat16), m, k, x.stride(0), packed.data_ptr(),
        intermediate_size, None if bias is None else bias.data_ptr(), act.data_ptr(),
        intermediate_size, torch.get_num_threads(),
    )  # fmt: skip
    if rc == -3:
        return None
    if rc:
        raise RuntimeError(f"linear_packed_bf16_silu_mul: no memory for {m} x {k} activations")
    return act


@functools.cache
def linear_packed_bf16_fn(kernel: str = "auto") -> Any:
    """The C entry point of :func:`linear_packed_bf16` for ``kernel`` (see there), looked up
    once: ``fn(x_ptr, x_is_bf16, m, k, ldx, packed_ptr, n, bias_ptr_or_None, out_ptr, ldo,
    num_threads) -> 0`` (``-1`` when its scratch cannot be allocated). Callers must pass
    what :func:`linear_packed_bf16` checks.

    Raises:
        ValueError: ``kernel`` not in :data:`BF16_GEMM_KERNELS`.
        RuntimeError: no AVX512-BF16 kernel (:func:`has_bf16_gemm`), or ``kernel="amx"``
            without :func:`has_amx`.
    """
    if kernel not in BF16_GEMM_KERNELS:
        raise ValueError(f"kernel must be one of {BF16_GEMM_KERNELS}, got {kernel!r}")
    lib = _bf16_lib()
    if kernel == "amx" and not has_amx():
        raise RuntimeError("the AMX bf16 GEMM is not available (see cpu_native.has_amx)")
    return {
        "auto": lib.linear_packed_bf16,
        "amx": lib.linear_packed_bf16_amx,
        "avx512": lib.linear_packed_bf16_avx512,
    }[kernel]


class DecoderLayerPtrs(ctypes.Structure):
    """One layer's tensors for :func:`decoder_layers` (``decoder_layer_f32_t`` of
    ``csrc/cpu_decoder.c``): data pointers, ``None`` for a missing bias; ``kv_type`` is 0
    when the layer's KV caches are fp32, 1 when bf16, 2 when fp8 e4m3fn (read and written
    with ``k_scale`` and ``v_scale``), 3 when int8 (scales in the cache); ``w_bf16`` is 1 when its four
    weights are packed bf16 (:func:`pack_bf16_linear_weight`), 0 when packed fp32
    (:func:`pack_linear_weight`)."""

    _fields_ = [
        *(
            (name, _ptr)
            for name in (
                "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                "gate_up_bias", "down", "down_bias", "k_cache", "v_cache",
            )
        ),
        ("kv_type", _i64),
        ("w_bf16", _i64),
        ("k_scale", _f32),
        ("v_scale", _f32),
    ]  # fmt: skip


_WEIGHTS = ("qkv", "o", "gate_up", "down")  # DecoderLayerPtrs' packed weights


def decoder_layer_array(
    layers: list[dict[str, torch.Tensor | None]], kv_scale: tuple[float, float] = (1.0, 1.0)
) -> ctypes.Array[Any]:
    """A ctypes array of :class:`DecoderLayerPtrs`, one per dict of its pointer names to
    contiguous CPU tensors (or ``None`` for a bias): fp32, but the ``k_cache`` / ``v_cache``
    fp32, bf16, fp8 or int8 (``kv_type`` set from their dtype; fp8 read and written with
    ``kv_scale = (k_scale, v_scale)``) and the four packed weights fp32 or
    bf16 (``w_bf16`` set from their dtype). The caller keeps the tensors alive for as long
    as the array is used.

    Raises:
        ValueError: from :func:`_kv_suffix`, for a layer's caches; a layer whose packed
            weights are missing, of mixed dtypes or neither fp32 nor bf16.
    """
    array = (DecoderLayerPtrs * len(layers))()
    for entry, tensors in zip(array, layers):
        for name, tensor in tensors.items():
            setattr(entry, name, None if tensor is None else tensor.data_ptr())
        k_cache, v_cache = tensors["k_cache"], tensors["v_cache"]
        if k_cache is None or v_cache is None:
            raise ValueError("a decoder layer needs its k_cache and v_cache")
        entry.kv_type = ("f32", "bf16kv", "fp8kv", "int8kv").index(_kv_suffix(k_cache, v_cache))
        entry.k_scale, entry.v_scale = kv_scale
        weights = [tensors.get(name) for name in _WEIGHTS]
        dtypes = {None if w is None else w.dtype for w in weights}
        if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
            raise ValueError(
                f"a decoder layer's packed weights {_WEIGHTS} must all be fp32 or all bf16, "
                f"got {sorted(map(str, dtypes))}"
            )
        entry.w_bf16 = int(dtypes == {torch.bfloat16})
    return array


def decoder_layers(
    layers: ctypes.Array[Any],
    x: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Run every decoder layer of a step (see ``csrc/cpu_decoder.c``).

    Args:
        layers: from :func:`decoder_layer_array`, the KV caches included (contiguous fp32,
            bf16 or fp8 ``[num_blocks, block_size, num_kv_heads, head_dim]``).
        x: contiguous fp32 ``[T, hidden]``, the embeddings; overwritten with the last
            layer's MLP output.
        shape: ``(hidden, num_heads, num_kv_heads, head_dim, intermediate)``.
        eps, scale: RMSNorm epsilon and softmax scale.
        cos_table, sin_table, positions, slot_mapping, block_tables, seq_lens,
            cu_seqlens_q: as :func:`rope_store` and :func:`paged_attention` take them
            (validated by the caller).
        block_size: tokens per cache block.

    Returns:
        The residual stream ``[T, hidden]``: the layers' output is ``x + residual``.

    Raises:
        RuntimeError: a bf16 layer's GEMM failed (``linear_packed_bf16`` returned -1: its
            scratch could not be allocated, or the kernel is not built); ``x``, the
            residual and this step's cache slots then hold partial results.
    """
    hidden, num_heads, num_kv_heads, head_dim, inter = shape
    t = x.shape[0]
    residual = torch.empty_like(x)
    qkv = (num_heads + 2 * num_kv_heads) * head_dim
    scratch = torch.empty(t * (hidden + qkv + num_heads * head_dim + 3 * inter))
    failed = _lib().decoder_layers_f32(
        layers, len(layers), t, hidden, num_heads, num_kv_heads, head_dim, inter, eps, scale,
        cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(),
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), seq_lens.shape[0], block_size,
        x.data_ptr(), residual.data_ptr(), scratch.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise RuntimeError(
            f"decoder_layers: a bf16 linear layer failed on {t} rows (linear_packed_bf16 "
            "returned -1: no memory for its scratch, or the kernel is not built)"
        )
    return residual
