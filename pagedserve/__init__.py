"""pagedserve: an LLM serving cluster built around a paged KV cache (PagedAttention).

The public API, each name imported on first use (``import pagedserve`` loads neither torch
nor Ray nor gRPC):

- :class:`LLM`: the engine in this process, offline batch generation
  (``LLM(model="default").generate(prompts, SamplingParams(...))``, as vLLM's ``LLM``).
- :class:`SamplingParams`: how each request samples and stops.
- :class:`StructuredOutputs`: a constraint on the output (JSON schema, regex, choice,
  grammar), carried in ``SamplingParams(structured_outputs=...)``.
- :class:`RequestOutput`, :class:`CompletionOutput`: what :meth:`LLM.generate` returns.
- :class:`Client`, :class:`AsyncClient`: gRPC clients of a running server
  (``pagedserve serve``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.cluster.client import AsyncClient, Client
    from pagedserve.llm import LLM
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.scheduler.sampling_params import SamplingParams
    from pagedserve.scheduler.structured_outputs import StructuredOutputs

_EXPORTS = {
    "LLM": "pagedserve.llm",
    "SamplingParams": "pagedserve.scheduler.sampling_params",
    "StructuredOutputs": "pagedserve.scheduler.structured_outputs",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "Client": "pagedserve.cluster.client",
    "AsyncClient": "pagedserve.cluster.client",
}

__all__ = [
    "LLM",
    "AsyncClient",
    "Client",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
