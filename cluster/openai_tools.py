"""Tool calls in model output: one parser per chat-template format, streaming or whole.

A parser (:class:`ToolParser`) knows one format of the calls a model emits and how to write
tools, calls and results into a prompt for a chat template that does not render them:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` spans between free
  text (Qwen2 / Qwen2.5, Hermes, and the format SmolLM2 is prompted with: its template has
  no tool support, so the tools go into the system prompt as Hermes' template writes them).
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2's JSON tool calls).
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after free text
  (Mistral v0.3's format; ``[TOOL_CALLS]`` is a special token, so it reaches the text only
  where special tokens are kept).

Each parser hands out a per-choice :class:`ToolStream`: :meth:`ToolStream.feed` takes the
choice's text deltas and returns :class:`Content` and :class:`Call` events, holding back
text that may still become a call (a partial ``<tool_call>`` is never released as
content); :meth:`ToolStream.finish` flushes. A whole text is parsed by feeding it at once
(:func:`parse`), so streaming and non-streaming give the same calls. Model output is read
as JSON data only: ``json.loads`` of delimited spans, found by a linear scan
(:class:`JsonBalance`); a span that is not a call (malformed JSON, no name) is content.

``tool_choice`` ``required`` or a named function is enforced by a grammar instead
(:func:`forced_constraint`, vLLM's approach): the output is then JSON (an array of
``{"name", "parameters"}`` objects, or the named function's arguments) whatever the
parser, read by :class:`ForcedStream`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedserve.cluster.request_prep import ToolCall
from pagedserve.scheduler.structured_outputs import StructuredOutputs


@dataclass(frozen=True)
class Content:
    """Text outside any call, released to the client."""

    text: str


@dataclass(frozen=True)
class Call:
    """A complete call; ``index`` is its position among the choice's calls (0, 1, ...)."""

    index: int
    call: ToolCall


Event = Content | Call


def new_call_id() -> str:
    """A fresh ``call_...`` id (OpenAI's shape: ``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def dumps(value: Any) -> str:
    """JSON text of arguments as they are sent back (UTF-8 kept, not escaped)."""
    return json.dumps(value, ensure_ascii=False)


class JsonBalance:
    """Finds where a JSON object or array ends, fed a piece at a time (linear, no regex).

    The first character fed must be ``{`` or ``[``. Tracks strings (and their escapes) and
    the bracket depth; :meth:`feed` returns the offset in its piece just past the closing
    bracket, or None while the value is still open. Only the extent is found here:
    ``json.loads`` of the span decides whether it is JSON.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, piece: str) -> int | None:
        for i, ch in enumerate(piece):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _as_call(obj: Any, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], dumps(args)


class ToolStream:
    """Per-choice incremental state of one parser; see the module docstring."""

    def __init__(self) -> None:
        self.calls = 0

    def _call(self, name: str, arguments: str) -> Call:
        event = Call(self.calls, ToolCall(new_call_id(), name, arguments))
        self.calls += 1
        return event

    def feed(self, text: str) -> list[Event]:
        """Events released by ``text`` (the choice's next text delta)."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """Events of the text still held (an unfinished call is content)."""
        raise NotImplementedError


class _TaggedStream(ToolStream):
    """Content with calls between a start tag and either an end tag (Hermes) or the end
    of one JSON value after the tag (Mistral's ``[TOOL_CALLS] [...]``)."""

    def __init__(self, start: str, end: str | None, args_key: str) -> None:
        super().__init__()
        self.start, self.end, self.args_key = start, end, args_key
        self.buf = ""  # text not yet released
        self.inside = False
        self.balance: JsonBalance | None = None
        self.scanned = 0  # of buf, inside: characters already searched

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            if not self.inside:
                at = self.buf.find(self.start)
                if at < 0:
                    keep = _held_prefix(self.buf, self.start)
                    if len(self.buf) > keep:
                        events.append(Content(self.buf[: len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep :]
                    return events
                if at:
                    events.append(Content(self.buf[:at]))
                self.buf = self.buf[at + len(self.start) :]
                self.inside, self.scanned, self.balance = True, 0, None
            span_end = self._span_end()
            if span_end is None:
                return events
            span, rest = self.buf[: span_end[0]], self.buf[span_end[1] :]
            events.extend(self._span_events(span))
            self.buf, self.inside = rest, False

    def _span_end(self) -> tuple[int, int] | None:
        """(end of the call's text, start of what follows) in buf, or None if still open."""
        if self.end is not None:
            at = self.buf.find(self.end, max(0, self.scanned - len(self.end) + 1))
            self.scanned = len(self.buf)
            return None if at < 0 else (at, at + len(self.end))
        if self.balance is None:
            stripped = self.buf.lstrip()
            if not stripped:
                return None
            if stripped[0] not in "[{":
                return 0, 0  # no JSON after the tag: the tag alone is content
            self.scanned = len(self.buf) - len(stripped)  # the span keeps its spaces
            self.balance = JsonBalance()
        end = self.balance.feed(self.buf[self.scanned :])
        if end is None:
            self.scanned = len(self.buf)
            return None
        end += self.scanned
        return end, end

    def _span_events(self, span: str) -> list[Event]:
        try:
            value = json.loads(span)
        except ValueError:
            value = None
        items = value if isinstance(value, list) and value else [value]
        calls = [_as_call(item, self.args_key) for item in items]
        if any(c is None for c in calls):
            return [Content(self.start + span + (self.end or ""))]
        return [self._call(*c) for c in calls if c is not None]

    def finish(self) -> list[Event]:
        text = (self.start if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [Content(text)] if text else []


class _JsonCallsStream(ToolStream):
    """Output that is either content or only JSON call objects separated by ``;`` (Llama 3
    JSON), decided by its first non-space text; ``prefix`` (``<|python_tag|>``) may open it."""

    def __init__(self, prefix: str, args_key: str) -> None:
        super().__init__()
        self.prefix, self.args_key = prefix, args_key
        self.buf = ""
        self.mode = "undecided"  # then "json" or "content"
        self.balance: JsonBalance | None = None
        self.scanned = 0

    def feed(self, text: str) -> list[Event]:
        if self.mode == "content":
            return [Content(text)] if text else []
        self.buf += text
        if self.mode == "undecided":
            head = self.buf.lstrip()
            if not head or (self.prefix.startswith(head) and head != self.prefix):
                return []
            if head.startswith(self.prefix):
                head = head[len(self.prefix) :]
            elif not head.startswith("{"):
                self.mode = "content"
                out, self.buf = self.buf, ""
                return [Content(out)]
            self.mode, self.buf = "json", head
        return self._scan()

    def _scan(self) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.balance is None:
                self.buf = self.buf.lstrip().removeprefix(";").lstrip()
                if not self.buf:
                    return events
                if self.buf[0] != "{":
                    self.mode = "content"
                    out, self.buf = self.buf, ""
                    return [*events, Content(out)]
                self.balance, self.scanned = JsonBalance(), 0
            end = self.balance.feed(self.buf[self.scanned :])
            if end is None:
                self.scanned = len(self.buf)
                return events
            end += self.scanned
            span, self.buf, self.balance = self.buf[:end], self.buf[end:], None
            try:
                call = _as_call(json.loads(span), self.args_key)
            except ValueError:
                call = None
            if call is None:
                self.mode = "content"
                out, self.buf = span + self.buf, ""
                return [*events, Content(out)]
            events.append(self._call(*call))

    def finish(self) -> list[Event]:
        out, self.buf = self.buf, ""
        if self.mode == "json" and self.balance is None:
            return []  # only separators after the calls
        return [Content(out)] if out else []


class ForcedStream(ToolStream):
    """Output constrained by :func:`forced_constraint`: the named function's arguments
    (one JSON object), or a JSON array of ``{"name", "parameters"}`` objects (``required``).
    Anything that is not that (a truncated output) is content."""

    def __init__(self, name: str | None) -> None:
        super().__init__()
        self.name = name
        self.buf = ""
        self.balance: JsonBalance | None = None
        self.done = False

    def feed(self, text: str) -> list[Event]:
        start = len(self.buf)
        self.buf += text
        if self.done:
            return []
        if self.balance is None:
            head = self.buf.lstrip()
            if not head:
                return []
            self.buf, start = head, 0
            self.balance = JsonBalance()
        end = self.balance.feed(self.buf[start:])
        if end is None:
            return []
        end += start
        self.done = True
        try:
            value = json.loads(self.buf[:end])
        except ValueError:
            return []
        if self.name is not None:
            calls = [(self.name, dumps(value))] if isinstance(value, dict) else []
        else:
            items = value if isinstance(value, list) else []
            calls = [c for c in (_as_call(v, "parameters") for v in items) if c is not None]
            if len(calls) != len(items):
                calls = []
        if not calls:
            return []
        self.buf = self.buf[end:]
        return [self._call(*c) for c in calls]

    def finish(self) -> list[Event]:
        out, self.buf = self.buf, ""
        if self.calls:
            return [Content(out)] if out.strip() else []
        return [Content(out)] if out else []


def parse(stream: ToolStream, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output through ``stream``: (the text outside the calls, stripped, or None
    when that is empty, beside calls; the text as it is without calls; the calls in
    order)."""
    events = [*stream.feed(text), *stream.finish()]
    calls = [e.call for e in events if isinstance(e, Call)]
    content = "".join(e.text for e in events if isinstance(e, Content))
    if calls:
        return content.strip() or None, calls
    return content, calls


class ToolParser:
    """One model family's tool-call format: its stream, and the prompt text a chat template
    without tool support is given instead (tools in the system prompt, calls and results
    as text)."""

    name: ClassVar[str]

    def stream(self) -> ToolStream:
        """A fresh per-choice stream."""
        raise NotImplementedError

    def render_call(self, call: ToolCall) -> str:
        """An assistant's earlier call as the model writes it."""
        raise NotImplementedError

    def tools_prompt(self, functions: Sequence[dict[str, Any]]) -> str:
        """The system prompt describing ``functions`` (OpenAI ``tools[i].function``
        objects) and the call format."""
        specs = "\n".join(dumps({"type": "function", "function": f}) for f in functions)
        return (
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{specs}\n</tools>\n\n{self.format_hint()}"
        )

    def format_hint(self) -> str:
        """How the model is told to write a call."""
        raise NotImplementedError

    def render_result(self, content: str) -> tuple[str, str]:
        """(role, text) of a ``tool`` message's result for such a template."""
        return "user", f"<tool_response>\n{content}\n</tool_response>"


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro, Qwen2's
    templates; vLLM's ``hermes`` parser)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def stream(self) -> ToolStream:
        return _TaggedStream(self.START, self.END, "arguments")

    def render_call(self, call: ToolCall) -> str:
        body = dumps({"name": call.name, "arguments": _arguments(call)})
        return f"{self.START}\n{body}\n{self.END}"

    def format_hint(self) -> str:
        return (
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


class Llama3JsonParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, as the whole output
    (Llama 3.1's JSON tool calling; vLLM's ``llama3_json`` parser)."""

    name = "llama3_json"
    PREFIX = "<|python_tag|>"

    def stream(self) -> ToolStream:
        return _JsonCallsStream(self.PREFIX, "parameters")

    def render_call(self, call: ToolCall) -> str:
        return dumps({"name": call.name, "parameters": _arguments(call)})

    def format_hint(self) -> str:
        return (
            "To call a function, respond only with a JSON object of the form "
            '{"name": <function-name>, "parameters": <args-json-object>}; separate several '
            "calls with ;."
        )


class MistralParser(ToolParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral v0.3; vLLM's
    ``mistral`` parser)."""

    name = "mistral"
    START = "[TOOL_CALLS]"

    def stream(self) -> ToolStream:
        return _TaggedStream(self.START, None, "arguments")

    def render_call(self, call: ToolCall) -> str:
        return f"{self.START} " + dumps([{"name": call.name, "arguments": _arguments(call)}])

    def format_hint(self) -> str:
        return (
            "To call functions, write [TOOL_CALLS] followed by a JSON array of "
            '{"name": <function-name>, "arguments": <args-json-object>} objects.'
        )


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template as text ("" when it has none; every named template
    of a dict joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def choose_parser(tokenizer: Any, name: str | None = None) -> ToolParser:
    """The parser named ``name``, or the one the chat template's markers point to
    (``[TOOL_CALLS]``: mistral; ``<|python_tag|>`` or ``ipython``: llama3_json; otherwise
    hermes, which is also what a template without tool support is prompted with).

    Raises:
        ValueError: ``name`` is not one of :data:`PARSERS`.
    """
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r} (use one of {list(PARSERS)})")
        return PARSERS[name]()
    text = template_text(tokenizer)
    if "[TOOL_CALLS]" in text:
        return MistralParser()
    if "<|python_tag|>" in text or "ipython" in text:
        return Llama3JsonParser()
    return HermesParser()


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders ``tools`` itself (it names the variable)."""
    return "tools" in template_text(tokenizer)


def forced_constraint(
    functions: Sequence[dict[str, Any]], name: str | None, parallel: bool
) -> StructuredOutputs:
    """The grammar that makes the model call a tool: the named function's arguments schema
    (``name`` set), else a JSON array of 1 (or, ``parallel``, more) ``{"name",
    "parameters"}`` objects, one branch per function (vLLM's ``required`` schema).

    Args:
        functions: OpenAI ``tools[i].function`` objects (``name``, ``parameters``,
            ``strict``).
        name: the function ``tool_choice`` names, or None for ``required``.
        parallel: ``parallel_tool_calls``: more than one call allowed.

    Raises:
        ValueError: the schema text is too long for :class:`StructuredOutputs`.
    """

    def params(f: dict[str, Any]) -> dict[str, Any]:
        return f.get("parameters") or {"type": "object", "properties": {}}

    if name is not None:
        f = next(f for f in functions if f["name"] == name)
        return StructuredOutputs(json=dumps(params(f)), strict=bool(f.get("strict")))
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": params(f),
            },
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=dumps(schema))
