"""OpenAI-compatible request bodies, and their translation to the shared request path.

The models accept what OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` accept plus
the extension fields vLLM accepts for features this server has; unknown fields are ignored
(as OpenAI does). Types are strict, as OpenAI's: ``true`` is not an integer, ``"2"`` not a
number, ``"yes"`` not a boolean (an integer is a number). Known fields this server cannot
honour raise :class:`InvalidRequest` naming the field (``param``), so a client never
silently gets something else than it asked for. :func:`completion_inputs` /
:func:`chat_input` and :func:`sampling_request` produce the transport-neutral
:class:`GenerateInput` / :class:`SamplingRequest` of :mod:`pagedserve.cluster.request_prep`;
range checks stay there (one copy for both transports).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from pagedserve.cluster.openai_structured import (
    CONSTRAINT_FIELDS,
    CONSTRAINT_KINDS,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsBody,
    ToolDef,
    ToolPlan,
    structured_outputs,
)
from pagedserve.cluster.openai_tools import ToolParser
from pagedserve.cluster.request_prep import (
    CHAT_ROLES,
    ChatMessage,
    GenerateInput,
    Message,
    SamplingRequest,
    ToolCall,
)
from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.sampling_params import MAX_BEAM_WIDTH

MAX_PROMPTS = 128  # prompts in one /v1/completions request (each is its own request)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the request's usage;
    with it, vLLM's ``continuous_usage_stats`` also puts in every chunk the usage so far of
    the chunk's choice (its prompt's tokens, the tokens it has streamed)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    # The pipeline's (gRPC's) name of a field -> this body's name of it.
    PIPELINE_PARAMS: ClassVar[dict[str, str]] = {"beam_width": "n"}

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None

    def http_param(self, name: str) -> str:
        """The body's field behind the pipeline's field ``name`` (its errors name gRPC's
        fields: ``text`` / ``token_ids`` are ``prompt``, ``chat`` is ``messages``,
        ``beam_width`` is ``n``; a constraint that does not compile, ``json_schema``,
        ``regex``, ..., is the field it came from); other names are returned as they are."""
        if name in CONSTRAINT_FIELDS:
            return self.constraint_param()
        return self.PIPELINE_PARAMS.get(name, name)

    def constraint_param(self) -> str:
        """The field the request's constraint came from: ``structured_outputs.KIND``,
        ``response_format.json_schema.schema``, ``response_format``, or (a forced tool
        call) ``tools``."""
        so = self.structured_outputs
        if so is not None:
            given = [k for k in CONSTRAINT_KINDS if getattr(so, k + "_" * (k == "json"))]
            return f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            return "response_format.json_schema.schema"
        if fmt is not None and fmt.type == "json_object":
            return "response_format"
        return "tools"

    def check_supported(self) -> None:
        """Raise InvalidRequest naming the first known field this server cannot honour."""
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream", "stream_options")


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    PIPELINE_PARAMS: ClassVar[dict[str, str]] = {
        **_SamplingFields.PIPELINE_PARAMS,
        "text": "prompt",
        "token_ids": "prompt",
    }
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequest("best_of other than n is not supported", "best_of")


class TextPart(BaseModel):
    """One part of a message's list-of-parts content."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    """One chat message: string content or a list of text parts; an assistant's
    ``tool_calls``, a ``tool`` message's ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    PIPELINE_PARAMS: ClassVar[dict[str, str]] = {
        **_SamplingFields.PIPELINE_PARAMS,
        "chat": "messages",
        "prompt": "messages",
    }
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None

    def http_param(self, name: str) -> str:
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"  # it wins over max_tokens
        if name == "logprobs" and self.top_logprobs is not None:
            return "top_logprobs"  # the pipeline's logprobs count
        return super().http_param(name)

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("functions", "audio", "prediction"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported (use tools)", name)
        if self.function_call not in (None, "none"):
            raise InvalidRequest(
                "function_call is not supported (use tool_choice)", "function_call"
            )
        if self.modalities not in (None, ["text"]):
            raise InvalidRequest("only the 'text' modality is supported", "modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")


Endpoint = Literal["completions", "chat"]


def sampling_request(
    body: CompletionRequest | ChatCompletionRequest, plan: ToolPlan | None = None
) -> SamplingRequest:
    """The :class:`SamplingRequest` of a body (after :meth:`check_supported`), constrained
    by the body's :func:`structured_outputs`, or by ``plan``'s grammar when its
    ``tool_choice`` forces a call.

    ``use_beam_search`` turns on beam search with ``n`` beams (vLLM's meaning), returning
    the ``n`` best.

    Raises:
        InvalidRequest: ``use_beam_search`` with ``n`` out of [1, MAX_BEAM_WIDTH] (``n``);
            a bad constraint (see :func:`structured_outputs`).
    """
    constraint = plan.forced if plan is not None and plan.forced is not None else None
    if constraint is None:
        constraint = structured_outputs(body)
    max_tokens = body.max_tokens
    logprobs: int | None
    if isinstance(body, ChatCompletionRequest):
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    beam_width = None
    if body.use_beam_search:
        beam_width = 1 if body.n is None else body.n
        if not 1 <= beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequest(
                f"n must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search (n beams), "
                f"got {beam_width}",
                "n",
            )
    return SamplingRequest(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        n=body.n,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        cache_salt=body.cache_salt,
        beam_width=beam_width,
        length_penalty=body.length_penalty,
        priority=body.priority,
        structured_outputs=constraint,
    )


def completion_inputs(body: CompletionRequest) -> list[GenerateInput]:
    """One :class:`GenerateInput` per prompt of a completions body (a string, a list of
    strings, a list of token ids, or a list of lists of token ids).

    Raises:
        InvalidRequest: an empty prompt list, or more than ``MAX_PROMPTS`` prompts
            (``param`` "prompt").
    """
    prompt = body.prompt
    if isinstance(prompt, str):
        return [GenerateInput(text=prompt)]
    if not prompt:
        raise InvalidRequest("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [GenerateInput(token_ids=tuple(prompt))]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(
            f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt"
        )
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(GenerateInput(text=p))
        elif isinstance(p, list):
            out.append(GenerateInput(token_ids=tuple(p)))
    return out


def _content(m: ChatMessageBody, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"content part type {part.type!r} is not supported (only 'text')",
                f"messages[{i}].content[{j}].type",
            )
        parts.append(part.text)
    return "\n".join(parts)


def chat_input(
    body: ChatCompletionRequest, plan: ToolPlan | None = None, render: ToolParser | None = None
) -> GenerateInput:
    """The messages of a chat body as a :class:`GenerateInput`; ``developer`` is OpenAI's
    newer name of ``system``.

    Messages with ``tool_calls`` or ``tool_call_id`` become :class:`ChatMessage` records
    and ``plan``'s functions the input's ``tools``, for a chat template that renders them;
    with ``render`` (the template does not) they are written as text in ``render``'s
    format instead: calls into the assistant's content, results as ``render`` wraps
    them, the functions into the system prompt.

    Raises:
        InvalidRequest: no messages, a non-text content part, an unknown role,
            ``tool_calls`` on a message that is not the assistant's, a ``tool`` message
            without ``tool_call_id``.
    """
    if not body.messages:
        raise InvalidRequest("messages must not be empty", "messages")
    messages: list[Message] = []
    for i, m in enumerate(body.messages):
        content = _content(m, i)
        role = "system" if m.role == "developer" else m.role
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"unknown chat role {m.role!r} (use one of {(*CHAT_ROLES, 'developer')})",
                f"messages[{i}].role",
            )
        calls = tuple(
            ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()
        )
        if calls and role != "assistant":
            raise InvalidRequest(
                f"only assistant messages carry tool_calls, not {m.role!r}",
                f"messages[{i}].tool_calls",
            )
        if role == "tool" and m.tool_call_id is None:
            raise InvalidRequest(
                "a tool message needs the tool_call_id it answers", f"messages[{i}].tool_call_id"
            )
        if render is not None:
            if calls:
                content = "\n".join(
                    [content] * bool(content) + [render.render_call(c) for c in calls]
                )
            if role == "tool":
                role, content = render.render_result(content)
            messages.append((role, content))
        elif calls or role == "tool":
            messages.append(ChatMessage(role, content, calls, m.tool_call_id))
        else:
            messages.append((role, content))
    tools = None
    if plan is not None and render is not None:
        prompt = render.tools_prompt(plan.functions)
        first = messages[0]
        if isinstance(first, tuple) and first[0] == "system":
            messages[0] = ("system", f"{first[1]}\n\n{prompt}" if first[1] else prompt)
        else:
            messages.insert(0, ("system", prompt))
    elif plan is not None:
        tools = tuple({"type": "function", "function": f} for f in plan.functions)
    return GenerateInput(messages=tuple(messages), tools=tools)
