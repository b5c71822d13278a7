"""Structured outputs and tools in OpenAI request bodies: the models of ``response_format``,
vLLM's ``structured_outputs``, ``tools`` and ``tool_choice``, and their mapping onto a
:class:`StructuredOutputs` spec (:func:`structured_outputs`) and a :class:`ToolPlan`
(:func:`tool_plan`). Malformed shapes raise :class:`InvalidRequest` naming the field
(``param``); whether a schema, regex or grammar compiles is checked when the request is
prepared (:mod:`pagedserve.cluster.request_prep`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.openai_tools import ForcedStream, ToolParser, ToolStream, forced_constraint
from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from pagedserve.cluster.openai_protocol import ChatCompletionRequest, CompletionRequest

# The pipeline's names of a constraint that does not compile (pagedserve.worker.grammar).
CONSTRAINT_FIELDS = frozenset({"json_schema", "json_object", "regex", "choice", "grammar"})
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON Schema (``strict``: no properties
    beyond the schema's)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (unconstrained), ``json_object`` (any JSON object) or
    ``json_schema`` (with ``json_schema``)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON Schema, as an object
    or as JSON text), ``regex``, ``choice``, ``grammar`` (EBNF), ``json_object``."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    """``tools[i].function``: a function the model may call (``parameters`` a JSON Schema
    of its arguments object)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """One ``tools`` item."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    """``tool_choice.function``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    """``messages[i].tool_calls[j].function``: ``arguments`` is JSON text."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """An assistant message's earlier call."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME_CHARS = 64  # OpenAI's limit on function and schema names


def _check_name(name: str, param: str) -> None:
    if not 1 <= len(name) <= MAX_NAME_CHARS or not set(name) <= _NAME_CHARS:
        raise InvalidRequest(
            f"{param} must be 1 to {MAX_NAME_CHARS} letters, digits, '_' or '-', got {name!r}",
            param,
        )


def _spec(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: {exc}", param) from None


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The constraint of a body's ``response_format`` (``json_object``, ``json_schema``) or
    vLLM's ``structured_outputs`` (one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``); None when unconstrained. Whether a schema, regex or grammar compiles
    is checked when the request is prepared.

    Raises:
        InvalidRequest: ``json_schema`` missing for type ``json_schema``, a bad schema
            name, both fields set, none or several kinds in ``structured_outputs``, an
            empty or oversized text (``param`` names the field).
    """
    spec = None
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        spec = StructuredOutputs(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest(
                "response_format.json_schema is required with type 'json_schema'",
                "response_format.json_schema",
            )
        _check_name(fmt.json_schema.name, "response_format.json_schema.name")
        spec = _spec(
            "response_format.json_schema.schema",
            json=json.dumps(fmt.json_schema.schema_),
            strict=bool(fmt.json_schema.strict),
        )
    so = body.structured_outputs
    if so is None:
        return spec
    if spec is not None:
        raise InvalidRequest(
            "structured_outputs and a response_format other than 'text' are exclusive",
            "structured_outputs",
        )
    kinds = {
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object or None,
    }
    given = [k for k, v in kinds.items() if v is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs needs exactly one of json, regex, choice, grammar, "
            f"json_object; got {given or 'none'}",
            "structured_outputs",
        )
    kind = given[0]
    value: Any = kinds[kind]
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value)
    elif kind == "choice":
        value = tuple(value)
    return _spec(f"structured_outputs.{kind}", **{kind: value})


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools are used.

    Attributes:
        functions: the ``tools[i].function`` objects (``name``, ``description``,
            ``parameters``, ``strict``), rendered into the prompt.
        parser: the served model's tool-call format.
        forced: the grammar of ``tool_choice`` ``required`` or a named function; None
            for ``auto`` (the parser finds calls in free output).
        forced_name: the function ``tool_choice`` names.
    """

    functions: tuple[dict[str, Any], ...]
    parser: ToolParser
    forced: StructuredOutputs | None = None
    forced_name: str | None = None

    def stream(self) -> ToolStream:
        """A per-choice stream of the calls in this plan's output."""
        if self.forced is not None:
            return ForcedStream(self.forced_name)
        return self.parser.stream()


def tool_plan(body: ChatCompletionRequest, parser: ToolParser) -> ToolPlan | None:
    """The :class:`ToolPlan` of a chat body, or None without tools or with ``tool_choice``
    ``none`` (no tool is offered then). ``tool_choice`` defaults to ``auto`` with tools;
    ``parallel_tool_calls`` (default true) lets ``required`` emit several calls.

    Raises:
        InvalidRequest: an unknown ``tool_choice``, one other than ``none`` without tools,
            naming a function not in ``tools``, a bad or repeated function name
            (``tools[i].function.name``), ``required`` or a named function together with
            a ``response_format`` / ``structured_outputs`` constraint.
    """
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
            "tool_choice",
        )
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        _check_name(name, f"tools[{i}].function.name")
        if any(f["name"] == name for f in functions):
            raise InvalidRequest(
                f"tools[{i}].function.name: {name!r} is defined twice", f"tools[{i}].function.name"
            )
        functions.append(tool.function.model_dump(exclude_none=True))
    if choice == "none":
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and all(f["name"] != named for f in functions):
        raise InvalidRequest(f"tool_choice: no function named {named!r} in tools", "tool_choice")
    if named is None and choice != "required":
        return ToolPlan(tuple(functions), parser)
    constrained = body.structured_outputs is not None or (
        body.response_format is not None and body.response_format.type != "text"
    )
    if constrained:
        raise InvalidRequest(
            "response_format: a constraint cannot be combined with tool_choice 'required' "
            "or a named function",
            "response_format",
        )
    try:
        forced = forced_constraint(functions, named, body.parallel_tool_calls is not False)
    except ValueError as exc:
        raise InvalidRequest(f"tools: {exc}", "tools") from None
    return ToolPlan(tuple(functions), parser, forced, named)
