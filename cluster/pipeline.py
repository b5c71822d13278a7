"""The one request path behind every transport (gRPC, the OpenAI-compatible HTTP API).

A transport turns its wire format into a :class:`GenerateInput` (the prompt) and a
:class:`SamplingRequest` (every sampling field, ``None`` = unset) and hands them to
:class:`RequestPipeline`, which does everything else once: validation, tokenization, chat
templating, the default ``max_tokens``, the KV-capacity check, the scheduler call,
incremental detokenization, stop strings, and aborting the request (freeing its blocks)
when the consumer goes away. It yields transport-neutral :class:`ChoiceDelta` items; the
transports only render them (protobuf messages, or OpenAI JSON / Server-Sent Events).

Errors are :class:`~pagedserve.scheduler.errors.ServingError` subclasses; each transport
maps ``err.status`` to its own status with one lookup. Anything else escaping the scheduler
becomes a plain ``ServingError`` (status INTERNAL) naming the cause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from pagedserve.cluster.detokenizer import IncrementalDetokenizer
from pagedserve.cluster.flights import MAX_REQUEST_ID_CHARS, Flight, FlightTable
from pagedserve.cluster.output_router import OutputRouter
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    InvalidRequest,
    RequestRejected,
    ServingError,
)
from pagedserve.scheduler.outputs import SampleLogprobs
from pagedserve.scheduler.request import FinishReason
from pagedserve.scheduler.sampling_params import SamplingParams

log = logging.getLogger(__name__)

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
class GenerateInput:
    """The prompt of one request: exactly one of ``text``, ``token_ids``, ``messages``.

    Attributes:
        text: raw prompt, tokenized as is (BOS added if the tokenizer does).
        token_ids: pre-tokenized prompt.
        messages: chat messages ``(role, content)``, rendered with the model's chat
            template plus the generation prompt.
    """

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class SamplingRequest:
    """Sampling fields as a client sent them; ``None`` = unset (the server default).

    Field meanings and ranges are those of :class:`SamplingParams`, except ``max_tokens``:
    unset means the rest of the context (see :meth:`RequestPipeline.resolve_max_tokens`).
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


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for :meth:`RequestPipeline.generate`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class Usage:
    """Token counts of one choice (on its last delta).

    Attributes:
        prompt_tokens: prompt length, tokens (the same for every choice of a request).
        completion_tokens: output tokens of the choice.
        cached_tokens: prompt tokens served from the prefix cache.
        num_preemptions: how often the choice was preempted.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_preemptions: int = 0


@dataclass(frozen=True)
class ChoiceDelta:
    """What one scheduler delta adds to one choice, ready for any transport.

    Attributes:
        index: choice index, 0..n-1.
        token_ids: new token ids (a stop token id included).
        text: new text that may be sent (stop strings cut, held-back text withheld).
        logprobs: one per token of ``token_ids`` when the request asked for logprobs.
        cumulative_logprob: sum of the choice's token logprobs so far (when asked).
        score: beam search: the beam's length-penalized score.
        finish_reason: set on the last delta of the choice (a stop string gives STOP).
        stop_reason: on a last delta ended by one: the stop string or the stop token id.
        usage: on the last delta: the choice's token counts.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[SampleLogprobs, ...] = ()
    cumulative_logprob: float | None = None
    score: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None


class ClientTooSlow(ServingError):
    """The consumer of a stream stopped reading: more outputs are buffered for it than
    the bound allows. The request is aborted (its blocks freed)."""

    status = "RESOURCE_EXHAUSTED"


class RequestPipeline:
    """Validation, tokenization, scheduler call and detokenization shared by all transports.

    Args:
        scheduler: the SchedulerActor handle.
        tokenizer: a Hugging Face fast tokenizer of the served model.
        info: model and pool facts.
        max_buffered_outputs: most scheduler outputs held for one stream whose consumer
            has not taken them; past it the request is aborted (:class:`ClientTooSlow`).
        scheduler_timeout_s: how long a request waits for the scheduler to accept it
            before it fails with UNAVAILABLE (seconds).
        id_reuse_wait_s: how long a request whose id is in flight waits for it to end
            (see :mod:`pagedserve.cluster.flights`), seconds.
    """

    def __init__(
        self,
        scheduler: Any,
        tokenizer: Any,
        info: ModelInfo,
        max_buffered_outputs: int = 4096,
        scheduler_timeout_s: float = 10.0,
        id_reuse_wait_s: float = 1.0,
    ) -> None:
        if max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be >= 1, got {max_buffered_outputs}")
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.info = info
        self.max_buffered_outputs = max_buffered_outputs
        self.scheduler_timeout_s = scheduler_timeout_s
        self.flights = FlightTable(id_reuse_wait_s)
        self.router = OutputRouter(scheduler, max_buffered_outputs)
        self._background: set[asyncio.Future[None]] = set()  # aborts still on their way
        # No token covers more UTF-8 bytes than the longest vocabulary entry's spelling
        # (byte-level or "▁"/"<0x..>" spellings only overestimate), so a text longer than
        # this many bytes cannot fit in max_model_len and is refused before tokenizing.
        longest = max((len(t.encode()) for t in tokenizer.get_vocab()), default=64)
        self._max_text_bytes = max(1, longest) * info.max_model_len

    # ------------------------------------------------------------------ validation
    def prepare(
        self, prompt: GenerateInput, req: SamplingRequest, request_id: str = ""
    ) -> PreparedRequest:
        """Check and tokenize a request (blocking: run it on a thread).

        Raises:
            InvalidRequest: a bad field (the message names it), an empty or too long prompt.
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
        return PreparedRequest(request_id, tuple(ids), sampling)

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
        for role, content in prompt.messages or ():
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
            return self._chat_ids(prompt.messages)
        raise InvalidRequest("request has no input (set text, token_ids or chat)")

    def _chat_ids(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
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
        for role, _ in messages:
            if role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"unknown chat role {role!r} (use one of {CHAT_ROLES})", "chat"
                )
        self._check_text_size("".join(content for _, content in messages), "chat")
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:  # template errors (e.g. role order) are the client's
            raise InvalidRequest(f"chat template failed: {exc}") from exc
        self._check_text_size(text, "chat")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ generation
    async def admit(self, request_id: str) -> Flight:
        """Register a request id as in flight before anything else happens to the request
        (see :mod:`pagedserve.cluster.flights`); pass the flight to :meth:`generate`.

        Raises:
            ClusterUnavailable: draining, or the scheduler actor is down.
            InvalidRequest: an empty or too long id.
            DuplicateRequest: the id stays in flight for ``id_reuse_wait_s``.
        """
        return await self.flights.admit(request_id)

    def release(self, flight: Flight) -> None:
        """Free a flight that never reached :meth:`generate` (idempotent)."""
        self.flights.release(flight)

    async def abort(self, request_id: str) -> bool:
        """Abort a request at whatever stage it is (tokenizing, in transit to the
        scheduler, queued, running). Its stream ends with ABORT on every choice.

        Returns True when the request was in flight (not finished) and not aborted before.

        Raises:
            ClusterUnavailable: the scheduler actor is unreachable.
        """
        flight = self.flights.mark_aborted(request_id)
        if flight is None:
            return False
        if flight.added:
            # NOTE: before the scheduler acknowledged the request, generate() aborts it
            # itself once the acknowledgement arrives (an abort sent now could overtake it).
            try:
                return bool(
                    await asyncio.wait_for(
                        self.scheduler.abort.remote(request_id), self.scheduler_timeout_s
                    )
                )  # False: it had just finished
            except (ray.exceptions.RayActorError, TimeoutError) as exc:
                raise ClusterUnavailable(f"scheduler unavailable: {exc!r}") from exc
        return True

    async def abort_all(self) -> int:
        """Abort every request in flight (a shutdown past its drain timeout); returns how
        many were aborted."""
        ids = [f.request_id for f in self.flights.flights()]
        results = await asyncio.gather(*(self.abort(i) for i in ids), return_exceptions=True)
        return sum(1 for r in results if r is True)

    async def generate(
        self, req: PreparedRequest, flight: Flight | None = None
    ) -> AsyncIterator[ChoiceDelta]:
        """Run a prepared request; yield its choices' deltas as the scheduler sends them.

        Every choice ends with one delta carrying ``finish_reason`` and ``usage`` (ABORT,
        with no tokens, for a request aborted before it reached the scheduler). When the
        consumer stops iterating (``aclose``, cancellation: a client that went away) or an
        error ends the stream early, the request is aborted and its blocks freed before
        its id can be used again. A consumer that falls more than
        ``max_buffered_outputs`` outputs behind has its request aborted and gets
        :class:`ClientTooSlow`.

        Args:
            req: the prepared request.
            flight: its flight from :meth:`admit` (registered here when None); this call
                releases it.

        Raises:
            DuplicateRequest: the request id is in flight.
            ClientTooSlow: the consumer fell too far behind (RESOURCE_EXHAUSTED).
            ServingError: the scheduler's own errors (see pagedserve.scheduler.errors);
                ClusterUnavailable when the scheduler actor is gone or does not accept
                the request within ``scheduler_timeout_s``; a plain ServingError
                (INTERNAL) for anything unexpected.
        """
        sampling = req.sampling
        request_id = req.request_id
        if flight is None:
            flight = await self.flights.admit(request_id)
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer.backend_tokenizer,
                sampling.stop,
                include_stop_str=sampling.include_stop_str_in_output,
            )
            for _ in range(sampling.n)
        ]
        done = [False] * sampling.n
        ack: asyncio.Future[Any] | None = None
        ack_timed_out = scheduler_gone = False
        tag: int | None = None
        try:
            if flight.aborted:  # aborted while it was being validated and tokenized
                usage = Usage(len(req.prompt_token_ids), 0, 0)
                for i in range(sampling.n):
                    done[i] = True
                    yield ChoiceDelta(i, (), "", finish_reason=FinishReason.ABORT, usage=usage)
                return
            if not self.flights.scheduler_up:
                raise ClusterUnavailable("the scheduler is unavailable (restarting or gone)")
            buffer: asyncio.Queue[Any] = asyncio.Queue()
            tag = self.router.register(buffer, lambda: self._too_slow(request_id))
            flight.submitted = True  # from here on the request may reach the scheduler
            # The scheduler's reply to add_request acknowledges it.
            ack = asyncio.ensure_future(self._add(req, tag))
            await self._wait_ack(ack, flight)
            ack_timed_out = not ack.done()
            if flight.error is not None:
                raise flight.error
            if ack_timed_out:
                raise ClusterUnavailable(
                    f"the scheduler did not accept the request within "
                    f"{self.scheduler_timeout_s:g} s"
                )
            ack.result()  # its error, if add_request failed
            flight.added = True
            if flight.aborted:  # an abort came while the request was in transit
                await self.scheduler.abort.remote(request_id)
            flight.outputs = buffer  # FlightTable.fail_all puts its error here
            if flight.error is not None:
                buffer.put_nowait(flight.error)
            while not all(done):
                item = await buffer.get()
                if isinstance(item, BaseException):
                    raise item
                out: SequenceOutput = item
                if done[out.choice_index]:
                    continue
                delta = self._delta(out, detoks[out.choice_index], sampling)
                if delta.finish_reason is not None:
                    done[out.choice_index] = True
                    if out.finish_reason is None:  # a stop string ended the choice
                        await self.scheduler.abort.remote(request_id, out.choice_index, True)
                yield delta
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            err = self._serving_error(exc, request_id)
            scheduler_gone = isinstance(err, ClusterUnavailable)
            raise err from exc
        except ClusterUnavailable:
            scheduler_gone = not ack_timed_out  # a slow scheduler still gets the abort
            raise
        finally:
            if tag is not None:
                self.router.unregister(tag)
            try:
                # NOTE: no abort to a scheduler that is gone: a call to an actor Ray is
                # restarting waits for the restart, and the restarted one starts empty.
                if not all(done) and flight.submitted and not scheduler_gone:
                    # Consumer went away (cancelled / closed) or an error: make sure the
                    # blocks come back before the id can be used again (a scheduler that
                    # did not answer in time is not waited for twice).
                    aborting = asyncio.ensure_future(self._abort_when_added(ack, request_id))
                    self._background.add(aborting)
                    aborting.add_done_callback(self._background.discard)
                    if not ack_timed_out:
                        await asyncio.shield(aborting)
            except BaseException:  # best effort during shutdown or a second cancel
                log.debug("abort of %s failed", request_id, exc_info=True)
            finally:
                self.flights.release(flight)

    async def _wait_ack(self, ack: asyncio.Future[Any], flight: Flight) -> None:
        """Wait for the scheduler's acknowledgement, at most ``scheduler_timeout_s``, and
        no longer once the flight was failed (the scheduler died)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.scheduler_timeout_s
        while not ack.done() and flight.error is None:
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.wait({ack}, timeout=min(left, 0.05))

    async def _add(self, req: PreparedRequest, tag: int) -> None:
        """Send the request to the scheduler (subscribing first when needed)."""
        await self.router.ensure()
        await self.scheduler.add_request.remote(
            EngineRequest(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling=req.sampling,
                eos_token_ids=self.info.eos_token_ids,
                subscriber=self.router.subscriber,
                tag=tag,
            )
        )

    async def _abort_when_added(self, ack: asyncio.Future[Any] | None, request_id: str) -> None:
        """Abort a request once the scheduler has it (never before: the abort could
        overtake the request and find nothing); nothing when it never got there."""
        if ack is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(ack), self.scheduler_timeout_s)
        except Exception:  # refused, timed out, or the scheduler is gone
            return
        await asyncio.wait_for(self.scheduler.abort.remote(request_id), self.scheduler_timeout_s)

    def _too_slow(self, request_id: str) -> ClientTooSlow:
        """A request whose client fell more than ``max_buffered_outputs`` behind: abort it
        (in the background) and give its consumer the error."""
        log.warning("request %s aborted: its client stopped reading", request_id)
        aborting = asyncio.ensure_future(self._abort_quietly(request_id))
        self._background.add(aborting)
        aborting.add_done_callback(self._background.discard)
        return ClientTooSlow(
            f"the client is not reading the stream: more than {self.max_buffered_outputs} "
            "outputs are waiting to be sent; the request was aborted"
        )

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.wait_for(
                self.scheduler.abort.remote(request_id), self.scheduler_timeout_s
            )
        except Exception:  # the scheduler is gone: nothing left to free
            log.debug("abort of %s failed", request_id, exc_info=True)

    def _serving_error(self, exc: BaseException, request_id: str) -> ServingError:
        """The client-facing error of a Ray failure."""
        if isinstance(exc, ray.exceptions.RayActorError):
            log.warning("request %s: the scheduler actor failed: %s", request_id, exc)
            return ClusterUnavailable(
                f"scheduler unavailable: the scheduler actor died ({type(exc).__name__})"
            )
        cause = getattr(exc, "cause", exc)
        if isinstance(cause, ServingError):
            return cause
        log.error("request %s failed: %r", request_id, cause)
        return ServingError(f"generation failed: {cause!r}")

    @staticmethod
    def _delta(
        out: SequenceOutput, detok: IncrementalDetokenizer, sampling: SamplingParams
    ) -> ChoiceDelta:
        final = out.finish_reason is not None
        text_ids = out.new_token_ids
        if out.stop_reason is not None and not sampling.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # a stop token id ends the delta; its text is left out
        text = detok.step(text_ids, final=final)
        stop_reason: str | int | None = text.stop if text.stop is not None else out.stop_reason
        reason = FinishReason.STOP if text.stopped else out.finish_reason
        usage = None
        if reason is not None:
            usage = Usage(
                out.num_prompt_tokens,
                out.num_output_tokens,
                out.num_cached_tokens,
                out.num_preemptions,
            )
        return ChoiceDelta(
            index=out.choice_index,
            token_ids=tuple(out.new_token_ids),
            text=text.text,
            logprobs=tuple(out.logprobs),
            cumulative_logprob=out.cumulative_logprob,
            score=out.score,
            finish_reason=reason,
            stop_reason=stop_reason,
            usage=usage,
        )
