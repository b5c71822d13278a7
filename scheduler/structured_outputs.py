"""What a structured-output constraint asks for (pure Python: scheduler, worker and frontend).

The spec names one constraint kind and its source text; compiling it into a grammar (xgrammar)
and matching tokens against it happen elsewhere. The fields follow vLLM's
``StructuredOutputsParams`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) so an
OpenAI ``response_format`` or a vLLM ``structured_outputs`` body maps onto it one to one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_SPEC_CHARS = 65536  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's generated text; exactly one kind is set.

    Attributes:
        json: a JSON Schema as JSON text (OpenAI ``json_schema``; vLLM ``json``).
        json_object: any JSON object (OpenAI ``json_object``).
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in EBNF (GBNF-style, root rule ``root``).
        strict: a JSON schema applied strictly (OpenAI ``strict``): no properties beyond
            the schema's (``additionalProperties`` false where unspecified).

    Raises:
        ValueError: when no kind or several are set, a text is empty or longer than
            65536 characters, ``json`` is not JSON text, or ``choice`` is empty, has more
            than 256 entries or an empty string.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = False
    _kinds: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = tuple(
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        )
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, choice, "
                f"grammar; got {list(kinds) or 'none'}"
            )
        object.__setattr__(self, "_kinds", kinds)
        for name in ("json", "regex", "grammar"):
            text = getattr(self, name)
            if text is None:
                continue
            if not isinstance(text, str) or not text:
                raise ValueError(f"structured outputs: {name} must be a non-empty string")
            if len(text) > MAX_SPEC_CHARS:
                raise ValueError(
                    f"structured outputs: {name} is {len(text)} characters "
                    f"(at most {MAX_SPEC_CHARS})"
                )
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured outputs: json is not valid JSON: {exc}") from None
        if self.choice is not None:
            if not isinstance(self.choice, tuple):
                object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured outputs: choice needs 1 to {MAX_CHOICES} strings, "
                    f"got {len(self.choice)}"
                )
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured outputs: every choice must be a non-empty string")

    @property
    def kind(self) -> str:
        """The constraint kind: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._kinds[0]

    @property
    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the compiled grammar (kind, source text, strict): the
        compile cache's key."""
        if self.kind == "json_object":
            source = ""
        elif self.kind == "choice":
            source = json.dumps(list(self.choice or ()))
        else:
            source = str(getattr(self, self.kind))
        return (self.kind, source, self.strict)
