"""Grammar compilation (:mod:`pagedserve.worker.grammar`) and the worker's bitmask step
(:mod:`pagedserve.worker.structured`) on the char tokenizer: errors name the field and give
xgrammar's reason, the LRU is bounded, the time and size limits hold, the mask allows
exactly the grammar's next characters, and an unconstrained batch allocates nothing."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import build_char_tokenizer

from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler, GrammarConfig, choice_grammar
from pagedserve.worker.structured import StructuredOutputsRunner

VOCAB = 128
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def compiler(tok, **limits) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, (EOS,), GrammarConfig(**limits))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json='{"type": 5}'), "json_schema: does not compile: Type should be"),
        (StructuredOutputs(regex="a("), "regex: does not compile: Regex parsing error"),
        (StructuredOutputs(grammar="root ::= nope"), "grammar: does not compile: EBNF parser"),
    ],
)
def test_errors_name_the_field_and_the_reason(tok, spec, message):
    with pytest.raises(ValueError) as err:
        compiler(tok).compile(spec)
    assert str(err.value).startswith(message), str(err.value)
    assert "/project/" not in str(err.value)  # xgrammar's source location is dropped


def test_lru_is_bounded_and_hits_return_the_same_grammar(tok):
    c = compiler(tok, max_cached=2)
    a, b, d = (StructuredOutputs(regex=r) for r in ("a+", "b+", "d+"))
    ga = c.compile(a)
    assert c.compile(a) is ga and len(c) == 1
    c.compile(b)
    c.compile(a)  # a is now the most recent: b goes first
    c.compile(d)
    assert len(c) == 2
    assert c.compile(a) is ga
    assert c._cache.keys() == {a.key, d.key}


def test_time_and_size_limits(tok, monkeypatch):
    slow = compiler(tok, compile_timeout_s=0.05)
    real = slow._run_compile

    def late(spec, future):  # a compile that takes longer than the limit, whatever the load
        time.sleep(0.5)
        real(spec, future)

    monkeypatch.setattr(slow, "_run_compile", late)
    with pytest.raises(ValueError, match=r"^regex: compiling took longer than 0.05 s"):
        slow.compile(StructuredOutputs(regex="[a-z]{1,40}x"))
    with pytest.raises(ValueError, match=r"^choice: the compiled grammar takes \d+ bytes"):
        compiler(tok, max_grammar_bytes=1).compile(StructuredOutputs(choice=("yes", "no")))
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarConfig(compile_timeout_s=0)
    busy = compiler(tok, max_concurrent=1, compile_timeout_s=0.05)
    busy._slots.acquire()  # a compile past its limit still holds the only slot
    with pytest.raises(ValueError, match=r"^regex: the grammar compiler stayed busy for 0.05 s"):
        busy.compile(StructuredOutputs(regex="a"))
    busy._slots.release()
    assert busy.compile(StructuredOutputs(regex="a")) is not None


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(('a"b', "c\\d")) == 'root ::= "a\\"b" | "c\\\\d"'


def allowed(bitmask_row: torch.Tensor) -> set[int]:
    bits = [(int(w) >> b) & 1 for w in bitmask_row.tolist() for b in range(32)]
    return {i for i, bit in enumerate(bits[:VOCAB]) if bit}


def test_mask_allows_the_next_characters_then_only_eos(tiny_llama_dir, tok):
    runner = StructuredOutputsRunner(str(tiny_llama_dir), VOCAB, (EOS,))
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abx"}
    g = runner.build(StructuredOutputs(choice=("ab", "ax")), [ids["a"]])
    assert g.error == "" and g.active
    assert runner.start_fill([None, None]) is None  # nothing constrained: nothing allocated
    step = runner.start_fill([None, g])
    assert step is not None and step.rows == [1]
    logits = torch.zeros(2, VOCAB)
    masked, fill_s = runner.apply(step, logits, copy=True)
    assert fill_s > 0
    assert masked is not logits and bool((logits == 0).all())  # raw logits untouched
    assert allowed(step.bitmask[1]) == {ids["b"], ids["x"]}
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == sorted([ids["b"], ids["x"]])
    assert bool(torch.isfinite(masked[0]).all())  # the unconstrained row is untouched
    assert g.accept(ids["x"])
    step = runner.start_fill([g])
    in_place = torch.zeros(1, VOCAB)
    assert runner.apply(step, in_place, copy=False)[0] is in_place
    assert torch.isfinite(in_place[0]).nonzero().flatten().tolist() == [EOS]
    assert allowed(step.bitmask[0]) == {EOS}
    assert g.accept(EOS) and not g.active
    assert g.accept(ids["a"])  # a terminated matcher lets anything through


def test_rejected_replay_and_bad_spec_fail_the_sequence_only(tiny_llama_dir, tok):
    runner = StructuredOutputsRunner(str(tiny_llama_dir), VOCAB, (EOS,))
    bad = runner.build(StructuredOutputs(choice=("ab",)), [tok.convert_tokens_to_ids("z")])
    assert bad.matcher is None and "not allowed by the grammar" in bad.error
    broken = runner.build(StructuredOutputs(regex="("), [])
    assert broken.matcher is None and broken.error.startswith("structured outputs: regex:")
    assert runner.start_fill([bad, broken]) is None


def test_greedy_row_whose_argmax_is_allowed_is_left_unmasked(tiny_llama_dir, tok):
    runner = StructuredOutputsRunner(str(tiny_llama_dir), VOCAB, (EOS,))
    a, b, x = (tok.convert_tokens_to_ids(c) for c in "abx")
    grammars = [runner.build(StructuredOutputs(choice=("b", "x")), []) for _ in range(3)]
    logits = torch.zeros(3, VOCAB)
    logits[0, b] = logits[1, a] = logits[2, b] = 5.0  # rows 0, 2: the top token is allowed
    step = runner.start_fill(grammars)
    masked, _ = runner.apply(step, logits, copy=False, greedy=[True, True, False])
    assert bool(torch.isfinite(masked[0]).all())  # greedy, argmax allowed: untouched
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == sorted([b, x])
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == sorted([b, x])  # sampled
    assert masked.argmax(dim=-1).tolist() == [b, min(b, x), b]


def test_mask_error_fails_the_step_sequences_not_the_step(tiny_llama_dir, tok):
    runner = StructuredOutputsRunner(str(tiny_llama_dir), VOCAB, (EOS,))
    grammar = runner.build(StructuredOutputs(choice=("ab",)), [])
    step = runner.start_fill([grammar])
    bad = torch.zeros(1, 1, VOCAB)  # 3-D: xgrammar refuses it
    out, _ = runner.apply(step, bad, copy=False)
    assert out is bad and grammar.matcher is None
    assert grammar.error.startswith("applying the grammar mask failed: ")


@pytest.mark.parametrize(
    ("schema", "keyword", "where"),
    [
        (
            '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}',
            "uniqueItems",
            "#",
        ),
        (
            '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}',
            "not",
            "#/properties/a",
        ),
        (
            '{"anyOf": [{"type": "integer"}, {"type": "array", "contains": {"const": 5}}]}',
            "contains",
            "#/anyOf/1",
        ),
        (
            '{"$defs": {"n": {"if": {"type": "integer"}, "then": {"minimum": 1}}}, "$ref": "#/$defs/n"}',
            "if",
            "#/$defs/n",
        ),
        ('{"type": "object", "dependentRequired": {"a": ["b"]}}', "dependentRequired", "#"),
        ('{"$ref": "http://example.com/schema.json"}', "$ref", "#"),
    ],
)
def test_schema_keywords_xgrammar_would_drop_are_refused(tok, schema, keyword, where):
    with pytest.raises(ValueError) as err:
        compiler(tok).compile(StructuredOutputs(json=schema))
    message = str(err.value)
    assert message.startswith(f"json_schema: keyword {keyword!r} (at {where}) is not supported")


def test_keyword_names_as_data_or_property_names_still_compile(tok):
    schema = (
        '{"type": "object", "properties": {"not": {"enum": ["contains", "if"]},'
        ' "uniq": {"type": "array", "items": {"type": "integer"}, "uniqueItems": false}},'
        ' "required": ["not"]}'
    )
    assert compiler(tok).compile(StructuredOutputs(json=schema)) is not None
