"""The worker side of pagedserve: model, KV pool, sampler, model runner and the Worker.

Modules: ``arch`` (config.json -> ModelArch), ``layers`` (RMSNorm, RoPE, SwiGLU),
``attention`` (AttentionMetadata, paged attention call), ``model`` (Llama-family
decoder), ``weights`` (safetensors loading), ``kv_pool`` (per-layer K/V blocks),
``sampler``, ``input_batch`` (per-request state, step flattening), ``model_runner``
(executes a SchedulerOutput) and ``worker`` (the object the Ray actor wraps).
Nothing is imported here so that ``import pagedserve.worker`` stays cheap.
"""
