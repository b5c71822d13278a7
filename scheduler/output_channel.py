"""The output channel: the scheduler's outputs to one frontend over one TCP connection.

Every step, the scheduler actor sends each frontend one batch of ``(tag, SequenceOutput)``
for that frontend's requests. As a Ray streaming generator that batch costs a couple of
milliseconds of CPU across the two processes' Ray threads (the item's object, its
report, the reader's wake-ups), taken, on a CPU node, from the cores the worker's model
runs on, at every step. vLLM's engine core hands its outputs to the API server over a ZMQ
socket for the same reason; here the frontend listens on one TCP port
(:class:`OutputChannelListener`, on 127.0.0.1 when the scheduler shares its node, else on
its node's address), hands the address and a fresh secret to the scheduler through an
authenticated Ray call (``SchedulerActor.attach_output_channel``), and the scheduler
connects (:class:`OutputChannelSender`) and writes one frame per batch.

Wire format: the scheduler sends the 32-byte secret, the frontend answers :data:`ACK`,
then the scheduler writes frames (8-byte big-endian length, pickle protocol 5, as on the
step channel, :mod:`pagedserve.scheduler.step_channel`) of ``list[tuple[int,
SequenceOutput]]``. The frontend unpickles only after the secret matched (compared in
constant time), and the scheduler reads nothing from the frontend but the ACK and the end
of the connection, which is how each side learns the other went away: the frontend's
requests fail with UNAVAILABLE, the scheduler aborts the requests of a frontend gone. The
traffic is as private as Ray's own between the nodes (plaintext; keep the cluster on a
private network).

This module imports neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import socket
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pagedserve.scheduler.step_channel import (
    HEADER,
    SECRET_BYTES,
    StepChannelAddress,
    connect_channel,
    encode_frame,
    frame_length,
)

log = logging.getLogger(__name__)

ACK = b"pagedserve-output-channel-1"
# The whole secret must come within this after a connection opens.
HANDSHAKE_TIMEOUT_S = 2.0

OutputBatch = list[tuple[int, Any]]  # (tag, SequenceOutput)


# TCP keepalive on both ends (a peer whose node vanished sends no FIN): probes after 10 s
# idle, every 5 s, 3 unanswered end the connection; unacknowledged data ends it after 30 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
USER_TIMEOUT_MS = 30_000


def _tune(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY and keepalive on the connection (where the platform has them)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    options = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    ]
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


class OutputChannelListener:
    """The frontend's end, before the scheduler connects: one listening port, one secret.

    Create with :meth:`open` on the event loop that reads; pass :attr:`address` to the
    scheduler; :meth:`accept` returns the first connection that sends the secret (others
    are closed) and stops listening.
    """

    def __init__(self, server: asyncio.AbstractServer, address: StepChannelAddress) -> None:
        self._server = server
        self.address = address
        self._accepted: asyncio.Future[OutputChannelReader] = (
            asyncio.get_running_loop().create_future()
        )
        self._claimed = False

    @classmethod
    async def open(cls, host: str = "127.0.0.1") -> OutputChannelListener:
        """Listen on a free port of ``host`` with a new secret.

        Raises:
            OSError: ``host`` cannot be bound.
        """
        secret = secrets.token_bytes(SECRET_BYTES)
        holder: list[OutputChannelListener] = []

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await holder[0]._handshake(reader, writer, secret)

        server = await asyncio.start_server(on_connect, host, 0, backlog=4)
        port = int(server.sockets[0].getsockname()[1])
        listener = cls(server, StepChannelAddress(host, port, secret))
        holder.append(listener)
        return listener

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes
    ) -> None:
        peer = writer.get_extra_info("peername")
        try:
            got = await asyncio.wait_for(reader.readexactly(SECRET_BYTES), HANDSHAKE_TIMEOUT_S)
            ok = hmac.compare_digest(got, secret) and not self._accepted.done()
        except (asyncio.IncompleteReadError, TimeoutError, OSError):
            ok = False
        if not ok:
            log.warning("output channel: refused a connection from %s", peer)
            writer.close()
            return
        writer.write(ACK)
        _tune(writer)
        self._accepted.set_result(OutputChannelReader(reader, writer))
        self._server.close()  # one scheduler per channel: stop listening

    async def accept(self, timeout_s: float) -> OutputChannelReader:
        """The scheduler's connection, once it sent the secret (the caller owns it).

        Raises:
            TimeoutError: none within ``timeout_s`` seconds (the listener is closed).
        """
        try:
            async with asyncio.timeout(timeout_s):
                reader = await asyncio.shield(self._accepted)
        except BaseException:
            self.close()
            raise
        self._claimed = True
        return reader

    def close(self) -> None:
        """Stop listening; a connection accepted but not returned by :meth:`accept` is
        closed (one returned stays open). Idempotent."""
        self._server.close()
        if not self._accepted.done():
            self._accepted.cancel()
        elif not self._accepted.cancelled() and not self._claimed:
            self._accepted.result().close()


class OutputChannelReader:
    """The frontend's end of an open output channel: :meth:`batches` yields what the
    scheduler sends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def batches(self) -> AsyncGenerator[OutputBatch, None]:
        """Each batch the scheduler sent, in order.

        Raises:
            ConnectionError: the connection ended (the scheduler closed it or died) or
                carried a corrupt frame; the connection is closed.
        """
        reader = self._reader
        try:
            while True:
                header = await reader.readexactly(HEADER.size)
                body = await reader.readexactly(frame_length(header))
                yield pickle.loads(body)
        except asyncio.IncompleteReadError:
            raise ConnectionError("connection ended") from None
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.close()

    def close(self) -> None:
        """End the connection (the scheduler then aborts this frontend's requests)."""
        self._writer.close()


class OutputChannelSender:
    """The scheduler's end: writes batches to one frontend and notices its end.

    Create with :meth:`connect` on the event loop that sends. ``on_close`` is called once
    (on that loop) when the connection ends, whichever side ended it.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_close: Callable[[], None],
    ) -> None:
        self._writer = writer
        self._on_close = on_close
        self._closed = False
        self._watch = asyncio.get_running_loop().create_task(self._wait_end(reader))

    @classmethod
    async def connect(
        cls,
        address: StepChannelAddress,
        timeout_s: float,
        on_close: Callable[[], None] = lambda: None,
    ) -> OutputChannelSender:
        """Connect to a frontend's listener and pass its handshake.

        Raises:
            ConnectionError: the frontend closed without acknowledging (a wrong secret).
            TimeoutError: no connection or acknowledgement within ``timeout_s`` seconds.
            OSError: the address cannot be reached.
        """
        reader, writer = await connect_channel(address, ACK, timeout_s, "output channel", _tune)
        return cls(reader, writer, on_close)

    @property
    def closed(self) -> bool:
        """True once the connection has ended."""
        return self._closed

    async def send(self, batch: OutputBatch) -> None:
        """Write one batch; returns once the socket's buffer is below its high-water mark
        (outputs queued meanwhile go out as one batch next).

        Raises:
            ConnectionError: the connection has ended.
            ValueError / pickle.PicklingError: the batch cannot be framed.
        """
        if self._closed:
            raise ConnectionError("output channel closed")
        self._writer.write(encode_frame(batch))
        await self._writer.drain()

    async def close(self) -> None:
        """End the connection (idempotent); ``on_close`` runs."""
        self._end()
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._watch

    async def _wait_end(self, reader: asyncio.StreamReader) -> None:
        # The frontend sends nothing after the ACK: any byte or the end closes the channel.
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await reader.read(1)
        self._end()

    def _end(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._on_close()


__all__ = [
    "ACK",
    "HANDSHAKE_TIMEOUT_S",
    "OutputBatch",
    "OutputChannelListener",
    "OutputChannelReader",
    "OutputChannelSender",
]
