"""The worker's end of the step channel (:mod:`pagedserve.scheduler.step_channel`).

:class:`StepChannelServer` listens on one TCP port for one scheduler: the first connection
that sends the secret within 2 s (checked on an accept thread that ends with the channel's
listener) is handed to the worker's
:class:`~pagedserve.worker.model_thread.ModelThread`, which reads each
:class:`~pagedserve.scheduler.outputs.SchedulerOutput`, runs it and writes the answer,
between its other calls: one thread, no hand-off per step. A step sent while the previous
one runs waits in the socket's buffer. Each :meth:`StepChannelServer.open` makes a new port
and secret and ends the previous channel (a restarted scheduler opens its own); a reset of
the worker (:meth:`StepChannelServer.invalidate`) ends it too. Ray-free: the worker actor
passes the address to bind.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import pickle
import secrets
import socket
import threading
import time
from collections.abc import Callable

from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.step_channel import (
    ACK,
    ERR,
    HEADER,
    OK,
    SECRET_BYTES,
    StepChannelAddress,
    encode_frame,
    frame_length,
)
from pagedserve.worker.model_thread import ModelThread

log = logging.getLogger(__name__)

# A frame read or an answer written that stalls this long ends the channel (the scheduler
# then sees the worker as dead and the probe brings it back). A frame comes in one write
# (kilobytes for a decode step, up to a few hundred for a long prefill or prompt
# logprobs), so only a scheduler cut off mid-frame or not reading for this long stalls;
# kept under the scheduler's default reset timeout (10 s), so a reset queued behind such
# a read still runs in time.
FRAME_TIMEOUT_S = 8.0
# The whole secret must come within this (a peer trickling bytes cannot hold the accept).
HANDSHAKE_TIMEOUT_S = 2.0


def _recv_exact(conn: socket.socket, n: int, deadline_s: float | None = None) -> bytes | None:
    """``n`` bytes from ``conn``, or None when it ends first.

    Raises:
        TimeoutError: ``deadline_s`` seconds passed first (or the socket's own timeout).
    """
    end = None if deadline_s is None else time.monotonic() + deadline_s
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if end is not None:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n} bytes not received in {deadline_s} s")
            conn.settimeout(left)
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


class StepChannelServer:
    """Serves steps to one scheduler over TCP, on the worker's model thread.

    Args:
        execute: runs one step (``Worker.execute_model``), called on ``model_thread``; an
            exception it raises is answered as a failed step and the channel goes on.
        host: the address to listen on (the node's, so a scheduler on another node can
            connect; ``127.0.0.1`` in single-machine tests).
        model_thread: the thread that reads, runs and answers the steps.
        accept_timeout_s: how long an opened channel waits for its scheduler (seconds);
            then it closes.
    """

    def __init__(
        self,
        execute: Callable[[SchedulerOutput], RunnerOutput],
        host: str,
        model_thread: ModelThread,
        accept_timeout_s: float = 60.0,
    ) -> None:
        self._execute = execute
        self._host = host
        self._model_thread = model_thread
        self._accept_timeout_s = accept_timeout_s
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        # Bumped when the channel is opened, closed or invalidated: a connection of an
        # earlier generation is no longer read (its unread steps are dropped, unrun).
        self._generation = 0
        self.steps_run = 0  # steps run (answered, or the answer dropped)

    def open(self, host: str | None = None) -> StepChannelAddress:
        """End the current channel (if any) and listen on a new port of ``host`` (None:
        the constructor's) with a new secret.

        Raises:
            OSError: the address cannot be bound.
        """
        self.close()
        host = host or self._host
        secret = secrets.token_bytes(SECRET_BYTES)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(4)
            listener.settimeout(self._accept_timeout_s)
        except BaseException:
            listener.close()
            raise
        port = int(listener.getsockname()[1])
        with self._lock:
            self._listener = listener
            generation = self._generation
        threading.Thread(
            target=self._accept,
            args=(listener, secret, generation),
            name="pagedserve-step-accept",
            daemon=True,
        ).start()
        return StepChannelAddress(host, port, secret)

    def close(self) -> None:
        """Stop listening and end the connection (the scheduler's steps then raise
        WorkerDied); a step running finishes, its answer is dropped. Idempotent."""
        with self._lock:
            listener, conn = self._listener, self._conn
            self._listener = self._conn = None
            self._generation += 1
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            listener.close()
        if conn is not None:  # the model thread sees it end and closes it
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def invalidate(self) -> None:
        """End the channel without reading the steps it holds (the worker was reset:
        they belong to the scheduler's previous view)."""
        self.close()

    @property
    def connected(self) -> bool:
        """True while a scheduler is connected."""
        return self._conn is not None

    def _accept(self, listener: socket.socket, secret: bytes, generation: int) -> None:
        """On the accept thread: the first connection that sends ``secret`` (others are
        closed) goes to the model thread; the listener is closed either way."""
        try:
            while True:
                try:
                    conn, peer = listener.accept()
                except (TimeoutError, OSError):
                    return
                try:
                    got = _recv_exact(conn, SECRET_BYTES, deadline_s=HANDSHAKE_TIMEOUT_S)
                    if got is not None and hmac.compare_digest(got, secret):
                        conn.sendall(ACK)
                        conn.settimeout(FRAME_TIMEOUT_S)  # no stall holds the model thread
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        self._model_thread.submit(functools.partial(self._attach, conn, generation))
                        return
                except (OSError, RuntimeError):
                    pass
                log.warning("step channel: refused a connection from %s", peer)
                conn.close()
        finally:
            with self._lock:
                if self._listener is listener:
                    self._listener = None
            listener.close()

    def _attach(self, conn: socket.socket, generation: int) -> None:
        """On the model thread: serve ``conn`` unless the channel moved on meanwhile."""
        with self._lock:
            current = generation == self._generation
            if current:
                self._conn = conn
        if not current:
            conn.close()
            return
        self._model_thread.watch(conn, functools.partial(self._step, conn, generation))

    def _step(self, conn: socket.socket, generation: int) -> bool:
        """On the model thread, ``conn`` readable: read one step, run it, write its
        answer. False (stop watching; the connection closed) at its end, on a corrupt
        stream, or once the channel moved on."""
        try:
            if generation != self._generation:
                return self._end(conn)
            header = _recv_exact(conn, HEADER.size)
            body = None if header is None else _recv_exact(conn, frame_length(header))
            if body is None:
                return self._end(conn)
            sched_out = pickle.loads(body)
        except Exception as exc:  # a corrupt stream (or a reset connection)
            log.warning("step channel ended: %s: %s", type(exc).__name__, exc)
            return self._end(conn)
        try:
            frame = encode_frame((OK, self._execute(sched_out)))
        except Exception as exc:
            log.exception("step %s failed", getattr(sched_out, "step_id", "?"))
            frame = encode_frame((ERR, f"{type(exc).__name__}: {exc}"))
        self.steps_run += 1
        try:
            conn.sendall(frame)
        except OSError as exc:
            log.info("step %s: answer dropped, the channel ended (%s)", sched_out.step_id, exc)
            return self._end(conn)
        return True

    def _end(self, conn: socket.socket) -> bool:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        conn.close()
        return False


__all__ = ["StepChannelServer"]
