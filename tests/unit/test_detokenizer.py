"""Incremental detokenization with stop strings (a character-level tokenizer: one token per
character, so every step adds exactly one character of text)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from pagedserve.cluster.detokenizer import IncrementalDetokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz .,!"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="a"))
    t.decoder = decoders.Fuse()
    return t


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def stream(tok: Tokenizer, text: str, stop: tuple[str, ...], include: bool = False):
    d = IncrementalDetokenizer(tok, stop=stop, include_stop_str=include)
    deltas = []
    toks = ids(text)
    for i, t in enumerate(toks):
        delta = d.step([t], final=i == len(toks) - 1)
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, delta.stop
    return deltas, None


def test_text_that_cannot_start_a_stop_string_is_sent_at_once(tok):
    deltas, stop = stream(tok, "the capital of france is paris.", ("france is not",))
    # Each character is sent with its own token, except the ones that could begin the
    # stop string: "f" of "of " is held one step, "france is " until "p" rules it out.
    assert deltas[:13] == list("the capital o")
    assert deltas[13] == "" and deltas[14] == "f "  # "f" could start "france is not"
    assert deltas[15:25] == [""] * 10  # "france is " is a prefix of the stop string
    assert deltas[25] == "france is p"
    assert "".join(deltas) == "the capital of france is paris." and stop is None


def test_a_matched_stop_string_is_never_sent(tok):
    deltas, stop = stream(tok, "say hello world again", ("lo w",))
    assert stop == "lo w"
    assert "".join(deltas) == "say hel"
    deltas, stop = stream(tok, "say hello world again", ("lo w",), include=True)
    assert "".join(deltas) == "say hello w"


def test_overlapping_candidates_hold_the_longest(tok):
    # "xaaaa" ends with "a", "aa" and "aaa", each a possible start of "aaab": the longest
    # is held, so the first "a" goes out with the fourth; "b" completes the stop string.
    deltas, stop = stream(tok, "xaaaab", ("aaab",))
    assert deltas == ["x", "", "", "", "a", ""] and stop == "aaab"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab c", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=3),
)
def test_streamed_text_is_the_text_up_to_the_first_stop(tok, text, stops):
    deltas, stop = stream(tok, text, tuple(stops))
    # Reference: streaming stops at the first character that completes a stop string;
    # the text then ends where the earliest stop string in it begins.
    ends = [text.find(s) + len(s) for s in stops if s in text]
    if not ends:
        assert stop is None and "".join(deltas) == text
        return
    seen = text[: min(ends)]
    pos, first = min((seen.find(s), i) for i, s in enumerate(stops) if s in seen)
    assert stop == stops[first]
    assert "".join(deltas) == seen[:pos]


def test_ids_after_a_stop_string_in_one_delta_are_not_kept(tok):
    """A speculative step's delta carries several ids: a stop string completed by its
    second id keeps two of the four (the rest are dropped with their text)."""
    from pagedserve.scheduler.engine_messages import SequenceOutput

    d = IncrementalDetokenizer(tok, stop=("cd",))
    assert d.step(ids("ab")).num_token_ids is None
    out = SequenceOutput("r", 0, tuple(ids("cdef")), None, 2, 6, 0)
    text = d.step_output(out)
    assert text.num_token_ids == 2 and text.text == "" and text.stop_reason == "cd"
    plain = IncrementalDetokenizer(tok, stop=("zz",)).step_output(out)
    assert plain.num_token_ids == 4 and plain.text == "cdef"
