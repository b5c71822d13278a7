"""Incremental detokenization of one choice, with stop strings.

Text is produced with ``tokenizers.decoders.DecodeStream`` (which buffers tokens until they
form valid UTF-8). Stop strings are matched on the accumulated text; to never stream text
that a stop string later turns out to cover, the end of the text that could be the start of
a stop string (its longest suffix that is a proper prefix of one) is held back until more
text arrives or the choice ends. vLLM and TGI hold back a fixed ``max(len(stop)) - 1``
characters; holding only a possible start sends the same text as soon as it is certain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

from pagedserve.scheduler.engine_messages import SequenceOutput
from pagedserve.scheduler.request import FinishReason


@dataclass(frozen=True)
class TextDelta:
    """What one step adds to a choice's text.

    Attributes:
        text: new text to send (may be empty).
        stopped: a stop string matched; the choice must end now (anything after the
            stop string, and the stop string itself unless it is kept, is not part of
            the text).
        stop: the stop string that matched (on the delta that stopped).
        num_token_ids: of the ids fed, how many belong to the choice: those up to the
            one whose text completed the stop string (a speculative step's delta may
            carry ids after it, which are dropped); all of them when none matched.
    """

    text: str
    stopped: bool
    stop: str | None = None
    num_token_ids: int | None = None


@dataclass(frozen=True)
class OutputText:
    """A scheduler delta seen through the detokenizer (:meth:`IncrementalDetokenizer.
    step_output`).

    Attributes:
        text: new text that may be sent (stop strings cut, held-back text withheld).
        finish_reason: the delta's, or STOP when a stop string matched in it.
        stop_reason: the stop string that matched, else the delta's stop token id.
        num_token_ids: how many of the delta's ids (and logprobs) belong to the choice:
            fewer than all when a stop string matched before its last id.
    """

    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_token_ids: int = 0


class IncrementalDetokenizer:
    """Turns a choice's stream of token ids into a stream of text.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``).
        stop: stop strings (non-empty).
        skip_special_tokens: drop special tokens such as EOS from the text.
        include_stop_str: keep a matched stop string at the end of the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # all text decoded so far (up to a stop match)
        self._sent = 0  # characters of _text already returned
        self._stopped = False
        self._include_stop = include_stop_str
        self._matched: str | None = None

    @property
    def text(self) -> str:
        """All text of the choice so far (excluding a matched stop string)."""
        return self._text

    def step(self, token_ids: list[int] | tuple[int, ...], final: bool = False) -> TextDelta:
        """Feed new token ids; return the text that may be sent now.

        Args:
            token_ids: ids appended since the last call.
            final: the choice ends with these ids: flush everything held back.
        """
        if self._stopped:
            return TextDelta("", True, None, 0)
        used = None
        for i, tid in enumerate(token_ids):
            chunk = self._stream.step(self._tokenizer, int(tid))
            if chunk:
                search_from = max(0, len(self._text) - self._hold)
                self._text += chunk
                found = self._find_stop(search_from)
                if found is not None:
                    cut, self._matched = found
                    if self._include_stop:
                        cut += len(self._matched)
                    self._text = self._text[:cut]
                    self._stopped = True
                    used = i + 1
                    break
        end = len(self._text) if (final or self._stopped) else len(self._text) - self._held()
        if end <= self._sent:
            return TextDelta("", self._stopped, self._matched, used)
        delta = self._text[self._sent : end]
        self._sent = end
        return TextDelta(delta, self._stopped, self._matched, used)

    def step_output(self, out: SequenceOutput) -> OutputText:
        """Feed one scheduler delta of this choice (its last one flushes the text).

        A stop token id that ended the choice is left out of the text unless
        ``include_stop_str``. When the returned ``finish_reason`` is STOP while
        ``out.finish_reason`` is None, a stop string ended the choice here: the caller
        aborts it on the scheduler (``abort_request(..., FinishReason.STOP)``).
        """
        text_ids = out.new_token_ids
        if out.stop_reason is not None and not self._include_stop:
            text_ids = text_ids[:-1]
        text = self.step(text_ids, final=out.finish_reason is not None)
        n = len(out.new_token_ids) if text.num_token_ids is None else text.num_token_ids
        return OutputText(
            text.text,
            FinishReason.STOP if text.stopped else out.finish_reason,
            text.stop if text.stop is not None else out.stop_reason,
            n,
        )

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string
        (it may yet become one): the characters to hold back."""
        text, held = self._text, 0
        for s in self._stop:
            p = text.find(s[0], max(0, len(text) - len(s) + 1))
            while p != -1 and len(text) - p > held:  # longest candidates first
                if s.startswith(text[p:]):
                    held = len(text) - p
                    break
                p = text.find(s[0], p + 1)
        return held

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self._stop:
            pos = self._text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best
