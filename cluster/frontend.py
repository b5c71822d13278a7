"""The gRPC transport: protobuf in and out of the shared request path.

Runs in the driver process on a ``grpc.aio`` server next to the standard health service
(``grpc.health.v1.Health``) and server reflection. Admission, validation, tokenization,
chat templating, detokenization, stop strings and the scheduler call live behind
:meth:`pagedserve.cluster.pipeline.RequestPipeline.run` (shared with the OpenAI-compatible
HTTP API); this module only converts messages. A client that disconnects or calls
``Abort`` gets its request aborted and its KV blocks freed; an ``Abort`` that overtakes
its ``Generate`` ends that request at once when it arrives (see
:mod:`pagedserve.cluster.flights`).

Status codes come from :mod:`pagedserve.scheduler.errors` (one lookup, ``err.status``):
malformed requests -> INVALID_ARGUMENT; a request larger than any worker's KV pool ->
RESOURCE_EXHAUSTED; a request id already in flight -> ALREADY_EXISTS; no live worker or an
unreachable scheduler -> UNAVAILABLE; anything else -> INTERNAL with a message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedserve.cluster.auth import ApiKeyInterceptor, grpc_server_credentials
from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.pipeline import ChoiceDelta, RequestPipeline
from pagedserve.cluster.request_prep import GenerateInput, ModelInfo, SamplingRequest
from pagedserve.cluster.wire import MalformedRequest, safe_parser
from pagedserve.scheduler.errors import ClusterUnavailable, InvalidRequest, ServingError
from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
__all__ = ["GenerationServicer", "ModelInfo", "PortUnavailable", "check_port_free", "start_server"]


class PortUnavailable(RuntimeError):
    """The gRPC port cannot be bound (in use, or a bad host)."""


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before Ray and the model start, when ``host:port`` is taken.

    The probe binds with ``SO_REUSEADDR`` (as the gRPC and HTTP servers do, and not
    ``SO_REUSEPORT``): connections of a server that just stopped, left in TIME-WAIT, do
    not refuse it, while a socket listening on the port does.

    Raises:
        PortUnavailable: the port cannot be bound now.
    """
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            raise PortUnavailable(f"cannot bind {host}:{port}: {exc.strerror}") from exc


def structured_from_proto(msg: Any) -> StructuredOutputs:
    """``pagedserve.v1.StructuredOutputs`` as a :class:`StructuredOutputs`.

    Raises:
        InvalidRequest: no kind set, or a bad one (the message names the field).
    """
    kind = msg.WhichOneof("kind")
    field = f"structured_outputs.{kind or 'kind'}"
    if kind is None:
        raise InvalidRequest(
            "structured_outputs: set one of json_schema, json_object, regex, choice, grammar",
            field,
        )
    value = getattr(msg, kind)
    try:
        if kind == "json_schema":
            return StructuredOutputs(json=value, strict=msg.strict)
        if kind == "choice":
            return StructuredOutputs(choice=tuple(value.choices))
        return StructuredOutputs(**{kind: value})
    except ValueError as exc:
        raise InvalidRequest(f"{field}: {exc}", field) from None


def sampling_from_proto(msg: Any) -> SamplingRequest:
    """``pagedserve.v1.SamplingParams`` as a :class:`SamplingRequest` (unset = ``None``).

    Raises:
        InvalidRequest: a malformed ``structured_outputs``.
    """
    fields = {
        f.name: getattr(msg, f.name)
        for f in dataclasses.fields(SamplingRequest)
        if f.name not in ("stop", "stop_token_ids", "structured_outputs") and msg.HasField(f.name)
    }
    if msg.HasField("structured_outputs"):
        fields["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    return SamplingRequest(
        stop=tuple(msg.stop), stop_token_ids=tuple(int(t) for t in msg.stop_token_ids), **fields
    )


def input_from_proto(request: Any) -> GenerateInput:
    """The ``input`` oneof of a ``GenerateRequest`` as a :class:`GenerateInput`."""
    kind = request.WhichOneof("input")
    if kind == "text":
        return GenerateInput(text=request.text)
    if kind == "token_ids":
        return GenerateInput(token_ids=tuple(request.token_ids.ids))
    if kind == "chat":
        return GenerateInput(messages=tuple((m.role, m.content) for m in request.chat.messages))
    return GenerateInput()


class GenerationServicer(pb_grpc.GenerationServicer):
    """Implements ``pagedserve.v1.Generation``: protobuf in and out of the shared
    :class:`RequestPipeline` (which owns all request logic).

    Args:
        pipeline: the request path shared with the HTTP API.
    """

    def __init__(self, pipeline: RequestPipeline) -> None:
        self.pipeline = pipeline
        self._scheduler = pipeline.scheduler
        self._info = pipeline.info
        self.health: Any = None  # set by start_server: the health servicer

    async def _abort_with(self, context: Any, err: ServingError) -> None:
        """End the call with the error's own status (see pagedserve.scheduler.errors)."""
        if isinstance(err, ClusterUnavailable):
            await self._set_serving(False)
        await context.abort(grpc.StatusCode[err.status], str(err))

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            prompt, sampling = input_from_proto(request), sampling_from_proto(request.sampling)
            # A cancelled call leaves the block: the request is aborted there.
            async with self.pipeline.run(prompt, sampling, request.request_id) as stream:
                request_id = stream.request.request_id
                async for delta in stream:
                    yield self._to_proto(request_id, delta, request.return_token_ids)
        except ServingError as exc:
            if exc.status == "INTERNAL":
                log.error("request failed: %s", exc)
            await self._abort_with(context, exc)

    async def _set_serving(self, serving: bool) -> None:
        if self.health is None:
            return
        serving = serving and self.pipeline.flights.serving  # draining / scheduler down
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def watch_health(self, interval_s: float = 0.5) -> None:
        """Keep the health status in line with the cluster: NOT_SERVING when the
        scheduler is unreachable or no worker is alive, and while draining. Runs until
        cancelled."""
        while True:
            try:
                live = 0
                if self.pipeline.flights.scheduler_up:
                    live = await asyncio.wait_for(
                        self._scheduler.num_live_workers.remote(), timeout=10 * interval_s
                    )
                await self._set_serving(live > 0)
            except asyncio.CancelledError:
                raise
            except Exception:
                await self._set_serving(False)
            await asyncio.sleep(interval_s)

    async def set_not_serving(self) -> None:
        """Health NOT_SERVING now (a drain started); :meth:`watch_health` keeps it so."""
        await self._set_serving(False)

    @staticmethod
    def _to_proto(request_id: str, delta: ChoiceDelta, return_token_ids: bool) -> Any:
        msg = pb.GenerateResponse(request_id=request_id, index=delta.index)
        if return_token_ids:
            msg.delta_token_ids.extend(delta.token_ids)
        msg.delta_text = delta.text
        for lp in delta.logprobs:
            item = msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
            for tid, value in lp.top:
                item.top_logprobs.add(token_id=tid, logprob=value)
        if delta.cumulative_logprob is not None:
            msg.cumulative_logprob = delta.cumulative_logprob
        if delta.score is not None:
            msg.score = delta.score
        if isinstance(delta.stop_reason, str):
            msg.stop_reason.stop = delta.stop_reason
        elif delta.stop_reason is not None:
            msg.stop_reason.token_id = delta.stop_reason
        if delta.finish_reason is not None:
            msg.finish_reason = pb.FinishReason.ValueType(delta.finish_reason.value)
        if delta.usage is not None:
            msg.usage.prompt_tokens = delta.usage.prompt_tokens
            msg.usage.completion_tokens = delta.usage.completion_tokens
            msg.usage.cached_tokens = delta.usage.cached_tokens
            msg.usage.num_preemptions = delta.usage.num_preemptions
        return msg

    async def Abort(self, request: Any, context: Any) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            aborted = await self.pipeline.abort(request.request_id)
        except ServingError as exc:
            await self._abort_with(context, exc)
        return pb.AbortResponse(aborted=bool(aborted))

    async def GetStats(self, request: Any, context: Any) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        st = await self._scheduler.get_stats.remote()
        resp = pb.GetStatsResponse(
            num_requests_running=st.num_running,
            num_requests_waiting=st.num_waiting,
            num_preemptions=st.num_preemptions,
            num_recomputed_tokens=st.num_recomputed_tokens,
            model=self._info.name,
            max_model_len=self._info.max_model_len,
        )
        sw = st.swap
        resp.swap.CopyFrom(
            pb.SwapStats(
                preemption_mode=sw.preemption_mode,
                num_requests_swapped=sw.num_requests_swapped,
                host_blocks_total=sw.host_blocks_total,
                host_blocks_free=sw.host_blocks_free,
                swap_out_bytes=sw.swap_out_bytes,
                swap_in_bytes=sw.swap_in_bytes,
                num_swap_outs=sw.num_swap_outs,
                num_swap_ins=sw.num_swap_ins,
                num_swap_failures=sw.num_swap_failures,
                num_remote_swap_ins=sw.num_remote_swap_ins,
                remote_swap_in_bytes=sw.remote_swap_in_bytes,
                preemptions_by_mode=sw.preemptions_by_mode,
                host_prefix=pb.HostPrefixStats(**dataclasses.asdict(sw.host_prefix)),
            )
        )
        sd = st.spec_decode
        resp.spec_decode.CopyFrom(
            pb.SpecDecodeStats(
                num_drafts=sd.num_drafts,
                num_draft_tokens=sd.num_draft_tokens,
                num_accepted_tokens=sd.num_accepted_tokens,
                acceptance_rate=sd.acceptance_rate,
                mean_accepted_length=sd.mean_accepted_length,
            )
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
                num_preemptions=w.num_preemptions,
                num_recomputed_tokens=w.num_recomputed_tokens,
                dtype=w.dtype,
                kv_cache_dtype=w.kv_cache_dtype,
                can_swap=w.swap.can_swap,
                num_swap_outs=w.swap.num_swap_outs,
                num_swap_ins=w.swap.num_swap_ins,
                num_swap_failures=w.swap.num_swap_failures,
                num_remote_swap_ins=w.swap.num_remote_swap_ins,
                remote_swap_in_bytes=w.swap.remote_swap_in_bytes,
            )
        return resp


def add_generation_service(servicer: GenerationServicer, server: Any) -> None:
    """Register ``pagedserve.v1.Generation`` as the generated ``add_..._to_server`` does,
    but with request parsers that turn malformed bytes into INVALID_ARGUMENT naming the
    field (:func:`pagedserve.cluster.wire.safe_parser`) instead of grpc's UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=safe_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


async def start_server(config: ServerConfig, servicer: GenerationServicer) -> tuple[Any, int]:
    """Start the grpc.aio server with Generation, health and reflection; over TLS when
    ``config`` names a certificate, behind the API-key check when it has a key
    (:mod:`pagedserve.cluster.auth`).

    Returns:
        (server, bound port). Raises PortUnavailable when the port cannot be bound,
        ValueError when a TLS file cannot be read.
    """
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server must fail to bind, not share the port
    ]
    interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    add_generation_service(servicer, server)
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
        address = f"{config.host}:{config.port}"
        if config.tls_cert is not None and config.tls_key is not None:
            creds = grpc_server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise PortUnavailable(f"cannot bind {config.host}:{config.port}: {exc}") from exc
    if port == 0:
        raise PortUnavailable(f"cannot bind {config.host}:{config.port}")
    await server.start()
    servicer.health = health
    await servicer._set_serving(True)
    return server, port
