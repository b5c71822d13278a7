"""Structured outputs through the real gRPC server, Ray actors and SmolLM2: JSON-schema
outputs validate against their schemas (nested objects, arrays, enums, optional fields,
integer bounds; greedy and seeded n = 3), regex and choice outputs match, the CLI flags
reach the server, and a spec that does not compile is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from pagedserve.cluster.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.model]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "nickname": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "role"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
    },
    "required": ["city", "country", "location"],
}
PROMPTS = {
    "person": "Describe a user of a web site as JSON.",
    "order": "Give a shop order as JSON.",
    "city": "Give the capital of France with its coordinates as JSON.",
}


@pytest.mark.parametrize("name", ["person", "order", "city"])
@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded-n3"])
def test_json_schema_outputs_validate(address, name, seed):
    schema = {"person": PERSON, "order": ORDER, "city": CITY}[name]
    kwargs = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed, "n": 3}
    with Client(address, timeout_s=300) as c:
        res = c.generate(
            chat=[{"role": "user", "content": PROMPTS[name]}],
            max_tokens=160,
            json_schema=schema,
            strict=True,
            **kwargs,
        )
    assert len(res.choices) == (1 if seed is None else 3)
    for ch in res.choices:
        assert ch.finish_reason == "stop", ch.text
        jsonschema.validate(json.loads(ch.text), schema)


def test_regex_choice_and_cli_flags(address, tmp_path, capsys):
    from pagedserve.cluster.cli import main

    with Client(address, timeout_s=300) as c:
        date = c.generate("Today's date:", max_tokens=20, regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].text)
        pick = c.generate(
            chat=[{"role": "user", "content": "Is the sky blue?"}],
            max_tokens=8,
            choice=["yes", "no"],
            temperature=0.7,
            seed=3,
            n=3,
        )
        assert all(ch.text in ("yes", "no") for ch in pick.choices)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(PERSON))
    argv = ["generate", "--address", address, "--max-tokens", "120", "--output", "json"]
    assert main([*argv, "--json-schema", str(schema_file), "--chat", PROMPTS["person"]]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(out["choices"][0]["text"]), PERSON)
    assert main([*argv, "--choice", "red", "--choice", "blue", "A color:"]) == 0
    assert json.loads(capsys.readouterr().out)["choices"][0]["text"] in ("red", "blue")
    grammar_file = tmp_path / "g.ebnf"
    grammar_file.write_text('root ::= "ab" [0-9] [0-9]? "!"')
    assert main([*argv, "--max-tokens", "12", "--grammar", str(grammar_file), "Code:"]) == 0
    text = json.loads(capsys.readouterr().out)["choices"][0]["text"]
    assert re.fullmatch(r"ab[0-9]{1,2}!", text), text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": 5}}}'}, "json_schema"),
        ({"json_schema": "{not json"}, "structured_outputs.json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= missing_rule"}, "grammar"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"choice": ["a"], "beam_width": 2}, "beam search"),
    ],
)
def test_bad_spec_is_invalid_argument_naming_the_field(address, kwargs, field):
    with Client(address) as c, pytest.raises(grpc.RpcError) as ei:
        c.generate("hello", max_tokens=4, **kwargs)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in ei.value.details(), ei.value.details()
