"""The step channel: scheduler outputs to a worker and its answers over one TCP connection.

A Ray actor call costs about a millisecond of CPU on each side (task submission, gRPC,
the reply object), and the worker sits idle between two steps while Ray hands it the
next task. On a CPU node those milliseconds come out of the cores the model runs on, at
every step. As vLLM's workers take their steps from a message queue and SGLang's from a
ZMQ socket, a worker here serves one connection (:mod:`pagedserve.worker.step_channel`)
and the scheduler keeps it open (:class:`StepChannelClient`): each step is one pickled
frame each way; the worker's model thread waits in ``select`` for the next one and starts
it as soon as the previous answer is written. Ray still creates, places, probes and restarts
the workers, and carries every other call.

Wire format, each direction: frames of an 8-byte big-endian length then that many bytes
of pickle (protocol 5). The connection starts with the client sending the channel's
32-byte secret (given by the worker through an authenticated Ray call) and the worker
answering :data:`ACK`; nothing is unpickled before that. Requests are
:class:`~pagedserve.scheduler.outputs.SchedulerOutput`; answers are ``(OK, RunnerOutput)``
or ``(ERR, "Type: message")``, in the order of the requests. The traffic is as private as
Ray's own between the nodes (plaintext; keep the cluster on a private network).

This module imports neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.scheduler.engine_loop import WorkerDied
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

HEADER = struct.Struct(">Q")
SECRET_BYTES = 32
ACK = b"pagedserve-step-channel-1"
OK = 0
ERR = 1
# A frame longer than this ends the connection (a step is kilobytes; a corrupt length
# must not make either side allocate gigabytes).
MAX_FRAME_BYTES = 256 << 20
PICKLE_PROTOCOL = 5


class StepFailed(RuntimeError):
    """The worker raised while running a step (its message: ``"Type: message"``); the
    worker and the channel stay up."""


@dataclass(frozen=True)
class StepChannelAddress:
    """Where a worker's step channel listens, and the secret it accepts.

    Attributes:
        host: IP address to connect to.
        port: TCP port.
        secret: the 32 bytes the client sends first (not printed).
    """

    host: str
    port: int
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(self.secret)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")


def encode_frame(obj: object) -> bytes:
    """One frame: the length header and ``obj`` pickled.

    Raises:
        ValueError: the pickle is longer than :data:`MAX_FRAME_BYTES`.
        pickle.PicklingError / TypeError: ``obj`` cannot be pickled.
    """
    body = pickle.dumps(obj, protocol=PICKLE_PROTOCOL)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame header announces.

    Raises:
        ConnectionError: a length over :data:`MAX_FRAME_BYTES` (the stream is corrupt).
    """
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return int(n)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def connect_channel(
    address: StepChannelAddress,
    ack: bytes,
    timeout_s: float,
    what: str,
    tune: Callable[[asyncio.StreamWriter], None] = _nodelay,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a channel's listener at ``address``, ``tune`` the socket, send the secret
    and check the listener's acknowledgement ``ack`` (the step and output channels'
    handshake; ``what`` names the channel in errors).

    Raises:
        ConnectionError: the listener closed without acknowledging (a wrong secret) or
            answered something else.
        TimeoutError: no connection or acknowledgement within ``timeout_s`` seconds.
        OSError: the address cannot be reached.
    """
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(address.host, address.port), timeout_s
    )
    try:
        tune(writer)
        writer.write(address.secret)
        got = await asyncio.wait_for(reader.readexactly(len(ack)), timeout_s)
    except asyncio.IncompleteReadError:
        writer.close()
        raise ConnectionError(
            f"{what} {address.host}:{address.port} closed at the handshake"
        ) from None
    except BaseException:
        writer.close()
        raise
    if got != ack:
        writer.close()
        raise ConnectionError(f"{what} {address.host}:{address.port} refused")
    return reader, writer


class StepChannelClient:
    """The scheduler's end of one worker's step channel: a
    :class:`~pagedserve.scheduler.engine_loop.WorkerHandle`.

    :meth:`execute` writes the step at once and returns a future of its answer; answers
    come back in order. When the connection ends (the worker's process died, or its end
    closed), every unanswered future and every later :meth:`execute` raises
    :class:`WorkerDied`; a step the worker raised on raises :class:`StepFailed`.
    Create with :meth:`connect`, on the event loop that will use it.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.name = name
        self._pending: deque[asyncio.Future[RunnerOutput]] = deque()
        self._closed: str | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_answers())

    @classmethod
    async def connect(
        cls, address: StepChannelAddress, timeout_s: float = 10.0, name: str = "worker"
    ) -> StepChannelClient:
        """Open the channel at ``address`` and pass its handshake.

        Raises:
            ConnectionError: refused, or the worker closed without acknowledging the secret
                (a wrong secret).
            TimeoutError: no connection or acknowledgement within ``timeout_s`` seconds.
            OSError: the address cannot be reached.
        """
        reader, writer = await connect_channel(address, ACK, timeout_s, "step channel")
        return cls(reader, writer, name)

    @property
    def closed(self) -> bool:
        """True once the connection has ended (every step then raises WorkerDied)."""
        return self._closed is not None

    def execute(self, sched_out: SchedulerOutput) -> asyncio.Future[RunnerOutput]:
        """Send one step now; the future gives its answer.

        Raises (from the future):
            WorkerDied: the connection ended before the answer.
            StepFailed: the worker raised on the step.
        """
        answer: asyncio.Future[RunnerOutput] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            answer.set_exception(WorkerDied(self._closed))
            return answer
        try:
            frame = encode_frame(sched_out)
        except Exception as exc:  # a step that cannot be sent fails alone
            answer.set_exception(StepFailed(f"{type(exc).__name__}: {exc}"))
            return answer
        self._pending.append(answer)
        self._writer.write(frame)
        return answer

    async def close(self) -> None:
        """End the connection; unanswered steps raise WorkerDied (idempotent)."""
        self._fail(f"{self.name}: step channel closed")
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    async def _read_answers(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(HEADER.size)
                body = await self._reader.readexactly(frame_length(header))
                kind, value = pickle.loads(body)
                if not self._pending:
                    raise ConnectionError("an answer came for no step")
                answer = self._pending.popleft()
                if answer.done():
                    continue  # cancelled by its awaiter
                if kind == OK:
                    answer.set_result(value)
                else:
                    answer.set_exception(StepFailed(str(value)))
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._fail(f"{self.name}: step channel lost ({type(exc).__name__}: {exc})")
        except Exception as exc:  # a corrupt stream: the channel cannot go on
            log.exception("%s: step channel broken", self.name)
            self._fail(f"{self.name}: step channel broken ({type(exc).__name__}: {exc})")

    def _fail(self, why: str) -> None:
        if self._closed is None:
            self._closed = why
        while self._pending:
            answer = self._pending.popleft()
            if not answer.done():
                answer.set_exception(WorkerDied(why))
        self._writer.close()


__all__ = [
    "ACK",
    "ERR",
    "HEADER",
    "MAX_FRAME_BYTES",
    "OK",
    "SECRET_BYTES",
    "StepChannelAddress",
    "StepChannelClient",
    "StepFailed",
    "connect_channel",
    "encode_frame",
    "frame_length",
]
