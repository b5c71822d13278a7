"""The one request path behind every transport (gRPC, the OpenAI-compatible HTTP API).

A transport turns its wire format into a :class:`GenerateInput` (the prompt) and a
:class:`SamplingRequest` (every sampling field, ``None`` = unset) and calls
:meth:`RequestPipeline.run`, its only entry, which does everything else in one place:

1. admission (:mod:`pagedserve.cluster.flights`): the id is registered as in flight before
   anything else, so an Abort at any later stage finds it; refused while draining or while
   the scheduler is down; a request whose Abort came first starts aborted;
2. preparation on a thread (:mod:`pagedserve.cluster.request_prep`): validation,
   tokenization, chat templating, the default ``max_tokens``, the KV-capacity check;
3. generation: the :class:`EngineRequest` to the scheduler, its outputs back through the
   frontend's one output stream (:mod:`pagedserve.cluster.output_router`), incremental
   detokenization and stop strings, as transport-neutral :class:`ChoiceDelta` items;
4. release: when the transport leaves the ``async with`` (finished, cancelled, failed),
   an unfinished request is aborted (its blocks freed) before its id is free again.

The transports only render the deltas (protobuf messages, or OpenAI JSON / Server-Sent
Events). Errors are :class:`~pagedserve.scheduler.errors.ServingError` subclasses; each
transport maps ``err.status`` to its own status with one lookup. Anything else escaping the
scheduler becomes a plain ``ServingError`` (status INTERNAL) naming the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from pagedserve.cluster.detokenizer import IncrementalDetokenizer
from pagedserve.cluster.flights import Flight, FlightConfig, FlightTable
from pagedserve.cluster.output_router import OutputRouter
from pagedserve.cluster.request_prep import (
    GenerateInput,
    ModelInfo,
    RequestPreparer,
    SamplingRequest,
)
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.errors import ClusterUnavailable, NoOutputStream, ServingError
from pagedserve.scheduler.outputs import SampleLogprobs
from pagedserve.scheduler.request import FinishReason

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class RequestStream:
    """One request inside :meth:`RequestPipeline.run`: iterate it for its deltas.

    Attributes:
        request: the prepared request (its id, prompt token ids, resolved sampling).
        deltas: the choices' deltas as the scheduler sends them (see :meth:`RequestPipeline.run`).
    """

    request: EngineRequest
    deltas: AsyncGenerator[ChoiceDelta, None]

    def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        return self.deltas


class RequestPipeline:
    """Admission, preparation, the scheduler call and detokenization for all transports.

    Args:
        scheduler: the SchedulerActor handle.
        tokenizer: a Hugging Face fast tokenizer of the served model.
        info: model and pool facts.
        max_buffered_outputs: most scheduler outputs held for one stream whose consumer
            has not taken them; past it the request is aborted (:class:`ClientTooSlow`).
        scheduler_timeout_s: how long a request waits for the scheduler to accept it
            before it fails with UNAVAILABLE (seconds).
        flight_config: id reuse wait and the memory of early aborts (None: the defaults)
            (:class:`~pagedserve.cluster.flights.FlightConfig`).
        output_transport: how the scheduler's outputs reach this frontend: ``"socket"``
            (its output channel) or ``"ray"`` (:class:`OutputRouter`).
    """

    def __init__(
        self,
        scheduler: Any,
        tokenizer: Any,
        info: ModelInfo,
        max_buffered_outputs: int = 4096,
        scheduler_timeout_s: float = 10.0,
        flight_config: FlightConfig | None = None,
        output_transport: str = "socket",
    ) -> None:
        if max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be >= 1, got {max_buffered_outputs}")
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.info = info
        self.max_buffered_outputs = max_buffered_outputs
        self.scheduler_timeout_s = scheduler_timeout_s
        self.preparer = RequestPreparer(tokenizer, info)
        self.flights = FlightTable(flight_config or FlightConfig())
        self.router = OutputRouter(
            scheduler, max_buffered_outputs, output_transport, min(3.0, scheduler_timeout_s / 3)
        )
        self._background: set[asyncio.Future[None]] = set()  # aborts still on their way

    @contextlib.asynccontextmanager
    async def run(
        self, prompt: GenerateInput, sampling: SamplingRequest, request_id: str = ""
    ) -> AsyncIterator[RequestStream]:
        """Admit and prepare a request; the :class:`RequestStream` yielded streams it.

        Entering admits the id (a new random one when empty) and prepares the request on a
        thread; iterating the stream sends it to the scheduler and yields its choices'
        deltas. Every choice ends with one delta carrying ``finish_reason`` and ``usage``
        (ABORT, with no tokens, for a request aborted before it reached the scheduler,
        an Abort that arrived before the request included). Leaving the block early
        (cancellation, an error, a client that went away) aborts the request and frees its
        blocks before its id can be used again. A consumer that falls more than
        ``max_buffered_outputs`` outputs behind has its request aborted and gets
        :class:`ClientTooSlow`.

        Raises:
            On entering: ClusterUnavailable (draining, or the scheduler is down),
            DuplicateRequest (the id stays in flight for ``id_reuse_wait_s``), and
            InvalidRequest / RequestRejected from
            :meth:`~pagedserve.cluster.request_prep.RequestPreparer.prepare`.
            While iterating: ClientTooSlow (RESOURCE_EXHAUSTED); the scheduler's own
            errors (see pagedserve.scheduler.errors); ClusterUnavailable when the
            scheduler actor is gone or does not accept the request within
            ``scheduler_timeout_s``; a plain ServingError (INTERNAL) for anything
            unexpected.
        """
        flight = await self.flights.admit(request_id or uuid.uuid4().hex)
        try:
            request = await asyncio.to_thread(
                self.preparer.prepare, prompt, sampling, flight.request_id
            )
            deltas = self._generate(request, flight)
            try:
                yield RequestStream(request, deltas)
            finally:
                await deltas.aclose()  # an unfinished request is aborted here
        finally:
            self.flights.release(flight)

    async def abort(self, request_id: str) -> bool:
        """Abort a request at whatever stage it is (not arrived yet, tokenizing, in transit
        to the scheduler, queued, running). Its stream ends with ABORT on every choice.

        An id not in flight is remembered for ``flight_config.abort_memory_s``: a request
        with it arriving in that time (its Generate overtaken by this Abort) ends at once
        with ABORT.

        Returns True when the request was in flight (not finished) and not aborted
        before, or when no request with the id was seen within ``abort_memory_s`` (it may
        still be on its way); False when it had finished or was aborted already.

        Raises:
            ClusterUnavailable: the scheduler actor is unreachable.
        """
        in_flight = request_id in self.flights
        flight = self.flights.mark_aborted(request_id)
        if flight is None:
            return not in_flight and not self.flights.recently_released(request_id)
        if flight.added:
            # NOTE: before the scheduler acknowledged the request, _generate() aborts it
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

    # ------------------------------------------------------------------ generation
    async def _generate(
        self, req: EngineRequest, flight: Flight
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """The deltas of a prepared request (see :meth:`run`); releases ``flight``."""
        sampling = req.sampling
        request_id = req.request_id
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
            if flight.aborted:  # while tokenizing, or by an Abort that arrived first
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
                delta = self._delta(out, detoks[out.choice_index])
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

    async def _add(self, req: EngineRequest, tag: int) -> None:
        """Send the request to the scheduler, on this frontend's output stream (subscribing
        first when needed, and again once when the scheduler no longer has the stream: it
        was restarted while the old connection looked open)."""
        for attempt in range(2):
            await self.router.ensure()
            subscription = self.router.subscription
            routed = dataclasses.replace(req, subscriber=self.router.subscriber, tag=tag)
            try:
                await self.scheduler.add_request.remote(routed)
                return
            except Exception as exc:
                lost = isinstance(exc, NoOutputStream) or isinstance(
                    getattr(exc, "cause", None), NoOutputStream
                )
                if attempt or not lost:
                    raise
                log.warning(
                    "the scheduler has no output stream of this frontend: subscribing again"
                )
                await self.router.reset(subscription)

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
    def _delta(out: SequenceOutput, detok: IncrementalDetokenizer) -> ChoiceDelta:
        text = detok.step_output(out)
        reason = text.finish_reason
        # NOTE: a stop string may end a speculative step's run of ids before its last:
        # the ids after it (and their logprobs) are dropped, as if never generated.
        kept = text.num_token_ids
        usage = None
        if reason is not None:
            usage = Usage(
                out.num_prompt_tokens,
                out.num_output_tokens - (len(out.new_token_ids) - kept),
                out.num_cached_tokens,
                out.num_preemptions,
            )
        return ChoiceDelta(
            index=out.choice_index,
            token_ids=tuple(out.new_token_ids[:kept]),
            text=text.text,
            logprobs=tuple(out.logprobs[:kept]),
            cumulative_logprob=out.cumulative_logprob,
            score=out.score,
            finish_reason=reason,
            stop_reason=text.stop_reason,
            usage=usage,
        )
