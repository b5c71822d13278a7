"""Structured outputs and tool calling through the real server (Ray, SmolLM2), driven by
the official openai client: ``chat.completions.parse`` with pydantic models returns valid
objects, regex and choice outputs match, a tool call round trip works streaming and not,
and a bad schema is a 400 naming the field."""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field
from test_openai_api import wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.model]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Role(enum.StrEnum):
    admin = "admin"
    user = "user"
    guest = "guest"


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip_code: int = Field(ge=1000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: Role
    nickname: str | None = Field(max_length=10)
    address: Address
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


class Score(BaseModel):
    label: str = Field(max_length=12)
    percent: int = Field(ge=0, le=100)


class Scores(BaseModel):
    scores: list[Score] = Field(min_length=1, max_length=3)
    passed: bool


@pytest.fixture(scope="module")
def oai(cluster) -> openai.OpenAI:
    url = f"http://{cluster[0].http_address}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


@pytest.mark.parametrize(
    "schema, prompt",
    [
        (Person, "Describe a fictional person as JSON."),
        (Scores, "Grade three essays as JSON."),
    ],
)
def test_parse_returns_valid_objects(oai, model, cluster, schema, prompt):
    r = oai.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        response_format=schema,
        max_tokens=200,
        temperature=0.8,
        seed=3,
        n=3,
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        parsed = choice.message.parsed
        assert isinstance(parsed, schema)
        assert schema.model_validate_json(choice.message.content) == parsed
    wait_all_free(cluster)


def test_regex_and_choice_through_extra_body(oai, model, cluster):
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a date."}],
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}},
    )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", r.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    c = oai.completions.create(
        model=model,
        prompt="The movie was wonderful. Sentiment:",
        max_tokens=8,
        temperature=0.9,
        seed=1,
        n=3,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(ch.text in choices for ch in c.choices), [ch.text for ch in c.choices]
    j = oai.completions.create(
        model=model,
        prompt="A JSON object:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},  # a vLLM extension here
    )
    assert isinstance(json.loads(j.choices[0].text), dict)
    wait_all_free(cluster)


def _second_turn(oai, model, calls, stream: bool):
    """Send the calls' results back; returns (answer text, the prompt's text)."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        },
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": f"{c['name']}: 18 degrees, sunny"}
            for c in calls
        ),
    ]
    kw = dict(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=24, temperature=0)
    if not stream:
        r = oai.chat.completions.create(**kw, extra_body={"return_token_ids": True})
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content, r.choices[0].model_extra["prompt_token_ids"]
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    return text, None


def test_tool_call_round_trip(oai, model, cluster, served_model_dir):
    from transformers import AutoTokenizer

    r = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for c in calls:
        assert c.function.name in ("get_weather", "get_time")
        args = json.loads(c.function.arguments)
        assert isinstance(args["city"], str)
    records = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls
    ]
    answer, prompt_ids = _second_turn(oai, model, records, stream=False)
    assert isinstance(answer, str) and answer
    prompt = AutoTokenizer.from_pretrained(served_model_dir).decode(prompt_ids)
    assert "<tool_response>" in prompt and "18 degrees, sunny" in prompt
    assert '"name": "get_weather"' in prompt  # the tools, in the system prompt
    wait_all_free(cluster)


def test_tool_call_round_trip_streaming(oai, model, cluster):
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=named,
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or ()]
    head = deltas[0]
    assert (head.index, head.type, head.function.name, head.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert head.id.startswith("call_") and all(t.index == 0 for t in deltas)
    arguments = "".join(t.function.arguments or "" for t in deltas)
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    call = {"id": head.id, "name": "get_weather", "arguments": arguments}
    answer, _ = _second_turn(oai, model, [call], stream=True)
    assert answer
    wait_all_free(cluster)


def test_bad_schemas_are_400_naming_the_field(oai, model):
    bad = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "A", "schema": bad}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "A", "schema": "{}"}}, "response_format.json_schema.schema"),
    ]  # fmt: skip
    for fmt, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            oai.chat.completions.create(
                model=model,
                messages=ASK,
                response_format=fmt,  # type: ignore[arg-type]
                max_tokens=8,
            )
        assert ei.value.response.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=8,
            extra_body={"structured_outputs": {"regex": "("}},
        )
    assert ei.value.response.json()["error"]["param"] == "structured_outputs.regex"
