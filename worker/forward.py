"""Choosing the model's forward once, when the runner has its weights and KV pool.

A :class:`~pagedserve.worker.model.ModelForward` decides how a step runs the decoder
layers and the head; the runner picks one at construction with :func:`select_forward`
(after the weights are packed and the KV pool is allocated) and installs it with
:meth:`~pagedserve.worker.model.LlamaForCausalLM.use_forward`, so no step re-decides it
(as nano-vllm's ``run_model`` picks eager or CUDA graph, or mini-sglang's attention
backend registry picks a backend by device).

:data:`FORWARDS` lists the specialised forwards, most specialised first; each ``build``
returns ``None`` when it does not apply to the model (device, dtype, library, packed
weights, environment switches) and the generic
:class:`~pagedserve.worker.model.LayerForward` takes what none claims. A new path (another
dtype's kernels, a sharded model) is one more entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.worker.cpu_forward import CpuLayerForward, FusedCpuForward
from pagedserve.worker.model import KVCache, LayerForward, LlamaForCausalLM, ModelForward

ForwardBuilder = Callable[[LlamaForCausalLM, Sequence[KVCache]], ModelForward | None]

FORWARDS: tuple[ForwardBuilder, ...] = (FusedCpuForward.build, CpuLayerForward.build)


def select_forward(
    model: LlamaForCausalLM,
    kv_caches: Sequence[KVCache],
    candidates: Sequence[ForwardBuilder] = FORWARDS,
) -> ModelForward:
    """The first of ``candidates`` that applies to ``model`` and ``kv_caches``, else
    :class:`~pagedserve.worker.model.LayerForward`.

    Args:
        model: the loaded model, weights final (packed or batch-invariant already).
        kv_caches: per layer ``(key_cache, value_cache)``, the caches every step will use.
        candidates: builders to try in order (default :data:`FORWARDS`).

    Returns:
        The forward to install with ``model.use_forward``.
    """
    for build in candidates:
        chosen = build(model, kv_caches)
        if chosen is not None:
            return chosen
    return LayerForward()


__all__ = ["FORWARDS", "ForwardBuilder", "select_forward"]
