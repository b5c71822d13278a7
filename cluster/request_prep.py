"""Request preparation: a transport's request -> a validated, tokenized :class:`EngineRequest`.

A transport turns its wire format into a :class:`GenerateInput` (the prompt) and a
:class:`SamplingRequest` (every sampling field, ``None`` = unset);
:meth:`RequestPreparer.prepare` checks every field (the message of each error names it),
tokenizes the prompt (chat template included), resolves the default ``max_tokens`` and
checks the request against the context and the KV pools (vLLM v1's
``Processor.process_inputs`` does this job there). Blocking: the pipeline
(:mod:`pagedserve.cluster.pipeline`) runs it on a thread.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.flights import MAX_REQUEST_ID_CHARS
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import InvalidRequest, RequestRejected
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_CHAT_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode text, or None when it is.

    A lone UTF-16 surrogate (what JSON's ``"\\ud800"`` escape decodes to when no low
    surrogate follows) is a ``str`` character with no UTF-8 form: it cannot be tokenized,
    hashed or sent back, so a request holding one is refused.
    """
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return f"a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}"
    return None


def check_unicode(text: str, field: str) -> None:
    """Raise InvalidRequest naming ``field`` when ``text`` is not valid Unicode text
    (see :func:`unicode_problem`)."""
    problem = unicode_problem(text)
    if problem is not None:
        raise InvalidRequest(f"{field}: the text is not valid Unicode: {problem}", field)


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend must know about the served model and the cluster's pools.

    Attributes:
        name: model path or name (reported by GetStats).
        max_model_len: longest sequence, tokens.
        vocab_size: valid token ids are [0, vocab_size).
        eos_token_ids: ids ending a choice unless ignore_eos.
        max_kv_slots: the largest worker pool, in token slots (num_blocks * block_size).
        block_size: tokens per KV block (of the largest pool).
    """

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_kv_slots: int
    block_size: int = 16


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message: ``arguments`` is JSON text (OpenAI's
    ``function.arguments``)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """A chat message with the fields of tool calling (a ``(role, content)`` pair is the
    plain form).

    Attributes:
        role: one of :data:`CHAT_ROLES`.
        content: the text ("" when an assistant message only calls tools).
        tool_calls: an assistant's calls (rendered by the template as ``tool_calls``).
        tool_call_id: a ``tool`` message's answer to the call with this id.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's shape: a call's
        ``arguments`` as a mapping where they are a JSON object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _json_or_text(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


Message = tuple[str, str] | ChatMessage


def role_and_content(message: Message) -> tuple[str, str]:
    """(role, content) of either form of a chat message."""
    if isinstance(message, ChatMessage):
        return message.role, message.content
    return message


@dataclass(frozen=True)
class GenerateInput:
    """The prompt of one request: exactly one of ``text``, ``token_ids``, ``messages``.

    Attributes:
        text: raw prompt, tokenized as is (BOS added if the tokenizer does).
        token_ids: pre-tokenized prompt.
        messages: chat messages, ``(role, content)`` pairs or :class:`ChatMessage`s,
            rendered with the model's chat template plus the generation prompt.
        tools: with ``messages``, the functions the template renders (OpenAI ``tools``
            items, ``{"type": "function", "function": {"name", "description",
            "parameters"}}``), passed as ``apply_chat_template(tools=...)``.
    """

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class SamplingRequest:
    """Sampling fields as a client sent them; ``None`` = unset (the server default).

    Field meanings and ranges are those of :class:`SamplingParams`, except ``max_tokens``:
    unset means the rest of the context (see :meth:`RequestPreparer.resolve_max_tokens`).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    beam_width: int | None = None
    length_penalty: float | None = None
    priority: int | None = None
    structured_outputs: StructuredOutputs | None = None


class RequestPreparer:
    """Checks and tokenizes requests for one served model.

    Args:
        tokenizer: a Hugging Face fast tokenizer of the served model.
        info: model and pool facts.
    """

    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        # No token covers more UTF-8 bytes than the longest vocabulary entry's spelling
        # (byte-level or "▁"/"<0x..>" spellings only overestimate), so a text longer than
        # this many bytes cannot fit in max_model_len and is refused before tokenizing.
        longest = max((len(t.encode()) for t in tokenizer.get_vocab()), default=64)
        self._max_text_bytes = max(1, longest) * info.max_model_len
        self._grammars: GrammarCompiler | None = None  # built on the first constraint
        self._grammars_lock = threading.Lock()

    def prepare(
        self, prompt: GenerateInput, req: SamplingRequest, request_id: str = ""
    ) -> EngineRequest:
        """Check and tokenize a request (blocking: run it on a thread).

        Returns:
            the request for the scheduler (``request_id``, or a new random id when empty;
            the model's EOS ids; no subscriber yet).

        Raises:
            InvalidRequest: a bad field (the message names it), an empty or too long prompt,
                a structured-output spec that does not compile (within the time and size
                limits of :class:`~pagedserve.worker.grammar.GrammarConfig`).
            RequestRejected: one sequence needs more KV slots than the largest pool holds.
        """
        self._check_sampling_fields(req)
        self._check_unicode(prompt, req)
        # Validate every field now (cheap) with a provisional max_tokens; the default is
        # resolved once the prompt length is known.
        provisional = self._sampling(
            req, req.max_tokens if req.max_tokens is not None else self.info.max_model_len
        )
        ids = self._prompt_ids(prompt)
        if not ids:
            field = "text" if prompt.text is not None else "token_ids"
            field = "chat" if prompt.messages is not None else field
            raise InvalidRequest(f"{field}: the prompt tokenized to zero tokens")
        max_tokens = self.resolve_max_tokens(len(ids), req.max_tokens, provisional.beam_width)
        try:
            sampling = dataclasses.replace(provisional, max_tokens=max_tokens)
        except ValueError as exc:  # e.g. min_tokens above the default max_tokens
            raise InvalidRequest(str(exc)) from exc
        for t in sampling.stop_token_ids:
            if t >= self.info.vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids: token id {t} is out of range [0, {self.info.vocab_size})",
                    "stop_token_ids",
                )
        request_id = request_id or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        if sampling.structured_outputs is not None:
            self.check_grammar(sampling.structured_outputs)
        return EngineRequest(request_id, tuple(ids), sampling, self.info.eos_token_ids)

    def check_grammar(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` for the served tokenizer (cached; blocking).

        Raises:
            InvalidRequest: it does not compile; the message starts with the field
                (``json_schema``, ``regex``, ``choice``, ``grammar``) and gives xgrammar's
                reason.
        """
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.info.vocab_size, self.info.eos_token_ids
                )
        try:
            self._grammars.compile(spec)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise InvalidRequest(str(exc), field) from None

    def resolve_max_tokens(
        self, prompt_len: int, max_tokens: int | None, beam_width: int = 1
    ) -> int:
        """``max_tokens`` as given, or the rest of the context when unset.

        The context of one sequence is ``max_model_len`` capped by what the largest worker
        pool can hold (for beam search: what ``beam_width`` beams can hold at once), so an
        unset ``max_tokens`` never makes a request unservable.

        Raises:
            InvalidRequest: prompt + max_tokens exceeds max_model_len, or the prompt leaves
                no room for one output token.
            RequestRejected: one sequence needs more KV slots than the largest pool holds.
        """
        info = self.info
        if max_tokens is None:
            per_beam_blocks = info.max_kv_slots // info.block_size // max(1, beam_width)
            context = min(info.max_model_len, per_beam_blocks * info.block_size)
            if prompt_len >= context:
                raise InvalidRequest(
                    f"the prompt ({prompt_len} tokens) leaves no room for output (max_tokens "
                    "unset): the context "
                    f"holds {context} tokens (max_model_len {info.max_model_len})"
                )
            return context - prompt_len
        if prompt_len + max_tokens > info.max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({info.max_model_len})"
            )
        needed = prompt_len + max_tokens  # per choice: choices can take turns
        if needed > info.max_kv_slots:
            raise RequestRejected(
                f"max_tokens: a sequence of this request (prompt {prompt_len} + max_tokens "
                f"{max_tokens}) needs up to {needed} KV slots; the largest worker pool holds "
                f"{info.max_kv_slots}"
            )
        return max_tokens

    @staticmethod
    def _check_sampling_fields(req: SamplingRequest) -> None:
        for name in (
            "temperature",
            "top_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "length_penalty",
        ):
            value = getattr(req, name)
            if value is not None and not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number")
        if len(req.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in req.stop):
            raise InvalidRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} are allowed, got "
                f"{len(req.stop_token_ids)}",
                "stop_token_ids",
            )
        if req.n is not None and req.n > MAX_N:
            raise InvalidRequest(f"n must be <= {MAX_N}, got {req.n}")

    @staticmethod
    def _check_unicode(prompt: GenerateInput, req: SamplingRequest) -> None:
        """Every text field of a request is valid Unicode (gRPC's strings always are;
        JSON's may hold lone surrogates), named as the pipeline names it."""
        if prompt.text is not None:
            check_unicode(prompt.text, "text")
        for message in prompt.messages or ():
            role, content = role_and_content(message)
            check_unicode(role, "chat")
            check_unicode(content, "chat")
        for s in req.stop:
            if isinstance(s, str):
                check_unicode(s, "stop")
        if isinstance(req.cache_salt, str):
            check_unicode(req.cache_salt, "cache_salt")

    def _sampling(self, req: SamplingRequest, max_tokens: int) -> SamplingParams:
        if max_tokens > self.info.max_model_len:
            raise InvalidRequest(
                f"max_tokens ({max_tokens}) exceeds max_model_len ({self.info.max_model_len})"
            )

        def opt(value: Any, default: Any) -> Any:
            return default if value is None else value

        beam_width = opt(req.beam_width, 1)
        top_k = opt(req.top_k, 0)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=float(opt(req.temperature, 1.0)),
                top_p=float(opt(req.top_p, 1.0)),
                top_k=0 if top_k == -1 else top_k,
                seed=req.seed,
                n=opt(req.n, beam_width if beam_width > 1 else 1),
                stop=tuple(req.stop),
                stop_token_ids=tuple(int(t) for t in req.stop_token_ids),
                ignore_eos=opt(req.ignore_eos, False),
                logprobs=req.logprobs,
                repetition_penalty=float(opt(req.repetition_penalty, 1.0)),
                presence_penalty=float(opt(req.presence_penalty, 0.0)),
                frequency_penalty=float(opt(req.frequency_penalty, 0.0)),
                min_tokens=opt(req.min_tokens, 0),
                include_stop_str_in_output=opt(req.include_stop_str_in_output, False),
                cache_salt=req.cache_salt,
                beam_width=beam_width,
                length_penalty=float(opt(req.length_penalty, 1.0)),
                priority=opt(req.priority, 0),
                structured_outputs=req.structured_outputs,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _check_text_size(self, text: str, field: str = "text") -> None:
        if len(text) > self._max_text_bytes or len(text.encode()) > self._max_text_bytes:
            raise InvalidRequest(
                f"the prompt text ({len(text.encode())} bytes) cannot fit in max_model_len "
                f"({self.info.max_model_len} tokens)",
                field,
            )

    def _prompt_ids(self, prompt: GenerateInput) -> list[int]:
        if prompt.text is not None:
            if not prompt.text:
                raise InvalidRequest("the prompt text is empty", "text")
            self._check_text_size(prompt.text, "text")
            return list(self.tokenizer(prompt.text)["input_ids"])
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"token_ids: token id {bad[0]} is out of range [0, {self.info.vocab_size})"
                )
            return ids
        if prompt.messages is not None:
            return self._chat_ids(prompt.messages, prompt.tools)
        raise InvalidRequest("request has no input (set text, token_ids or chat)")

    def _chat_ids(
        self, messages: tuple[Message, ...], tools: tuple[dict[str, Any], ...] | None = None
    ) -> list[int]:
        if not messages:
            raise InvalidRequest("the chat has no messages", "chat")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidRequest(
                f"chat: at most {MAX_CHAT_MESSAGES} messages are allowed, got {len(messages)}",
                "messages",
            )
        if len(messages) > self.info.max_model_len:
            raise InvalidRequest(
                f"{len(messages)} chat messages cannot fit in max_model_len "
                f"({self.info.max_model_len} tokens)",
                "chat",
            )
        pairs = [role_and_content(m) for m in messages]
        for role, _ in pairs:
            if role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"unknown chat role {role!r} (use one of {CHAT_ROLES})", "chat"
                )
        self._check_text_size("".join(content for _, content in pairs), "chat")
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                [
                    m.template_dict()
                    if isinstance(m, ChatMessage)
                    else {"role": m[0], "content": m[1]}
                    for m in messages
                ],
                tokenize=False,
                add_generation_prompt=True,
                **extra,
            )
        except Exception as exc:  # template errors (e.g. role order) are the client's
            raise InvalidRequest(f"chat template failed: {exc}") from exc
        self._check_text_size(text, "chat")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
