"""The OpenAI-compatible HTTP API: ``/v1/models`` (and ``/v1/models/{model}``),
``/v1/completions``, ``/v1/chat/completions``.

A thin transport over :meth:`~pagedserve.cluster.pipeline.RequestPipeline.run` (the request
path gRPC uses too): parse the JSON body (:mod:`pagedserve.cluster.openai_protocol`), hand
the prompt(s) and sampling fields to the pipeline, render its deltas as OpenAI's response
objects, or as Server-Sent Events (``data: {chunk}`` lines, then ``data: [DONE]``) with
``"stream": true``.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status looked up from the error's gRPC status name (:mod:`pagedserve.cluster.openai_render`
renders errors and responses): the same error classes that give gRPC statuses, and
``param`` naming the request's field. A body over the size limit is 400 (code
``payload_too_large``); one that is not JSON, nested too deeply for the parser, or holding
text that is not valid Unicode (a lone UTF-16 surrogate escape such as ``"\\ud800"``) is 400
too. A request too large for any KV pool (RESOURCE_EXHAUSTED) is 400, as it can never
succeed (429 would invite retries).
An unknown route (404) or method (405) gets the same error shape
(:meth:`OpenAIServer.exception_handlers`, installed by the app's builder).
Errors after a stream has started are sent as one ``data: {"error": ...}`` event before the
stream ends (the status line is already sent).

Each prompt of a request runs as its own pipeline stream (all of them admitted and prepared
before any is generated), read by its own task; when the client disconnects, the response
task is cancelled (streaming), or the wait for the whole response is (non-streaming: the
handler watches for the disconnect), which cancels those tasks and leaves each stream's
``run`` block, aborting its request (the scheduler frees its blocks). HTTP has no abort
call: a client aborts by disconnecting, as with vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus
from typing import Any, TypeVar, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from pagedserve.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    completion_inputs,
    sampling_request,
)
from pagedserve.cluster.openai_render import (
    ResponseRenderer,
    error_body,
    error_response,
)
from pagedserve.cluster.openai_structured import ToolPlan, tool_plan
from pagedserve.cluster.openai_tools import choose_parser, template_takes_tools
from pagedserve.cluster.pipeline import ChoiceDelta, RequestPipeline, RequestStream
from pagedserve.cluster.request_prep import GenerateInput, SamplingRequest, unicode_problem
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import (
    InvalidRequest,
    ModelNotFound,
    ServingError,
)

MERGE_QUEUE_SIZE = 16  # deltas of a request's prompts waiting for the response writer
CLIENT_CLOSED = 499  # the status logged for a request whose client went away (nginx's)
M = TypeVar("M", bound=BaseModel)
# JSON's escape of a UTF-16 surrogate (\uD800-\uDFFF): a body without one holds no lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyTooLarge(Exception):
    """The request body exceeds the server's limit (HTTP 400, code ``payload_too_large``)."""


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (an unknown route: 404, a method the route does not
    take: 405) in OpenAI's error shape; the code is the status phrase in snake case
    (``not_found``, ``method_not_allowed``). Install on the app as the handler of
    ``starlette.exceptions.HTTPException``."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status < 400:  # bodiless (e.g. 304), as Starlette's own handler answers them
        return Response(status_code=status, headers=exc.headers)
    try:
        code: str | None = HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        code = None
    body = error_body(
        f"{exc.detail} ({request.method} {request.url.path})",
        "invalid_request_error" if status < 500 else "server_error",
        None,
        code,
    )
    return JSONResponse(body, status_code=status, headers=exc.headers)


def find_lone_surrogate(data: Any) -> InvalidRequest | None:
    """The error of the first string (or key) of a decoded JSON document that is not valid
    Unicode (a lone surrogate, see :func:`~pagedserve.cluster.request_prep.unicode_problem`),
    naming its top-level field as ``param`` and its path in the message; None when all
    are valid. Iterative, so any nesting depth is fine."""
    stack: list[tuple[str | None, str, Any]] = [(None, "", data)]
    while stack:
        top, path, value = stack.pop()
        if isinstance(value, str):
            problem = unicode_problem(value)
            if problem is not None:
                where = path or "the body"
                return InvalidRequest(f"{where}: the text is not valid Unicode: {problem}", top)
        elif isinstance(value, list):
            stack.extend((top, f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            items = []
            for key, v in value.items():
                problem = unicode_problem(key)
                if problem is not None:
                    where = f"a field name in {path}" if path else "a field name"
                    return InvalidRequest(f"{where} is not valid Unicode: {problem}", top)
                items.append((key if top is None else top, f"{path}.{key}" if path else key, v))
            stack.extend(reversed(items))
    return None


async def read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The JSON object of the body, read up to ``max_body_bytes`` bytes.

    Raises:
        BodyTooLarge: the body is larger than the limit.
        InvalidRequest: not valid JSON (nested too deeply included), not a JSON object,
            or a string that is not valid Unicode (a lone surrogate escape; ``param`` its
            top-level field).
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise BodyTooLarge(f"the request body ({length} bytes) exceeds {max_body_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise BodyTooLarge(f"the request body exceeds {max_body_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise InvalidRequest("the body is not valid JSON: it is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and (err := find_lone_surrogate(data)) is not None:
        raise err
    return data


async def wait_disconnect(request: Request, poll_s: float = 0.2) -> None:
    """Return once the client has disconnected (checked every ``poll_s`` seconds with
    Starlette's non-blocking ``is_disconnected``; call after the body was read)."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


def _union_member(loc_part: str | int) -> bool:
    """Whether a part of an error's location is a union member's tag (a type such as
    ``str`` or ``list[int]``, or a model's class name; fields are lower case)."""
    if not isinstance(loc_part, str):
        return False
    return loc_part == "str" or loc_part.startswith(("list[", "dict[")) or loc_part[:1].isupper()


def parse_body(data: dict[str, Any], model: type[M]) -> M:
    """Validate ``data`` as ``model``; the first error becomes InvalidRequest naming the field
    (a value that is none of a union's types, e.g. ``"prompt": [true]``, names the types)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        path = errors[0]["loc"]
        # NOTE: a union's member names ("str", "list[int]") are in loc; fields are not.
        cut = next((i for i, p in enumerate(path) if _union_member(p)), len(path))
        loc = ".".join(str(p) for p in path[:cut])
        if cut == len(path):
            msg = errors[0]["msg"]
        else:
            kinds = dict.fromkeys(
                str(e["loc"][cut])
                for e in errors
                if len(e["loc"]) > cut and e["loc"][:cut] == path[:cut]
            )
            msg = f"Input should be one of {' | '.join(kinds)}"
        raise InvalidRequest(f"{loc}: {msg}", loc or None) from None


# The error statuses of the generating routes (HTTP_STATUS's, without INTERNAL).
GENERATE_ERRORS = (400, 404, 409, 503)
_COMPONENTS = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def _body_ref(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"$ref": _COMPONENTS.format(model=model.__name__)}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _responses(*statuses: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses: 200 a JSON object (or, ``stream``, Server-Sent Events), the
    others :class:`ErrorResponse`."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        if status == 200:
            content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
            if stream:
                content["text/event-stream"] = {"schema": {"type": "string"}}
            out[200] = {
                "description": "the response (a stream with stream: true)",
                "content": content,
            }
        else:
            ref = {"$ref": _COMPONENTS.format(model="ErrorResponse")}
            out[status] = {
                "description": HTTPStatus(status).phrase,
                "content": {"application/json": {"schema": ref}},
            }
    return out


def openapi_components() -> dict[str, Any]:
    """The OpenAPI schemas the routes refer to (the request bodies, their parts, the error
    body), for ``components.schemas`` (:func:`~pagedserve.cluster.http_server.create_app`
    adds them)."""
    out: dict[str, Any] = {}
    for model in (CompletionRequest, ChatCompletionRequest, ErrorResponse):
        schema = model.model_json_schema(ref_template=_COMPONENTS)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


class OpenAIServer:
    """The routes of the OpenAI-compatible API over one :class:`RequestPipeline`.

    Args:
        pipeline: the shared request path.
        model_names: names clients may send as ``model``; the first is the one reported.
        max_body_bytes: largest accepted request body, bytes.
        tool_call_parser: the tool-call format of the served model (a name of
            :data:`~pagedserve.cluster.openai_tools.PARSERS`); None picks it from the chat
            template (:func:`~pagedserve.cluster.openai_tools.choose_parser`).

    Raises:
        ValueError: no model name, or an unknown ``tool_call_parser``.
    """

    def __init__(
        self,
        pipeline: RequestPipeline,
        model_names: tuple[str, ...],
        max_body_bytes: int,
        tool_call_parser: str | None = None,
    ) -> None:
        if not model_names:
            raise ValueError("model_names must name at least one model")
        self.parser = choose_parser(pipeline.tokenizer, tool_call_parser)
        # NOTE: a template that never names `tools` would drop them silently: write the
        # tools, calls and results as text in the parser's format instead.
        self.render = None if template_takes_tools(pipeline.tokenizer) else self.parser
        self.pipeline = pipeline
        self.model_names = model_names
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    def router(self) -> APIRouter:
        """An APIRouter with the routes (add it with ``app.include_router``, and
        :meth:`exception_handlers` to the app); their bodies and responses are documented
        in the app's OpenAPI schema with :func:`openapi_components`."""
        router = APIRouter()
        router.add_api_route("/v1/models", self.models, methods=["GET"], responses=_responses(200))
        router.add_api_route(
            "/v1/models/{model:path}",
            self.retrieve_model,
            methods=["GET"],
            responses=_responses(200, 404),
        )
        for path, endpoint, body in (
            ("/v1/completions", self.completions, CompletionRequest),
            ("/v1/chat/completions", self.chat_completions, ChatCompletionRequest),
        ):
            router.add_api_route(
                path,
                endpoint,
                methods=["POST"],
                responses=_responses(200, *GENERATE_ERRORS, stream=True),
                openapi_extra={"requestBody": _body_ref(body)},
            )
        return router

    @staticmethod
    def exception_handlers() -> dict[Any, Callable[..., Any]]:
        """The app's handlers that keep OpenAI's error shape for the app's own errors
        (unknown route, wrong method): pass them to
        :func:`~pagedserve.cluster.http_server.create_app`."""
        return {HTTPException: http_error_handler}

    def _card(self, model_id: str) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "root": self.pipeline.info.name,
            "max_model_len": self.pipeline.info.max_model_len,
        }

    async def models(self) -> JSONResponse:
        """``GET /v1/models``: the served model."""
        return JSONResponse({"object": "list", "data": [self._card(self.model_names[0])]})

    async def retrieve_model(self, model: str) -> JSONResponse:
        """``GET /v1/models/{model}``: the model's entry of ``/v1/models`` (under the name
        asked for, any of ``model_names``), else 404 ``model_not_found``."""
        if model not in self.model_names:
            return error_response(ModelNotFound(f"the model {model!r} does not exist", "model"))
        return JSONResponse(self._card(model))

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._handle(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._handle(request, ChatCompletionRequest)

    # ------------------------------------------------------------------ request path
    async def _handle(self, request: Request, model: type[BaseModel]) -> Response:
        fields = frozenset(model.model_fields)
        rename: Callable[[str], str] | None = None
        try:
            body = cast(
                CompletionRequest | ChatCompletionRequest,
                parse_body(await read_json(request, self.max_body_bytes), model),
            )
            rename = body.http_param
            if body.model not in self.model_names:
                raise ModelNotFound(f"the model {body.model!r} does not exist", "model")
            body.check_supported()
            chat = isinstance(body, ChatCompletionRequest)
            plan: ToolPlan | None = None
            if isinstance(body, ChatCompletionRequest):
                plan = tool_plan(body, self.parser)
                inputs = [chat_input(body, plan, self.render)]
            else:
                inputs = completion_inputs(body)
            sampling = sampling_request(body, plan)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            prepared, stream, first = await self._start(inputs, sampling, request_id)
        except BodyTooLarge as exc:
            return JSONResponse(
                error_body(str(exc), "invalid_request_error", None, "payload_too_large"),
                status_code=400,  # a client error, as the API's other refusals
            )
        except ServingError as exc:
            return error_response(exc, fields, rename)
        render = ResponseRenderer(
            self.pipeline.tokenizer, body, request_id, prepared, chat, fields, plan
        )
        if body.stream:
            return StreamingResponse(
                render.sse(first, stream),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        collect = asyncio.ensure_future(render.collect(first, stream))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client went away: abort now, not at max_tokens
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(collect.result())
        except ServingError as exc:
            return error_response(exc, fields, rename)
        finally:
            gone.cancel()
            await stream.aclose()  # on any early exit: cancel the streams, free the blocks

    async def _start(
        self, inputs: list[GenerateInput], sampling: SamplingRequest, request_id: str
    ) -> tuple[
        list[EngineRequest], AsyncGenerator[tuple[int, ChoiceDelta], None], tuple[int, ChoiceDelta]
    ]:
        """Run every prompt through :meth:`RequestPipeline.run` (prompt ``i`` of several as
        ``{request_id}-{i}``); returns the prepared requests, the merged deltas
        (:meth:`_merged`, which ends every run) and the first delta.

        The first delta is awaited here so that errors raised when the scheduler admits
        the request (e.g. no live worker) still get their own HTTP status. On any error
        every run already started is ended (aborted, its id released) before it is raised.
        """
        runs = contextlib.AsyncExitStack()
        try:
            streams = [
                await runs.enter_async_context(
                    self.pipeline.run(
                        inp, sampling, request_id if len(inputs) == 1 else f"{request_id}-{i}"
                    )
                )
                for i, inp in enumerate(inputs)
            ]
            merged = self._merged(streams, runs)
            first = await anext(merged)
        except BaseException:
            await runs.aclose()
            raise
        return [s.request for s in streams], merged, first

    async def _merged(
        self, streams: list[RequestStream], runs: contextlib.AsyncExitStack
    ) -> AsyncGenerator[tuple[int, ChoiceDelta], None]:
        """Deltas of every prompt's stream as ``(prompt index, delta)``, as they come.

        Each stream is read by its own task; closing this generator (or cancelling its
        consumer) cancels them and then closes ``runs`` (the streams' ``run`` blocks),
        which aborts every unfinished request.
        """
        # NOTE: bounded, so a client that stops reading holds the deltas in the pipeline,
        # whose own bound (max_stream_buffer) then aborts the request.
        queue: asyncio.Queue[tuple[int, ChoiceDelta | BaseException | None]] = asyncio.Queue(
            maxsize=MERGE_QUEUE_SIZE
        )

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    await queue.put((i, delta))
                await queue.put((i, None))
            except Exception as exc:
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await runs.aclose()
