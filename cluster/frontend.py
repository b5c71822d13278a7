"""The gRPC frontend: validates and tokenizes requests, streams detokenized outputs.

Runs in the driver process on a ``grpc.aio`` server next to the standard health service
(``grpc.health.v1.Health``) and server reflection. Each ``Generate`` call becomes one
streaming call of the scheduler actor's ``generate``; a client that disconnects or calls
``Abort`` gets its request aborted and its KV blocks freed.

Status codes come from :mod:`pagedserve.scheduler.errors` (one lookup, ``err.status``):
malformed requests -> INVALID_ARGUMENT; a request larger than any worker's KV pool ->
RESOURCE_EXHAUSTED; a request id already in flight -> ALREADY_EXISTS; no live worker or an
unreachable scheduler -> UNAVAILABLE; anything else -> INTERNAL with a message.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.detokenizer import IncrementalDetokenizer
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    InvalidRequest,
    RequestRejected,
    ServingError,
)
from pagedserve.scheduler.request import FinishReason, SequenceOutput
from pagedserve.scheduler.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend must know about the served model and the cluster's pools.

    Attributes:
        name: model path or name (reported by GetStats).
        max_model_len: longest sequence, tokens.
        vocab_size: valid token ids are [0, vocab_size).
        eos_token_ids: ids ending a choice unless ignore_eos.
        max_kv_slots: the largest worker pool, in token slots (num_blocks * block_size).
    """

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_kv_slots: int


class PortUnavailable(RuntimeError):
    """The gRPC port cannot be bound (in use, or a bad host)."""


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before Ray and the model start, when ``host:port`` is taken.

    Raises:
        PortUnavailable: the port cannot be bound now.
    """
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortUnavailable(f"cannot bind {host}:{port}: {exc.strerror}") from exc


def sampling_from_proto(msg: Any, max_model_len: int) -> SamplingParams:
    """Build :class:`SamplingParams` from ``pagedserve.v1.SamplingParams``.

    Unset optional fields take the defaults. Raises InvalidRequest with a message naming
    the field on bad values.
    """

    def opt(name: str, default: Any) -> Any:
        return getattr(msg, name) if msg.HasField(name) else default

    for name in (
        "temperature",
        "top_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "length_penalty",
    ):
        if msg.HasField(name) and not math.isfinite(getattr(msg, name)):
            raise InvalidRequest(f"{name} must be a finite number")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in msg.stop):
        raise InvalidRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters")
    beam_width = opt("beam_width", 1)
    n = opt("n", beam_width if beam_width > 1 else 1)
    if n > MAX_N:
        raise InvalidRequest(f"n must be <= {MAX_N}, got {n}")
    max_tokens = opt("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens > max_model_len:
        raise InvalidRequest(f"max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})")
    top_k = opt("top_k", 0)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(opt("temperature", 1.0)),
            top_p=float(opt("top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,
            seed=opt("seed", None),
            n=n,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            ignore_eos=opt("ignore_eos", False),
            logprobs=opt("logprobs", None),
            repetition_penalty=float(opt("repetition_penalty", 1.0)),
            presence_penalty=float(opt("presence_penalty", 0.0)),
            frequency_penalty=float(opt("frequency_penalty", 0.0)),
            min_tokens=opt("min_tokens", 0),
            include_stop_str_in_output=opt("include_stop_str_in_output", False),
            cache_salt=opt("cache_salt", None),
            beam_width=beam_width,
            length_penalty=float(opt("length_penalty", 1.0)),
            priority=opt("priority", 0),
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


class GenerationServicer(pb_grpc.GenerationServicer):
    """Implements ``pagedserve.v1.Generation`` on top of the scheduler actor.

    Args:
        scheduler: the SchedulerActor handle.
        tokenizer: a Hugging Face fast tokenizer of the served model.
        info: model and pool facts.
    """

    def __init__(self, scheduler: Any, tokenizer: Any, info: ModelInfo) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._info = info
        self._in_flight: set[str] = set()
        # No token covers more UTF-8 bytes than the longest vocabulary entry's spelling
        # (byte-level or "▁"/"<0x..>" spellings only overestimate), so a text longer than
        # this many bytes cannot fit in max_model_len and is refused before tokenizing.
        longest = max((len(t.encode()) for t in tokenizer.get_vocab()), default=64)
        self._max_text_bytes = max(1, longest) * info.max_model_len
        self.health: Any = None  # set by start_server: the health servicer

    def _check_text_size(self, text: str) -> None:
        if len(text) > self._max_text_bytes or len(text.encode()) > self._max_text_bytes:
            raise InvalidRequest(
                f"the prompt text ({len(text.encode())} bytes) cannot fit in max_model_len "
                f"({self._info.max_model_len} tokens)"
            )

    # ------------------------------------------------------------------ helpers
    def _prompt_ids(self, request: Any) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("input.text is empty")
            self._check_text_size(request.text)
            return list(self._tokenizer(request.text)["input_ids"])
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            bad = [t for t in ids if t >= self._info.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"token id {bad[0]} is out of range [0, {self._info.vocab_size})"
                )
            return ids
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise InvalidRequest("input.chat has no messages")
            if len(messages) > self._info.max_model_len:
                raise InvalidRequest(
                    f"{len(messages)} chat messages cannot fit in max_model_len "
                    f"({self._info.max_model_len} tokens)"
                )
            for m in messages:
                if m["role"] not in ("system", "user", "assistant", "tool"):
                    raise InvalidRequest(f"unknown chat role {m['role']!r}")
            self._check_text_size("".join(m["content"] for m in messages))
            try:
                text = self._tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # template errors (e.g. role order) are the client's
                raise InvalidRequest(f"chat template failed: {exc}") from exc
            self._check_text_size(text)
            return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        raise InvalidRequest("request has no input (set text, token_ids or chat)")

    def _validate(self, request: Any) -> tuple[str, list[int], SamplingParams]:
        """Parse and check a request (runs on a thread: tokenizing may take a while)."""
        info = self._info
        sampling = sampling_from_proto(request.sampling, info.max_model_len)
        prompt = self._prompt_ids(request)
        if not prompt:
            raise InvalidRequest("the prompt tokenized to zero tokens")
        if len(prompt) + sampling.max_tokens > info.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"max_model_len ({info.max_model_len})"
            )
        for t in sampling.stop_token_ids:
            if t >= info.vocab_size:
                raise InvalidRequest(f"stop token id {t} is out of range")
        request_id = request.request_id or uuid.uuid4().hex
        if len(request_id) > 256:
            raise InvalidRequest("request_id is longer than 256 characters")
        return request_id, prompt, sampling

    # ------------------------------------------------------------------ RPCs
    async def _abort_with(self, context: Any, err: ServingError) -> None:
        """End the call with the error's own status (see pagedserve.scheduler.errors)."""
        if isinstance(err, ClusterUnavailable):
            await self._set_serving(False)
        await context.abort(grpc.StatusCode[err.status], str(err))

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            request_id, prompt, sampling = await asyncio.to_thread(self._validate, request)
            needed = len(prompt) + sampling.max_tokens  # per choice: choices can take turns
            if needed > self._info.max_kv_slots:
                raise RequestRejected(
                    f"a sequence of this request needs up to {needed} KV slots; the largest "
                    f"worker pool holds {self._info.max_kv_slots}"
                )
            if request_id in self._in_flight:
                raise DuplicateRequest(f"request_id {request_id!r} is in flight")
        except ServingError as exc:
            await self._abort_with(context, exc)
            return
        self._in_flight.add(request_id)
        detoks = [
            IncrementalDetokenizer(
                self._tokenizer.backend_tokenizer,
                sampling.stop,
                include_stop_str=sampling.include_stop_str_in_output,
            )
            for _ in range(sampling.n)
        ]
        done = [False] * sampling.n
        try:
            stream = self._scheduler.generate.remote(
                request_id, prompt, sampling, list(self._info.eos_token_ids)
            )
            async for ref in stream:
                batch: list[SequenceOutput] = await ref
                for out in batch:
                    if done[out.choice_index]:
                        continue
                    msg = self._to_proto(
                        request_id, out, detoks[out.choice_index], request, sampling
                    )
                    if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        done[out.choice_index] = True
                        if out.finish_reason is None:  # a stop string ended the choice
                            await self._scheduler.abort.remote(request_id, out.choice_index, True)
                    yield msg
                if all(done):
                    break
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if hasattr(exc, "cause") else exc
            if isinstance(cause, ServingError):
                await self._abort_with(context, cause)
            else:
                log.exception("request %s failed", request_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {cause!r}")
        except ray.exceptions.RayActorError as exc:
            await self._set_serving(False)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable: {exc}")
        finally:
            if not all(done):
                # Client went away (cancelled) or an error: make sure the blocks come back
                # before the id can be used again.
                try:
                    await asyncio.shield(self._scheduler.abort.remote(request_id))
                except Exception:  # best effort during shutdown
                    log.debug("abort of %s failed", request_id, exc_info=True)
            self._in_flight.discard(request_id)

    async def _set_serving(self, serving: bool) -> None:
        if self.health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def watch_health(self, interval_s: float = 2.0) -> None:
        """Keep the health status in line with the cluster: NOT_SERVING when the
        scheduler is unreachable or no worker is alive. Runs until cancelled."""
        while True:
            try:
                live = await asyncio.wait_for(
                    self._scheduler.num_live_workers.remote(), timeout=10 * interval_s
                )
                await self._set_serving(live > 0)
            except asyncio.CancelledError:
                raise
            except Exception:
                await self._set_serving(False)
            await asyncio.sleep(interval_s)

    def _to_proto(
        self,
        request_id: str,
        out: SequenceOutput,
        detok: IncrementalDetokenizer,
        request: Any,
        sampling: SamplingParams,
    ) -> Any:
        final = out.finish_reason is not None
        text_ids = out.new_token_ids
        if out.stop_reason is not None and not sampling.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # a stop token id ends the delta; its text is left out
        delta = detok.step(text_ids, final=final)
        msg = pb.GenerateResponse(request_id=request_id, index=out.choice_index)
        if request.return_token_ids:
            msg.delta_token_ids.extend(out.new_token_ids)
        msg.delta_text = delta.text
        for lp in out.logprobs:
            item = msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
            for tid, value in lp.top:
                item.top_logprobs.add(token_id=tid, logprob=value)
        if out.cumulative_logprob is not None:
            msg.cumulative_logprob = out.cumulative_logprob
        if out.score is not None:
            msg.score = out.score
        if delta.stop is not None:
            msg.stop_reason.stop = delta.stop
        elif out.stop_reason is not None:
            msg.stop_reason.token_id = out.stop_reason
        reason = FinishReason.STOP if delta.stopped else out.finish_reason
        if reason is not None:
            msg.finish_reason = reason.value
            msg.usage.prompt_tokens = out.num_prompt_tokens
            msg.usage.completion_tokens = out.num_output_tokens
            msg.usage.cached_tokens = out.num_cached_tokens
            msg.usage.num_preemptions = out.num_preemptions
        return msg

    async def Abort(self, request: Any, context: Any) -> Any:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        aborted = await self._scheduler.abort.remote(request.request_id)
        return pb.AbortResponse(aborted=bool(aborted))

    async def GetStats(self, request: Any, context: Any) -> Any:
        st = await self._scheduler.get_stats.remote()
        resp = pb.GetStatsResponse(
            num_requests_running=st.num_running,
            num_requests_waiting=st.num_waiting,
            num_preemptions=st.num_preemptions,
            model=self._info.name,
            max_model_len=self._info.max_model_len,
        )
        for w in st.workers:
            resp.workers.add(
                worker_id=w.worker_id,
                num_blocks=w.num_blocks,
                num_free_blocks=w.num_free_blocks,
                num_used_blocks=w.num_used_blocks,
                block_size=w.block_size,
                num_requests_running=w.num_running,
                alive=w.alive,
                num_requests_waiting=w.num_waiting,
                prefix_cache_hit_rate=w.prefix_cache_hit_rate,
            )
        return resp


async def start_server(config: ServerConfig, servicer: GenerationServicer) -> tuple[Any, int]:
    """Start the grpc.aio server with Generation, health and reflection.

    Returns:
        (server, bound port). Raises RuntimeError when the port cannot be bound.
    """
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server must fail to bind, not share the port
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        raise PortUnavailable(f"cannot bind {config.host}:{config.port}: {exc}") from exc
    if port == 0:
        raise PortUnavailable(f"cannot bind {config.host}:{config.port}")
    await server.start()
    servicer.health = health
    await servicer._set_serving(True)
    return server, port
