"""Tool-call parsers (Hermes, Llama 3 JSON, Mistral, the grammar-forced JSON): calls and
content of whole outputs, malformed calls kept as content, and streaming one character at
a time giving the same calls and content as the whole text."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster.openai_tools import (
    Call,
    Content,
    ForcedStream,
    HermesParser,
    JsonBalance,
    Llama3JsonParser,
    MistralParser,
    choose_parser,
    forced_constraint,
    parse,
    template_takes_tools,
)
from pagedserve.cluster.request_prep import ToolCall


def calls_of(stream, text):
    content, calls = parse(stream, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


WEATHER = {"city": "Paris", "units": "metric"}

CASES = [
    # (parser, output, content, calls)
    (
        HermesParser(),
        'Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris", '
        '"units": "metric"}}\n</tool_call>\n<tool_call>{"name": "time", "arguments": {}}'
        "</tool_call>",
        "Let me check.",
        [("weather", WEATHER), ("time", {})],
    ),
    (HermesParser(), "No tools needed: <b>bold</b>.", "No tools needed: <b>bold</b>.", []),
    (
        HermesParser(),
        'a <tool_call>{"name": "f", "arguments": {"s": "</tool"}}</tool_call>',
        "a",
        [("f", {"s": "</tool"})],
    ),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "units": '
        '"metric"}}; {"name": "time", "parameters": {"tz": "}{"}}',
        None,
        [("weather", WEATHER), ("time", {"tz": "}{"})],
    ),
    (
        Llama3JsonParser(),
        ' {"name": "f", "parameters": {"a": [1, {"b": 2}]}}',
        None,
        [("f", {"a": [1, {"b": 2}]})],
    ),
    (Llama3JsonParser(), "Paris is the capital.", "Paris is the capital.", []),
    (
        MistralParser(),
        'Sure [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris", "units": '
        '"metric"}}, {"name": "time", "arguments": {}}]',
        "Sure",
        [("weather", WEATHER), ("time", {})],
    ),
    (MistralParser(), "plain [text] here", "plain [text] here", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_outputs_give_their_calls_and_content(parser, text, content, calls):
    assert calls_of(parser.stream(), text) == (content, calls)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_one_character_at_a_time_gives_the_same_calls(parser, text, content, calls):
    stream = parser.stream()
    events = []
    for ch in text:
        events += stream.feed(ch)
    events += stream.finish()
    got = [(e.call.name, json.loads(e.call.arguments)) for e in events if isinstance(e, Call)]
    assert got == calls
    assert [e.index for e in events if isinstance(e, Call)] == list(range(len(calls)))
    streamed = "".join(e.text for e in events if isinstance(e, Content))
    assert (streamed.strip() or None if calls else streamed) == content


@pytest.mark.parametrize(
    "parser, text",
    [
        (HermesParser(), 'x <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> y'),
        (HermesParser(), "x <tool_call>[1, 2]</tool_call>"),
        (HermesParser(), 'x <tool_call>{"name": "f", "arguments": '),  # never closed
        (HermesParser(), 'x <tool_call>{"arguments": {}}</tool_call>'),  # no name
        (Llama3JsonParser(), '{"name": "f", "parameters": {"a": }'),
        (Llama3JsonParser(), '{"nam": "f"}'),
        (MistralParser(), "[TOOL_CALLS] not json"),
        (MistralParser(), '[TOOL_CALLS] [{"name": "f", "arguments": 3}]'),
    ],
)
def test_malformed_calls_are_content_not_a_crash(parser, text):
    assert parse(parser.stream(), text) == (text, [])
    stream = parser.stream()
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert all(isinstance(e, Content) for e in events)
    assert "".join(e.text for e in events) == text


def test_a_partial_start_tag_is_held_back_not_leaked():
    stream = HermesParser().stream()
    assert stream.feed("Hi <tool") == [Content("Hi ")]
    assert stream.feed("_ca") == []
    assert stream.feed('ll>{"name": "f", "arguments": {"q": 1}}') == []
    [call] = stream.feed("</tool_call>")
    assert isinstance(call, Call) and call.call.name == "f" and call.index == 0
    assert call.call.id.startswith("call_") and len(call.call.id) == 29
    # a "<" that does not become a tag is released once it cannot
    assert stream.feed(" a <") == [Content(" a ")]
    assert stream.feed("b") == [Content("<b")]
    assert stream.finish() == []


def test_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert calls_of(HermesParser().stream(), text) == (None, [("f", {"a": 1})])


def test_forced_outputs_are_the_named_arguments_or_the_required_array():
    assert calls_of(ForcedStream("get"), ' {"city": "Paris"}') == (
        None,
        [("get", {"city": "Paris"})],
    )
    arr = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert calls_of(ForcedStream(None), arr) == (None, [("a", {"x": 1}), ("b", {})])
    truncated = '[{"name": "a", "param'
    assert parse(ForcedStream(None), truncated) == (truncated, [])
    stream = ForcedStream("get")
    events = [e for ch in '{"city": "Rome"}' for e in stream.feed(ch)] + stream.finish()
    assert [(e.call.name, e.call.arguments) for e in events] == [("get", '{"city": "Rome"}')]


def test_forced_constraints_are_the_schemas_of_the_calls():
    fns = [
        {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        {"name": "b"},
    ]
    named = forced_constraint(fns, "a", parallel=True)
    assert json.loads(named.json) == fns[0]["parameters"]
    required = json.loads(forced_constraint(fns, None, parallel=False).json)
    assert required["type"] == "array" and required["minItems"] == 1 == required["maxItems"]
    branches = required["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["a"], ["b"]]
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in json.loads(forced_constraint(fns, None, parallel=True).json)


def test_the_json_scan_ignores_brackets_in_strings():
    b = JsonBalance()
    assert b.feed('{"a": "}\\"]"') is None
    assert b.feed(', "b": [1]} tail') == 11


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_the_parser_is_chosen_from_the_chat_template():
    assert choose_parser(_Tok("{{ '<tool_call>' }} {{ tools }}")).name == "hermes"
    assert choose_parser(_Tok("{{ '[TOOL_CALLS]' }}")).name == "mistral"
    assert choose_parser(_Tok("<|python_tag|> ipython")).name == "llama3_json"
    assert choose_parser(_Tok(None)).name == "hermes"
    assert choose_parser(_Tok(None), "mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        choose_parser(_Tok(None), "pythonic")
    assert template_takes_tools(_Tok("{% if tools %}x{% endif %}"))
    assert not template_takes_tools(_Tok("{{ messages }}"))


def test_calls_and_tools_are_written_in_the_parsers_format():
    call = ToolCall("call_1", "f", '{"a": 1}')
    assert (
        HermesParser().render_call(call)
        == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert Llama3JsonParser().render_call(call) == '{"name": "f", "parameters": {"a": 1}}'
    assert (
        MistralParser().render_call(call) == '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]'
    )
    for parser in (HermesParser(), Llama3JsonParser(), MistralParser()):
        rendered = parser.render_call(call)
        assert calls_of(parser.stream(), rendered) == (None, [("f", {"a": 1})])
    prompt = HermesParser().tools_prompt([{"name": "f", "parameters": {"type": "object"}}])
    assert '"name": "f"' in prompt and "<tool_call>" in prompt
    assert HermesParser().render_result("42") == ("user", "<tool_response>\n42\n</tool_response>")


def test_the_config_names_every_parser():
    from pagedserve.cluster.config import TOOL_CALL_PARSERS, ServerConfig
    from pagedserve.cluster.openai_tools import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    assert ServerConfig(tool_call_parser="mistral").tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="pythonic")


def test_serve_takes_a_tool_call_parser_and_refuses_an_unknown_one() -> None:
    from pagedserve.cluster.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert serve_config(args).server.tool_call_parser == "llama3_json"
    assert serve_config(build_parser().parse_args(["serve"])).server.tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
