"""Speculative decoding (n-gram) on SmolLM2 through the offline API: on prompts whose
answer copies the prompt (most proposals accepted) and on an open question (most
rejected), greedy and seeded outputs equal those without speculation, and a stop string
completed inside an accepted run ends the text and the ids where the plain run does."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day."
CHATS = [
    [{"role": "user", "content": "Repeat this code exactly:\n" + CODE}],
    [{"role": "user", "content": "Fix the spelling and repeat: " + TEXT.replace("quick", "quik")}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3}


@pytest.fixture(scope="module")
def engines(smollm2_dir: Path):
    opts = dict(max_model_len=512, num_gpu_blocks=96, device="cpu", dtype="float32")
    with (
        LLM(str(smollm2_dir), **opts) as plain,
        LLM(str(smollm2_dir), speculative_config=SPEC, **opts) as spec,
    ):
        yield plain, spec


def ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_and_seeded_equal_without_speculation(engines):
    plain, spec = engines
    params = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, n=2),
        SamplingParams(max_tokens=24, temperature=0.0),
    ]
    before = spec.scheduler.stats().spec_decode
    want = plain.chat(CHATS, params)
    got = spec.chat(CHATS, params)
    assert ids(got) == ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    sd = spec.scheduler.stats().spec_decode
    accepted = sd.num_accepted_tokens - before.num_accepted_tokens
    proposed = sd.num_draft_tokens - before.num_draft_tokens
    assert accepted > 20 and proposed > accepted


def test_stop_string_inside_an_accepted_run(engines):
    plain, spec = engines
    chat = CHATS[0]
    text = plain.chat([chat], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0].text
    # stop strings that end at many places of the copied code: most inside accepted runs
    stops = sorted({text[k : k + 3] for k in range(4, len(text) - 3, 5)} - {""})[:8]
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop=[s]) for s in stops]
    want = plain.chat([chat] * len(stops), params)
    got = spec.chat([chat] * len(stops), params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert ids(got) == ids(want)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)


def test_greedy_equal_under_recompute_preemption(smollm2_dir: Path):
    """Three chats in 12 blocks of 16 slots (they need ~20 at their longest): sequences
    are preempted and recomputed between speculative steps with accepted runs."""
    opts = dict(max_model_len=512, num_gpu_blocks=12, device="cpu", dtype="float32")
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    results = []
    for spec in (None, SPEC):
        kw = {} if spec is None else {"speculative_config": spec}
        with LLM(str(smollm2_dir), **opts, **kw) as llm:
            results.append(ids(llm.chat(CHATS, greedy)))
            st = llm.scheduler.stats()
        assert st.num_preemptions > 0
    assert results[1] == results[0]
    assert st.spec_decode.num_accepted_tokens > 10
