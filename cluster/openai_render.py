"""The response side of the OpenAI-compatible API: error objects, response objects and
Server-Sent Events.

:func:`error_json` maps a :class:`ServingError` to its HTTP status and OpenAI's error
object (one lookup by the error's gRPC status name, :data:`HTTP_STATUS`);
:class:`ResponseRenderer` turns one request's :class:`ChoiceDelta` items (from
:mod:`pagedserve.cluster.pipeline`) into a ``text_completion`` / ``chat.completion`` object,
or into its chunks (``data: {chunk}`` lines, then ``data: [DONE]``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from pagedserve.cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.cluster.openai_structured import ToolPlan
from pagedserve.cluster.openai_tools import Call, Content, Event, ToolStream, parse
from pagedserve.cluster.pipeline import ChoiceDelta
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import InvalidRequest, ModelNotFound, RequestRejected, ServingError
from pagedserve.scheduler.outputs import SampleLogprobs

# gRPC status name (pagedserve.scheduler.errors) -> (HTTP status, OpenAI error type).
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "INTERNAL": (500, "server_error"),
}
SSE_DONE = "data: [DONE]\n\n"


def error_body(message: str, err_type: str, param: str | None, code: str | None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_json(
    exc: ServingError,
    fields: frozenset[str] = frozenset(),
    rename: Callable[[str], str] | None = None,
) -> tuple[int, dict]:
    """(HTTP status, OpenAI error object) of a :class:`ServingError`: one lookup by its
    status.

    ``param`` is the error's own, else (a refusal of the request: INVALID_ARGUMENT or
    RESOURCE_EXHAUSTED) the message's first word, a trailing ":" dropped, when it is one
    of ``fields``: the shared validation names the field first ("temperature must be ...",
    "max_tokens: ..."). ``rename`` turns the pipeline's field names (gRPC's: ``text``,
    ``chat``, ``beam_width``, ...) into the request's (``prompt``, ``messages``, ``n``).
    """
    status, err_type = HTTP_STATUS.get(exc.status, HTTP_STATUS["INTERNAL"])
    param = getattr(exc, "param", None)
    if param is not None:
        param = rename(param) if rename is not None else param
    elif isinstance(exc, InvalidRequest | RequestRejected):
        first = str(exc).split(" ", 1)[0].removesuffix(":")
        first = rename(first) if rename is not None else first
        param = first if first in fields else None
    code = "model_not_found" if isinstance(exc, ModelNotFound) else exc.status.lower()
    return status, error_body(str(exc), err_type, param, code)


def error_response(
    exc: ServingError,
    fields: frozenset[str] = frozenset(),
    rename: Callable[[str], str] | None = None,
) -> JSONResponse:
    """The JSON error response of a :class:`ServingError` (see :func:`error_json`)."""
    status, body = error_json(exc, fields, rename)
    return JSONResponse(body, status_code=status)


@dataclass
class _Choice:
    """A finished choice being collected for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ResponseRenderer:
    """Turns a request's deltas into OpenAI response objects or SSE chunks.

    Args:
        tokenizer: the served model's tokenizer (token strings of logprobs).
        body: the parsed request.
        request_id: the response ``id``.
        prepared: the request of each prompt (prompt ``p``'s choice ``i`` is response
            choice ``p * n + i``).
        chat: a chat completion (else a text completion).
        fields: the request model's field names (the ``param`` of errors).
        tools: a chat request's tools: each choice's text is read for tool calls
            (``message.tool_calls`` / ``delta.tool_calls``, ``finish_reason``
            ``"tool_calls"``); None: the text is all content.
    """

    def __init__(
        self,
        tokenizer: Any,
        body: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        prepared: list[EngineRequest],
        chat: bool,
        fields: frozenset[str] = frozenset(),
        tools: ToolPlan | None = None,
    ) -> None:
        self.body = body
        self.tools = tools
        self.tool_streams: dict[int, ToolStream] = {}  # choice index -> its calls so far
        self.fields = fields
        self.request_id = request_id
        self.prepared = prepared
        self.chat = chat
        self.model = body.model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.n = prepared[0].sampling.n
        self.usage: dict[int, Any] = {}  # choice index -> its Usage
        self.streamed: dict[int, int] = {}  # choice index -> tokens streamed so far
        self.text_offset: dict[int, int] = {}

    def _index(self, prompt_index: int, delta: ChoiceDelta) -> int:
        return prompt_index * self.n + delta.index

    def _token_str(self, token_id: int) -> str:
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def _logprobs(
        self, index: int, items: list[SampleLogprobs] | tuple[SampleLogprobs, ...]
    ) -> Any:
        if self.body.logprobs is None or self.body.logprobs is False:
            return None
        if self.chat:
            content = []
            for lp in items:
                tok = self._token_str(lp.token_id)
                top = [
                    {"token": (s := self._token_str(t)), "logprob": v, "bytes": list(s.encode())}
                    for t, v in lp.top
                ]
                content.append(
                    {
                        "token": tok,
                        "logprob": lp.logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": top,
                    }
                )
            return {"content": content, "refusal": None}
        tokens = [self._token_str(lp.token_id) for lp in items]
        offsets = []
        offset = self.text_offset.get(index, 0)
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        self.text_offset[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token_str(t): v for t, v in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def _usage(self) -> dict[str, Any]:
        prompt = cached = completion = 0
        for p, req in enumerate(self.prepared):
            ours = [self.usage[i] for i in range(p * self.n, (p + 1) * self.n) if i in self.usage]
            prompt += len(req.prompt_token_ids)
            cached += max((u.cached_tokens for u in ours), default=0)
            completion += sum(u.completion_tokens for u in ours)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _note(self, index: int, delta: ChoiceDelta) -> None:
        if delta.usage is not None:
            self.usage[index] = delta.usage

    # ------------------------------------------------------------------ non-streaming
    async def collect(
        self, first: tuple[int, ChoiceDelta], rest: AsyncIterator[tuple[int, ChoiceDelta]]
    ) -> dict[str, Any]:
        """The whole response object, once every choice has finished."""
        choices: dict[int, _Choice] = {}

        def add(p: int, delta: ChoiceDelta) -> None:
            index = self._index(p, delta)
            c = choices.setdefault(index, _Choice())
            c.text += delta.text
            c.token_ids.extend(delta.token_ids)
            c.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                c.finish_reason = delta.finish_reason.name.lower()
                c.stop_reason = delta.stop_reason
            self._note(index, delta)

        add(*first)
        async for p, delta in rest:
            add(p, delta)
        out = []
        for index in sorted(choices):
            c = choices[index]
            item: dict[str, Any] = {"index": index}
            finish_reason = c.finish_reason
            if self.chat and self.tools is not None:
                content, calls = parse(self.tools.stream(), c.text)
                item["message"] = {"role": "assistant", "content": content}
                if calls:
                    item["message"]["tool_calls"] = [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                        for call in calls
                    ]
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            elif self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            item["logprobs"] = self._logprobs(index, c.logprobs)
            item["finish_reason"] = finish_reason
            item["stop_reason"] = c.stop_reason
            if self.body.return_token_ids:
                item["token_ids"] = c.token_ids
                item["prompt_token_ids"] = list(self.prepared[index // self.n].prompt_token_ids)
            out.append(item)
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self._usage(),
        }

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> str:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        options = self.body.stream_options
        if options is not None and options.include_usage:
            if usage is None and options.continuous_usage_stats and choices:
                usage = self._choice_usage(choices[0]["index"])
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def _choice_usage(self, index: int) -> dict[str, Any]:
        """vLLM's continuous usage of one choice: its prompt, its tokens streamed so far."""
        prompt = len(self.prepared[index // self.n].prompt_token_ids)
        completion = self.streamed.get(index, 0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _stream_items(self, p: int, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The chunk items of one delta: one, or (a chat with tools) one per piece of
        content and two per tool call (its id, type, name and empty arguments, then its
        arguments), the logprobs on the first, the finish reason on the last."""
        index = self._index(p, delta)
        self._note(index, delta)
        self.streamed[index] = self.streamed.get(index, 0) + len(delta.token_ids)
        finish = None if delta.finish_reason is None else delta.finish_reason.name.lower()
        deltas: list[dict[str, Any]] = []
        if self.chat and self.tools is not None:
            stream = self.tool_streams.setdefault(index, self.tools.stream())
            events = stream.feed(delta.text)
            if finish is not None:
                events += stream.finish()
                if stream.calls and finish == "stop":
                    finish = "tool_calls"
            deltas = self._tool_deltas(events)
        elif self.chat and delta.text:
            deltas = [{"content": delta.text}]
        wants_ids = bool(self.body.return_token_ids and delta.token_ids)
        text = delta.text if not self.chat else ""
        if not (deltas or text or finish or delta.logprobs or wants_ids):
            return []  # text held back (a stop string or a call may follow): nothing yet
        items: list[dict[str, Any]] = []
        for d in deltas or [{}]:
            item: dict[str, Any] = {"index": index}
            if self.chat:
                item["delta"] = d
            else:
                item["text"] = text
            item["logprobs"] = None if items else self._logprobs(index, delta.logprobs)
            item["finish_reason"] = None
            item["stop_reason"] = None
            if self.body.return_token_ids:
                item["token_ids"] = [] if items else list(delta.token_ids)
            items.append(item)
        items[-1]["finish_reason"] = finish
        items[-1]["stop_reason"] = delta.stop_reason
        return items

    @staticmethod
    def _tool_deltas(events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                if not e.text:
                    continue
                if out and "content" in out[-1]:
                    out[-1]["content"] += e.text
                else:
                    out.append({"content": e.text})
            elif isinstance(e, Call):
                head = {"name": e.call.name, "arguments": ""}
                first = {"index": e.index, "id": e.call.id, "type": "function", "function": head}
                out.append({"tool_calls": [first]})
                args = {"index": e.index, "function": {"arguments": e.call.arguments}}
                out.append({"tool_calls": [args]})
        return out

    async def sse(
        self, first: tuple[int, ChoiceDelta], rest: AsyncGenerator[tuple[int, ChoiceDelta], None]
    ) -> AsyncIterator[str]:
        """Server-Sent Events: one chunk per delta, a usage chunk if asked, ``[DONE]``."""
        try:
            if self.chat:
                for index in range(len(self.prepared) * self.n):
                    role = {"role": "assistant", "content": ""}
                    yield self._chunk(
                        [{"index": index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
            for item in self._stream_items(*first):
                yield self._chunk([item])
            async for p, delta in rest:
                for item in self._stream_items(p, delta):
                    yield self._chunk([item])
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield self._chunk([], self._usage())
        except ServingError as exc:
            body = error_json(exc, self.fields, self.body.http_param)[1]
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            await rest.aclose()
        yield SSE_DONE
