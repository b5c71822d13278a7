"""The offline engine: the scheduler, one worker and the step loop in this process.

``LLM(model=..., **engine_options).generate(prompts, sampling_params)`` as vLLM's
``vllm.LLM``: no Ray, no gRPC. It drives the loop that serves
(:class:`~pagedserve.scheduler.engine_loop.EngineLoop`, overlapped unless
``async_scheduling=False``) over a :class:`~pagedserve.worker.worker.Worker` running on
a thread of its own, and turns token ids into text with the frontend's incremental
detokenizer (stop strings included, :mod:`pagedserve.cluster.detokenizer`).

Engine options are the fields of the configuration dataclasses, with their defaults:
:class:`~pagedserve.worker.config.ModelConfig` (``dtype``, ``max_model_len``,
``cache_dir``, ``batch_invariant``), :class:`~pagedserve.worker.config.CacheConfig`
(``block_size``, ``num_blocks`` or vLLM's name ``num_gpu_blocks``, ``kv_cache_memory``),
:class:`~pagedserve.worker.config.WorkerConfig` (``device``, ``num_threads``,
``attention_backend``, ``adaptive_threads``) and
:class:`~pagedserve.scheduler.config.SchedulerConfig` (``max_num_seqs``,
``max_num_batched_tokens``, ``enable_prefix_caching``, ``enable_chunked_prefill``,
``async_scheduling``, ``scheduling_policy``, ``speculative_config``: a
:class:`~pagedserve.scheduler.config.SpeculativeConfig` or its fields as a dict, ...). ``async_scheduling`` defaults to
overlapped on a GPU and serial on CPU (where the overlap's planning competes with the
model's kernels for the cores). ``seed`` seeds every request that
gives none (request k of this engine gets ``seed + k``). ``tensor_parallel_size`` T > 1
shards the model over T ranks: rank 0 in this process, the others local processes
(:mod:`pagedserve.worker.local_ranks`, gloo on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.scheduler.config import (
    MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker, ThreadWorker
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.errors import InvalidRequest, ServingError
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.local_ranks import LocalRanks, start_local_ranks

ALIASES = {"num_gpu_blocks": "num_blocks"}  # vLLM's name -> ours
# The scheduler's max_model_len comes from the worker's model (users set the model's).
_OWN = {"model", "max_model_len", "worker_id", "host_store_access", "cache"}


def split_engine_options(
    model: str, options: dict[str, Any]
) -> tuple[WorkerConfig, dict[str, Any]]:
    """Route each engine option to the config dataclass that has the field.

    Returns:
        The worker's config and the SchedulerConfig keyword arguments.

    Raises:
        ValueError: an option no config has, or a value a config refuses.
    """
    opts = {ALIASES.get(k, k): v for k, v in options.items()}
    seen: dict[type, dict[str, Any]] = {}
    for cls in (ModelConfig, CacheConfig, WorkerConfig, SchedulerConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        if cls is not ModelConfig:
            names -= _OWN
        seen[cls] = {k: opts.pop(k) for k in list(opts) if k in names}
    if opts:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(opts))}")
    worker = WorkerConfig(
        model=ModelConfig(model=model, **seen[ModelConfig]),
        cache=CacheConfig(**seen[CacheConfig]),
        **seen[WorkerConfig],
    )
    return worker, seen[SchedulerConfig]


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    choices: list[_Choice]
    num_cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class LLM:
    """An engine in this process for offline generation.

    Args:
        model: ``"default"`` (SmolLM2-135M-Instruct), a Hugging Face folder or a
            ``.gguf`` file (see :mod:`pagedserve.worker.model_store`).
        seed: seed of the requests that give none (None: random, as their default).
        **engine_options: see the module docstring.

    Raises:
        ValueError: an unknown option or a bad value (the message names it).
        ModelStoreError: the model cannot be found or converted.
    """

    def __init__(self, model: str = "default", seed: int | None = None, **engine_options: Any):
        from transformers import AutoTokenizer

        from pagedserve.worker.worker import Worker

        tp = int(engine_options.pop("tensor_parallel_size", 1))
        worker_config, sched_options = split_engine_options(model, engine_options)
        if sched_options.get("max_num_batched_tokens", 0) is None:
            # NOTE: None is serving's "the device's default"; offline that is 2,048
            # (throughput, not first-token latency), checked before the model loads.
            sched_options["max_num_batched_tokens"] = MAX_NUM_BATCHED_TOKENS
        spec = sched_options.get("speculative_config")
        if isinstance(spec, dict):  # vLLM's form: {"method": "ngram", ...}
            try:
                spec = sched_options["speculative_config"] = SpeculativeConfig(**spec)
            except TypeError as exc:
                raise ValueError(f"speculative_config: {exc}") from None
        if isinstance(spec, SpeculativeConfig) and spec.draft_model is not None:
            draft = dataclasses.replace(worker_config.model, model=spec.draft_model)
            worker_config = dataclasses.replace(worker_config, draft_model=draft)
        self._ranks: LocalRanks | None = None
        if tp > 1 and sched_options.get("speculative_config") is not None:
            raise ValueError("speculative decoding needs tensor_parallel_size 1")
        if tp > 1:
            self._ranks = start_local_ranks(worker_config, tp)
            worker_config = self._ranks.config
        elif tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        self._worker = Worker(worker_config)
        info = self._worker.get_info()
        self.info = info
        self.tokenizer = AutoTokenizer.from_pretrained(info.model_path)
        if "async_scheduling" not in sched_options:
            # NOTE: in process on CPU the model's kernels use every core, and an overlapped
            # loop's planning competes with them: measured on 2 cores, serial on the
            # caller's thread ran 32 x 64 greedy tokens ~10% faster than overlapped
            # (benchmarks/RESULTS.md, "Engine core"). On a GPU the overlap hides the
            # scheduler behind the device, as in serving.
            sched_options["async_scheduling"] = info.device != "cpu"
        config = SchedulerConfig(max_model_len=info.max_model_len, **sched_options)
        spec = WorkerSpec(0, info.num_blocks, info.block_size, info.dtype, info.kv_cache_dtype)
        self.scheduler = Scheduler(config, [spec])
        # Overlap queues each step on the worker's model thread and plans the next one
        # meanwhile; serial waits for each step here.
        self._handle: ThreadWorker | InlineWorker = (
            ThreadWorker(self._worker.execute_model, self._worker.model_thread.future)
            if config.async_scheduling
            else InlineWorker(self._worker.execute_model)
        )
        self._engine = EngineLoop(self.scheduler, {0: self._handle}, self._sink)
        self._aio = asyncio.new_event_loop()
        self._seed = seed
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._progress: Any = None

    # ------------------------------------------------------------------ public
    def generate(
        self,
        prompts: str | Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` each, in order.

        Args:
            prompts: a string, a list of strings, a list of token ids, a list of token id
                lists, or vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``.
            sampling_params: one for all prompts, or one per prompt (default:
                ``SamplingParams()``).
            use_tqdm: show a progress bar of finished requests.

        Raises:
            ValueError: malformed prompts or parameters (``InvalidRequest`` for a prompt
                the model cannot take: empty, too long, token ids out of range).
            ServingError: the scheduler's refusals (e.g. ``RequestRejected``: a prompt
                that no pool can hold); generation that stops short (all work aborted).
        """
        items = _prompts(prompts)
        params = _params(sampling_params, len(items))
        return self._run([(p, self._encode(p)) for p in items], params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """:meth:`generate` on conversations rendered with the tokenizer's chat template
        (plus the generation prompt). ``messages``: one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of them."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a conversation or a non-empty list of them")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        encoded = []
        for conv in convs:
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise ValueError("each message must be a dict with 'role' and 'content'")
            text = self.tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=True
            )
            encoded.append(
                (text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
            )
        return self._run(encoded, _params(sampling_params, len(encoded)), use_tqdm)

    def close(self) -> None:
        """Stop the worker's threads and the event loop (the model is freed with the
        object)."""
        self._handle.close()
        self._aio.close()
        if self._ranks is not None:
            self._worker.leave()
            self._ranks.close()
            self._ranks = None
        self._worker.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = self.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return list(prompt)

    def _run(
        self,
        prompts: list[tuple[Any, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        ids = []
        try:
            for (prompt, token_ids), sampling in zip(prompts, params):
                ids.append(self._add(prompt, token_ids, sampling))
            self._progress = _progress_bar(len(ids)) if use_tqdm else None
            if _in_event_loop():
                raise RuntimeError(
                    "LLM.generate blocks: from a running event loop call it in a thread "
                    "(asyncio.to_thread), or serve the model and use AsyncClient"
                )
            self._aio.run_until_complete(self._engine.run_until_idle())
            unfinished = [rid for rid in ids if not self._requests[rid].done]
            if unfinished:
                raise ServingError(f"generation stopped with {len(unfinished)} requests left")
            return [self._output(rid) for rid in ids]
        finally:
            for rid in ids:
                if not self._requests[rid].done:
                    self.scheduler.abort_request(rid)
                del self._requests[rid]
            if self._progress is not None:
                self._progress.close()
                self._progress = None

    def _add(self, prompt: Any, token_ids: list[int], sampling: SamplingParams) -> str:
        if sampling.structured_outputs is not None:
            try:  # the in-process worker's compiler: its LRU then serves the matchers
                self._worker.runner.structured.compiler.compile(sampling.structured_outputs)
            except ValueError as exc:
                raise InvalidRequest(str(exc), str(exc).split(":", 1)[0]) from None
        rid = str(next(self._ids))
        if sampling.seed is None and self._seed is not None:
            sampling = dataclasses.replace(sampling, seed=self._seed + int(rid))
        self.scheduler.add_request(
            EngineRequest(rid, tuple(token_ids), sampling, tuple(self.info.eos_token_ids))
        )
        detok = self.tokenizer.backend_tokenizer
        choices = [
            _Choice(
                IncrementalDetokenizer(
                    detok, sampling.stop, True, sampling.include_stop_str_in_output
                )
            )
            for _ in range(sampling.n)
        ]
        text = prompt if isinstance(prompt, str) else None
        self._requests[rid] = _Request(text, token_ids, sampling, choices)
        return rid

    def _sink(self, outputs: list[SequenceOutput]) -> None:
        """The engine loop's sink: accumulate each choice's ids, text and logprobs."""
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None or req.choices[out.choice_index].finish_reason is not None:
                continue
            choice = req.choices[out.choice_index]
            delta = choice.detok.step_output(out)
            kept = delta.num_token_ids  # fewer when a stop string ends a speculative run
            choice.token_ids.extend(out.new_token_ids[:kept])
            choice.text.append(delta.text)
            choice.logprobs.extend(out.logprobs[:kept])
            choice.cumulative_logprob = out.cumulative_logprob
            req.num_cached_tokens = out.num_cached_tokens
            if delta.finish_reason is None:
                continue
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            if out.finish_reason is None:  # a stop string ended the choice here
                self._sink(
                    self.scheduler.abort_request(
                        out.request_id, out.choice_index, FinishReason.STOP
                    )
                )
                self._engine.wake_all()
            if self._progress is not None and req.done:
                self._progress.update(1)

    def _output(self, rid: str) -> RequestOutput:
        req = self._requests[rid]
        wants_logprobs = req.sampling.logprobs is not None
        return RequestOutput(
            request_id=rid,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=i,
                    text="".join(c.text),
                    token_ids=tuple(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=tuple(c.logprobs) if wants_logprobs else None,
                    finish_reason=c.finish_reason.name.lower() if c.finish_reason else None,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(req.choices)
            ],
            num_cached_tokens=req.num_cached_tokens,
        )


def _prompts(prompts: Any) -> list[str | list[int]]:
    """Normalize ``generate``'s prompts to a list of strings and token id lists."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    items: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            p = p.get("prompt", p.get("prompt_token_ids"))
        if isinstance(p, str):
            items.append(p)
        elif isinstance(p, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p
        ):
            items.append(list(p))
        else:
            raise ValueError(
                "each prompt must be a string, a list of token ids, or a dict with "
                f"'prompt' or 'prompt_token_ids'; got {type(p).__name__}"
            )
    return items


def _params(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(
            f"sampling_params must be one SamplingParams or one per prompt ({count}), "
            f"got {len(params)}"
        )
    return params


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")


__all__ = ["LLM", "split_engine_options"]
