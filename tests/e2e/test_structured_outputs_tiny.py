"""Structured outputs through the offline API on a tiny random Llama (char tokenizer).

A random model follows no format by itself, so every valid output here is the grammar's
doing: regex, choice and JSON-schema outputs match for greedy and seeded sampling, with
n = 3, overlapped and serial loops give the same tokens, a forced recompute preemption
rebuilds the matchers to the same tokens, an unconstrained request beside constrained
ones gives its tokens alone, a spec that does not compile is refused naming the field,
and a grammar that cannot go on ends only its own request.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputs
from pagedserve.scheduler.errors import InvalidRequest

PROMPTS = [[5, 17, 33, 9, 100], [12], [40, 41, 42, 43, 44, 45, 46], [99, 3, 3, 3, 120]]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
        "name": {"type": "string", "maxLength": 5},
    },
    "required": ["id", "tag"],
}
REGEX = r"[a-z]{2,6}(-[0-9]{1,3})?"
CHOICES = ("yes", "no", "maybe")


def constrained(spec: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 60), structured_outputs=spec, **kw)


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) <= {"id", "tag", "name"} and {"id", "tag"} <= set(obj), obj
    assert isinstance(obj["id"], int) and 0 <= obj["id"] <= 99, obj
    assert obj["tag"] in ("red", "green"), obj
    assert "name" not in obj or (isinstance(obj["name"], str) and len(obj["name"]) <= 5), obj


def run(engine: LLM, params: list[SamplingParams], prompts=PROMPTS):
    return engine.generate(prompts[: len(params)], params)


def params_set(seed: int | None, max_tokens: int = 60) -> list[SamplingParams]:
    sample: dict = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    sample["max_tokens"] = max_tokens
    return [
        constrained(StructuredOutputs(json=json.dumps(SCHEMA)), **sample),
        constrained(StructuredOutputs(regex=REGEX), **sample),
        constrained(StructuredOutputs(choice=CHOICES), n=3, **sample),
        constrained(StructuredOutputs(json_object=True), **sample),
    ]


def check_outputs(outs) -> None:
    json_out, regex_out, choice_out, obj_out = outs
    check_schema(json_out.outputs[0].text)
    assert re.fullmatch(REGEX, regex_out.outputs[0].text), regex_out.outputs[0].text
    assert len(choice_out.outputs) == 3
    assert all(c.text in CHOICES for c in choice_out.outputs)
    for out in outs[:3]:
        assert all(c.finish_reason == "stop" for c in out.outputs), out
        assert all(c.token_ids[-1] == 2 for c in out.outputs)  # ended on EOS
    obj = obj_out.outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert obj.text.startswith("{")


def engine(model_dir: Path, **kw) -> LLM:
    opts = {"block_size": 4, "num_gpu_blocks": 256, "device": "cpu", "dtype": "float32"}
    return LLM(str(model_dir), **{**opts, **kw})


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_outputs_satisfy_constraints_overlapped_and_serial(tiny_llama_dir: Path, seed):
    tokens = {}
    for overlap in (False, True):
        with engine(tiny_llama_dir, async_scheduling=overlap) as llm:
            outs = run(llm, params_set(seed))
        check_outputs(outs)
        tokens[overlap] = [[c.token_ids for c in o.outputs] for o in outs]
    assert tokens[False] == tokens[True]


def test_forced_preemption_rebuilds_matchers_to_same_tokens(tiny_llama_dir: Path):
    params = params_set(3, max_tokens=48)
    with engine(tiny_llama_dir) as llm:
        alone = [[c.token_ids for c in o.outputs] for o in run(llm, params)]
    with engine(
        tiny_llama_dir, num_gpu_blocks=14, max_num_batched_tokens=8, preemption_mode="recompute"
    ) as llm:
        outs = run(llm, params)
        assert sum(llm.scheduler.metrics.num_preemptions.values()) > 0
    check_outputs(outs)
    assert [[c.token_ids for c in o.outputs] for o in outs] == alone


def test_unconstrained_request_unchanged_beside_constrained(tiny_llama_dir: Path):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with engine(tiny_llama_dir) as llm:
        (alone,) = llm.generate([PROMPTS[3]], free)
        mixed = llm.generate(PROMPTS, [*params_set(None)[:3], free])
    assert mixed[3].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 12


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": 5}}}'), "json"),
        (StructuredOutputs(regex="[a-z"), "regex"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar"),
    ],
)
def test_spec_that_does_not_compile_is_refused(tiny_llama_dir: Path, spec, field):
    with engine(tiny_llama_dir) as llm:
        with pytest.raises(InvalidRequest) as err:
            llm.generate([PROMPTS[0]], constrained(spec))
        name = {"json": "json_schema"}.get(field, field)
        assert str(err.value).startswith(f"{name}: ") and err.value.param == name
        (ok,) = llm.generate([PROMPTS[0]], constrained(StructuredOutputs(choice=CHOICES)))
        assert ok.outputs[0].text in CHOICES


def test_grammar_dead_end_aborts_only_its_request(tiny_llama_dir: Path):
    # min_tokens bans EOS where the choice grammar allows only EOS: no token is allowed.
    stuck = constrained(StructuredOutputs(choice=("ab",)), min_tokens=5, temperature=0.0)
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with engine(tiny_llama_dir) as llm:
        (alone,) = llm.generate([PROMPTS[1]], free)
        bad, good = llm.generate(PROMPTS[:2], [stuck, free])
    assert bad.outputs[0].finish_reason == "abort"
    assert bad.outputs[0].text == "ab"
    assert good.outputs[0].token_ids == alone.outputs[0].token_ids


def test_beam_search_and_ignore_eos_refused():
    spec = StructuredOutputs(choice=CHOICES)
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(beam_width=2, structured_outputs=spec)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=spec)
