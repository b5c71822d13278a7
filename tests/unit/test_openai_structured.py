"""Structured outputs and tool calling in the OpenAI layer (no cluster): ``response_format``
and ``structured_outputs`` mapped onto :class:`StructuredOutputs`, every malformed shape a
400 naming its field, tools rendered into the prompt (by the template, or as text for a
template without tool support), and tool calls in responses and streams (a pipeline whose
generation is scripted)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from helpers import build_char_tokenizer

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.launcher import build_http_app
from pagedserve.cluster.openai_api import parse_body
from pagedserve.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    sampling_request,
)
from pagedserve.cluster.openai_structured import structured_outputs, tool_plan
from pagedserve.cluster.openai_tools import HermesParser
from pagedserve.cluster.pipeline import ChoiceDelta, RequestPipeline, Usage
from pagedserve.cluster.request_prep import ChatMessage, GenerateInput, ModelInfo, ToolCall
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import InvalidRequest
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.structured_outputs import StructuredOutputs

MODEL = "m"
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_body({"model": MODEL, "messages": USER, **fields}, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return parse_body({"model": MODEL, "prompt": "x", **fields}, CompletionRequest)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("make", [chat, completion])
def test_response_format_and_structured_outputs_map_onto_the_spec(make):
    assert structured_outputs(make()) is None
    assert structured_outputs(make(response_format={"type": "text"})) is None
    assert structured_outputs(make(response_format={"type": "json_object"})) == (
        StructuredOutputs(json_object=True)
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}
    spec = structured_outputs(make(response_format=fmt))
    assert json.loads(spec.json) == SCHEMA and spec.strict is True
    assert structured_outputs(make(structured_outputs={"regex": "[a-z]+"})).regex == "[a-z]+"
    assert structured_outputs(make(structured_outputs={"choice": ["yes", "no"]})).choice == (
        "yes",
        "no",
    )
    grammar = 'root ::= "a" | "b"'
    assert structured_outputs(make(structured_outputs={"grammar": grammar})).grammar == grammar
    by_object = structured_outputs(make(structured_outputs={"json": SCHEMA}))
    by_text = structured_outputs(make(structured_outputs={"json": json.dumps(SCHEMA)}))
    assert json.loads(by_object.json) == json.loads(by_text.json) == SCHEMA
    assert structured_outputs(make(structured_outputs={"json_object": True})).json_object
    assert sampling_request(make(structured_outputs={"regex": "x"})).structured_outputs == (
        StructuredOutputs(regex="x")
    )


BAD_SHAPES = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA,
      "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "x" * 70000}}, "structured_outputs.grammar"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param", BAD_SHAPES)
@pytest.mark.parametrize("make", [chat, completion])
def test_malformed_constraints_are_invalid_naming_the_field(make, extra, param):
    with pytest.raises(InvalidRequest) as ei:
        structured_outputs(make(**extra))
    assert ei.value.param == param


BAD_TOOLS = [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name"),
    ({"tools": [TIME], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [TIME], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param", BAD_TOOLS)
def test_malformed_tools_are_invalid_naming_the_field(extra, param):
    with pytest.raises(InvalidRequest) as ei:
        tool_plan(chat(**extra), HermesParser())
    assert ei.value.param == param


def test_tool_choice_modes():
    parser = HermesParser()
    assert tool_plan(chat(), parser) is None
    assert tool_plan(chat(tools=[WEATHER], tool_choice="none"), parser) is None
    auto = tool_plan(chat(tools=[WEATHER, TIME]), parser)
    assert auto.forced is None and [f["name"] for f in auto.functions] == [
        "get_weather",
        "get_time",
    ]
    assert sampling_request(chat(tools=[WEATHER]), auto).structured_outputs is None
    named = tool_plan(
        chat(
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        parser,
    )
    assert json.loads(named.forced.json) == WEATHER["function"]["parameters"]
    assert named.forced_name == "get_weather"
    body = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    required = tool_plan(body, parser)
    schema = json.loads(sampling_request(body, required).structured_outputs.json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]  # fmt: skip


def test_history_with_calls_becomes_records_for_a_template_that_renders_tools():
    body = chat(messages=HISTORY, tools=[WEATHER])
    inp = chat_input(body, tool_plan(body, HermesParser()))
    assert inp.messages == (
        ("user", "Weather in Paris?"),
        ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "18C, sunny", (), "call_1"),
    )
    assert inp.tools == (WEATHER,)


def test_history_with_calls_is_text_for_a_template_without_tools():
    parser = HermesParser()
    body = chat(messages=[{"role": "system", "content": "Be brief."}, *HISTORY], tools=[WEATHER])
    inp = chat_input(body, tool_plan(body, parser), parser)
    assert inp.tools is None
    system, _user, assistant, result = inp.messages
    assert system[0] == "system" and system[1].startswith("Be brief.\n\nYou may call")
    assert '"name": "get_weather"' in system[1] and "<tool_call>" in system[1]
    assert assistant == (
        "assistant",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    )
    assert result == ("user", "<tool_response>\n18C, sunny\n</tool_response>")
    no_system = chat(messages=HISTORY[:1], tools=[WEATHER])
    first = chat_input(no_system, tool_plan(no_system, parser), parser).messages[0]
    assert first[0] == "system" and first[1].startswith("You may call")


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}],
         "messages[0].tool_calls"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
         "messages.0.tool_calls.0.function.arguments"),
    ],
)  # fmt: skip
def test_malformed_tool_messages_name_the_field(messages, param):
    with pytest.raises(InvalidRequest) as ei:
        chat_input(chat(messages=messages))
    assert ei.value.param == param


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }}"
    "({{ c['function']['arguments']['city'] }})]{% endfor %}"
    "{% if m.get('tool_call_id') %}#{{ m['tool_call_id'] }}{% endif %}|{% endfor %}"
)


def test_the_template_renders_tools_and_calls():
    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    pipeline = RequestPipeline(
        scheduler=None, tokenizer=tok, info=ModelInfo(MODEL, 512, 105, (2,), 512, 8)
    )
    body = chat(messages=HISTORY, tools=[WEATHER, TIME])
    inp = chat_input(body, tool_plan(body, HermesParser()))
    req = pipeline.preparer.prepare(inp, sampling_request(body))
    text = tok.decode(list(req.prompt_token_ids))
    assert text == (
        "TOOLS:get_weather;get_time;|user:Weather in Paris?|assistant:[get_weather(Paris)]|"
        "tool:18C, sunny#call_1|"
    )
    plain = pipeline.preparer.prepare(
        GenerateInput(messages=(("user", "x"),)), sampling_request(body)
    )
    assert tok.decode(list(plain.prompt_token_ids)) == "user:x|"


# ---------------------------------------------------------------------- through the HTTP app
def scripted(outputs: list[str], piece: int = 3) -> tuple[RequestPipeline, list[EngineRequest]]:
    """A pipeline whose choice i writes ``outputs[i]`` in pieces of ``piece`` characters,
    then STOP; the prepared requests are recorded."""
    seen: list[EngineRequest] = []
    info = ModelInfo(MODEL, 100_000, 105, (2,), 100_000, 16)
    pipeline = RequestPipeline(scheduler=None, tokenizer=build_char_tokenizer(), info=info)

    async def generate(req: EngineRequest, flight: Any):
        seen.append(req)
        for i in range(req.sampling.n):
            text = outputs[i]
            pieces = [text[j : j + piece] for j in range(0, len(text), piece)]
            for k, p in enumerate(pieces):
                last = k == len(pieces) - 1
                yield ChoiceDelta(
                    i,
                    (0,),
                    p,
                    finish_reason=FinishReason.STOP if last else None,
                    usage=Usage(len(req.prompt_token_ids), len(pieces), 0) if last else None,
                )

    pipeline._generate = generate  # type: ignore[method-assign]
    return pipeline, seen


def run_client(pipeline: RequestPipeline, fn) -> Any:
    app = build_http_app(ClusterConfig(), pipeline)

    async def go() -> Any:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with openai.AsyncOpenAI(
            base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0
        ) as client:
            return await fn(client)

    return asyncio.run(go())


CALLS = (
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_tool_calls_in_a_response():
    pipeline, seen = scripted([CALLS, "No call <b>here</b>."])

    async def fn(client):
        return await client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, TIME], n=2
        )

    r = run_client(pipeline, fn)
    first, second = r.choices
    assert first.finish_reason == "tool_calls" and first.message.content == "Checking."
    calls = first.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert second.finish_reason == "stop" and second.message.tool_calls is None
    assert second.message.content == "No call <b>here</b>."
    assert seen[0].sampling.structured_outputs is None
    # the tools reached the prompt as text (the fake template renders no tools)
    assert len(seen[0].prompt_token_ids) > 200


@pytest.mark.parametrize("piece", [1, 4])
def test_tool_calls_in_a_stream(piece):
    pipeline, _ = scripted([CALLS], piece)

    async def fn(client):
        stream = await client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, TIME], stream=True
        )
        return [c async for c in stream]

    chunks = run_client(pipeline, fn)
    deltas = [c.choices[0].delta for c in chunks]
    content = "".join(d.content or "" for d in deltas)
    assert content.strip() == "Checking." and "<" not in content
    tool_deltas = [t for d in deltas for t in d.tool_calls or ()]
    heads = [t for t in tool_deltas if t.id is not None]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in heads] == [
        (0, "function", "get_weather", ""),
        (1, "function", "get_time", ""),
    ]
    args: dict[int, str] = {}
    for t in tool_deltas:
        args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
    assert {i: json.loads(a) for i, a in args.items()} == {0: {"city": "Paris"}, 1: {}}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_forced_call_is_constrained_and_parsed_as_json():
    named = {"type": "function", "function": {"name": "get_weather"}}
    pipeline, seen = scripted(['{"city": "Rome"}'])

    async def fn(client):
        return await client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice=named
        )

    r = run_client(pipeline, fn)
    assert json.loads(seen[0].sampling.structured_outputs.json) == WEATHER["function"]["parameters"]
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome"},
    )
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"


def test_bad_constraints_are_400_with_the_field():
    pipeline, _ = scripted(["x"])

    async def fn(client):
        errors = []
        for kw in (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}},
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
            {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        ):
            with pytest.raises(openai.BadRequestError) as ei:
                await client.chat.completions.create(model=MODEL, messages=USER, **kw)
            errors.append(ei.value.response.json()["error"]["param"])
        with pytest.raises(openai.BadRequestError) as ei:
            await client.completions.create(
                model=MODEL, prompt="x", extra_body={"structured_outputs": {"choice": []}}
            )
        errors.append(ei.value.response.json()["error"]["param"])
        return errors

    assert run_client(pipeline, fn) == [
        "response_format.json_schema.schema",
        "structured_outputs",
        "tool_choice",
        "structured_outputs.choice",
    ]


def test_constraints_that_do_not_compile_are_400_naming_their_field():
    pipeline, seen = scripted(["x"])
    bad_schema = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}

    async def fn(client):
        params = []
        for kw in (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "A", "schema": bad_schema},
                }
            },
            {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
            {"extra_body": {"structured_outputs": {"grammar": "root ::= missing_rule"}}},
            {"extra_body": {"structured_outputs": {"json": bad_schema}}},
        ):
            with pytest.raises(openai.BadRequestError) as ei:
                await client.chat.completions.create(model=MODEL, messages=USER, **kw)
            err = ei.value.response.json()["error"]
            assert "compile" in err["message"], err
            params.append(err["param"])
        return params

    assert run_client(pipeline, fn) == [
        "response_format.json_schema.schema",
        "structured_outputs.regex",
        "structured_outputs.grammar",
        "structured_outputs.json",
    ]
    assert seen == []  # refused before reaching the scheduler
