"""The worker's end of the step channel (:mod:`pagedserve.scheduler.step_channel`).

:class:`StepChannelServer` listens on one TCP port for one scheduler: the first connection
that sends the secret is served until it ends. A thread of its own reads each
:class:`~pagedserve.scheduler.outputs.SchedulerOutput` and hands it to ``run_on`` (the
worker's model thread), which runs the step and writes its answer; the reader goes back to
``recv`` at once, so a step sent while the previous one runs (overlapped scheduling) is
queued on the model thread before that one ends and starts without a thread switch. Each
:meth:`StepChannelServer.open` makes a new port and secret and ends the previous channel
(a restarted scheduler opens its own). Ray-free: the worker actor passes the address to
bind.
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

log = logging.getLogger(__name__)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``conn``, or None when it ends first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


class StepChannelServer:
    """Serves steps to one scheduler over TCP.

    Args:
        execute: runs one step (``Worker.execute_model``); an exception it raises is
            answered as a failed step and the channel goes on.
        host: the address to listen on (the node's, so a scheduler on another node can
            connect; ``127.0.0.1`` in single-machine tests).
        accept_timeout_s: how long an opened channel waits for its scheduler (seconds);
            then it closes.
        run_on: queues a job (run the step, write its answer) on the thread that runs the
            steps, in order (``ModelThread.submit``); None: run it on the reading thread.
    """

    def __init__(
        self,
        execute: Callable[[SchedulerOutput], RunnerOutput],
        host: str,
        accept_timeout_s: float = 60.0,
        run_on: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._execute = execute
        self._run_on = run_on
        self._host = host
        self._accept_timeout_s = accept_timeout_s
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        # Bumped when the channel is opened, closed or invalidated: a step read before
        # that and still queued is dropped, not run.
        self._generation = 0
        self._thread: threading.Thread | None = None
        self.steps_run = 0  # steps run (answered, or the answer dropped)

    def open(self) -> StepChannelAddress:
        """End the current channel (if any) and listen on a new port with a new secret.

        Raises:
            OSError: the address cannot be bound.
        """
        self.close()
        generation = self._generation
        secret = secrets.token_bytes(SECRET_BYTES)
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self._host, 0))
            listener.listen(4)
            listener.settimeout(self._accept_timeout_s)
        except BaseException:
            listener.close()
            raise
        port = int(listener.getsockname()[1])
        thread = threading.Thread(
            target=self._serve,
            args=(listener, secret, generation),
            name="pagedserve-steps",
            daemon=True,
        )
        with self._lock:
            self._listener = listener
            self._thread = thread
        thread.start()
        return StepChannelAddress(self._host, port, secret)

    def close(self) -> None:
        """Stop listening and end the connection (the scheduler's steps then raise
        WorkerDied); a step running finishes, its answer is dropped. Idempotent."""
        with self._lock:
            listener, conn = self._listener, self._conn
            self._listener = self._conn = None
            self._generation += 1
        for sock in (listener, conn):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def invalidate(self) -> None:
        """Drop, unrun, every step read so far and not yet run (the worker's state was
        reset: they belong to the scheduler's previous view)."""
        with self._lock:
            self._generation += 1

    @property
    def connected(self) -> bool:
        """True while a scheduler is connected."""
        return self._conn is not None

    def _serve(self, listener: socket.socket, secret: bytes, generation: int) -> None:
        conn = self._accept(listener, secret)
        if conn is None:
            return
        try:
            self._serve_steps(conn, generation)
        except OSError as exc:
            log.info("step channel ended: %s", exc)
        except Exception:
            log.exception("step channel broken")
        finally:
            with self._lock:
                if self._conn is conn:
                    self._conn = None
            conn.close()

    def _accept(self, listener: socket.socket, secret: bytes) -> socket.socket | None:
        """The first connection that sends ``secret`` (others are closed), or None when
        none comes in time or the channel was closed; the listener is closed either way."""
        try:
            while True:
                try:
                    conn, peer = listener.accept()
                except (TimeoutError, OSError):
                    return None
                conn.settimeout(10.0)
                try:
                    got = _recv_exact(conn, SECRET_BYTES)
                    if got is not None and hmac.compare_digest(got, secret):
                        conn.sendall(ACK)
                        conn.settimeout(None)
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        with self._lock:
                            if self._listener is not listener:  # closed meanwhile
                                conn.close()
                                return None
                            self._conn = conn
                        return conn
                except OSError:
                    pass
                log.warning("step channel: refused a connection from %s", peer)
                conn.close()
        finally:
            with self._lock:
                if self._listener is listener:
                    self._listener = None
            listener.close()

    def _serve_steps(self, conn: socket.socket, generation: int) -> None:
        while True:
            header = _recv_exact(conn, HEADER.size)
            if header is None:
                return
            body = _recv_exact(conn, frame_length(header))
            if body is None:
                return
            sched_out = pickle.loads(body)
            if generation != self._generation:
                return  # this channel was closed or invalidated
            job = functools.partial(self._answer, conn, sched_out, generation)
            if self._run_on is None:
                job()
            else:
                self._run_on(job)

    def _answer(self, conn: socket.socket, sched_out: SchedulerOutput, generation: int) -> None:
        """Run one step and write its answer; a step of an earlier generation is dropped
        unrun, an answer to a closed connection is dropped."""
        if generation != self._generation:
            log.info(
                "step %s dropped: its channel ended or the worker was reset", sched_out.step_id
            )
            return
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


__all__ = ["StepChannelServer"]
