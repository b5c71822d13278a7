"""The HTTP frontend: one ASGI app (FastAPI) served by uvicorn in the frontend's event loop.

Routes: ``GET /metrics`` (Prometheus text format, :mod:`pagedserve.cluster.metrics`),
``GET /health`` (200 while a worker is alive, 503 otherwise), ``GET /openapi.json`` (the
OpenAPI schema of the routes), and the routers passed to :func:`create_app` (the
OpenAI-compatible API, :mod:`pagedserve.cluster.openai_api`); gRPC stays on its own port
next to it.

uvicorn runs as a task of the running loop (no thread, no process); its own signal handling
is switched off because the launcher owns SIGINT / SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse, Response

from pagedserve.cluster.metrics import CONTENT_TYPE, MetricsExporter

log = logging.getLogger(__name__)


def create_app(
    scheduler: Any,
    exporter: MetricsExporter,
    health_timeout_s: float = 5.0,
    routers: Sequence[APIRouter] = (),
    serving: Callable[[], bool] | None = None,
    exception_handlers: Mapping[Any, Callable[..., Any]] | None = None,
    openapi_components: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The ASGI app with ``/metrics``, ``/health`` and ``routers``.

    Args:
        scheduler: the SchedulerActor handle (``num_live_workers`` for /health).
        exporter: renders /metrics from the scheduler's snapshot.
        health_timeout_s: how long /health waits for the scheduler, seconds.
        routers: more routes (e.g. ``OpenAIServer.router()``).
        serving: False while the frontend admits no requests (draining, scheduler
            down): /health answers 503 then.
        exception_handlers: the app's handlers by exception class or status code (e.g.
            the OpenAI error shape for unknown routes,
            ``{HTTPException: openai_api.http_error_handler}``).
        openapi_components: schemas the routers' documentation refers to
            (``#/components/schemas/NAME``), added to ``/openapi.json``.
    """
    app = FastAPI(
        title="pagedserve",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        exception_handlers=dict(exception_handlers or {}),
    )
    for router in routers:
        app.include_router(router)
    components = dict(openapi_components or {})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    unavailable: dict[int | str, dict[str, Any]] = {
        503: {"description": "the scheduler is unavailable"}
    }

    @app.get("/metrics", responses=unavailable)
    async def metrics() -> Response:
        try:
            body = await exporter.render()
        except Exception as exc:  # scheduler gone or stuck: say so, do not 500
            log.warning("metrics scrape failed: %r", exc)
            return PlainTextResponse(f"scheduler unavailable: {exc!r}\n", status_code=503)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/health", responses=unavailable)
    async def health() -> Response:
        if serving is not None and not serving():
            return PlainTextResponse("not serving (shutting down or restarting)\n", 503)
        try:
            live = await asyncio.wait_for(
                scheduler.num_live_workers.remote(), timeout=health_timeout_s
            )
        except Exception as exc:
            return PlainTextResponse(f"scheduler unavailable: {exc!r}\n", status_code=503)
        if live <= 0:
            return PlainTextResponse("no live worker\n", status_code=503)
        return PlainTextResponse("ok\n")

    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers (the launcher's loop handles the signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (0 picks a free port).

    Raises:
        OSError: the address cannot be bound (in use, or not a local interface).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR only skips TIME_WAIT leftovers; a live listener still refuses the bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """Serves an ASGI app on ``host:port`` from the running event loop.

    Args:
        app: the ASGI app (see :func:`create_app`).
        host: interface to bind.
        port: TCP port; 0 picks a free one (see :attr:`port` after :meth:`start`).
        ssl_options: ``uvicorn.Config`` TLS arguments (``ssl_certfile``, ``ssl_keyfile``,
            ``ssl_ca_certs``, ``ssl_cert_reqs``; see ``pagedserve.cluster.auth``); empty =
            plain HTTP.
    """

    def __init__(
        self, app: Any, host: str, port: int, ssl_options: dict[str, Any] | None = None
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.ssl_options = dict(ssl_options or {})
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 10.0) -> int:
        """Bind and start serving; returns the bound port.

        Raises:
            OSError: the port cannot be bound.
            RuntimeError: uvicorn did not start within ``timeout_s`` seconds.
        """
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # leave the process's logging setup alone
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            **self.ssl_options,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._task.done() or asyncio.get_running_loop().time() > deadline:
                sock.close()
                await self.stop()
                raise RuntimeError(f"HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then return."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        except Exception:
            log.debug("HTTP server ended with an error", exc_info=True)
        self._server = None
        self._task = None
