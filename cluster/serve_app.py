"""pagedserve as a Ray Serve application (for ``serve run``, ``serve deploy`` and KubeRay's
RayService).

One Serve deployment, :class:`PagedServeDeployment`, with one replica. Its constructor
starts the same cluster as ``pagedserve serve`` (:func:`~pagedserve.cluster.launcher.start_cluster`)
on the Ray cluster the replica runs in: the worker actors, the scheduler actor and the gRPC
frontend (Generation service, health, reflection) on ``--port`` of the replica's node. Its
HTTP routes (``/v1`` OpenAI-compatible API, ``/metrics``, ``/health``) are served by Ray
Serve's own HTTP proxy (``serve.ingress`` with the app built at replica start), so the
RayService's Kubernetes Service exposes them on Serve's port (8000). Serve's health check
calls :meth:`PagedServeDeployment.check_health` (:func:`replica_health`), which fails
whenever the gRPC health service says NOT_SERVING (draining, scheduler down), when the
scheduler does not answer, or when no worker is alive, so Serve restarts the replica (and
with it the cluster). When Serve stops the replica, it drains first as ``pagedserve serve``
does on SIGTERM (new requests UNAVAILABLE, health NOT_SERVING, up to ``--drain-timeout``
seconds, capped to fit Serve's ``graceful_shutdown_timeout_s``), then stops.

The application builder :func:`app` takes ``serve_args``, the ``pagedserve serve`` options
as one string (or a list)::

    serve run pagedserve.cluster.serve_app:app serve_args="--workers 2 --host 0.0.0.0"

or, in a Serve config file (deploy/serve_config.yaml, and serveConfigV2 of
deploy/kuberay/rayservice.yaml)::

    applications:
      - name: pagedserve
        import_path: pagedserve.cluster.serve_app:app
        args: {serve_args: "--workers 1 --host 0.0.0.0"}

``--http-port`` is ignored here (Serve's proxy owns HTTP). One replica only: the scheduler
actor is the single owner of block metadata; scale with ``--workers``, not replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shlex
from typing import Any

from ray import serve
from ray.serve import Application

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.launcher import ClusterHandle, build_http_app, start_cluster

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 45  # Serve's limit on the replica's shutdown (drain + stop)
_STOP_S = 15  # of which stopping the frontends and actors may take this long


async def replica_health(handle: ClusterHandle, timeout_s: float = 10.0) -> None:
    """Serve's health verdict on a replica's cluster; returns when healthy.

    Raises:
        RuntimeError: the replica drains or the scheduler is known down (the states in which
            the gRPC health service answers NOT_SERVING), or no worker is alive.
        TimeoutError: the scheduler does not answer within ``timeout_s`` seconds.
        ray.exceptions.RayActorError: the scheduler actor is dead.
    """
    flights = handle.pipeline.flights if handle.pipeline is not None else None
    if flights is not None and flights.draining:
        raise RuntimeError("pagedserve: draining (shutting down); not serving")
    if flights is not None and not flights.scheduler_up:
        raise RuntimeError("pagedserve: the scheduler is unavailable; not serving")
    live = await asyncio.wait_for(handle.scheduler.num_live_workers.remote(), timeout=timeout_s)
    if live <= 0:
        raise RuntimeError("pagedserve: no live worker")


def cluster_config_from_args(serve_args: str | list[str]) -> ClusterConfig:
    """The :class:`ClusterConfig` of ``pagedserve serve`` options inside a Serve replica:
    joins the replica's Ray cluster (``--address`` is ignored) and serves no HTTP of its own.

    Raises:
        SystemExit: the options do not parse (argparse prints why).
    """
    from pagedserve.cluster.cli import build_parser, serve_config

    argv = shlex.split(serve_args) if isinstance(serve_args, str) else list(serve_args)
    config = serve_config(build_parser().parse_args(["serve", *argv]))
    # Ray is already initialised in a replica; the launcher joins it (ray_address unused).
    server = dataclasses.replace(config.server, http_port=None)
    return dataclasses.replace(config, server=server, ray_address="auto")


@serve.deployment(
    num_replicas=1,
    # The replica only hosts the frontends; workers reserve their own CPUs / GPUs.
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1024,
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
)
@serve.ingress()
class PagedServeDeployment:
    """The pagedserve cluster inside one Serve replica.

    Args:
        serve_args: ``pagedserve serve`` options (a string split like a shell, or a list).

    Raises:
        ModelStoreError / ValueError / PortUnavailable / RuntimeError: as
        :func:`~pagedserve.cluster.launcher.start_cluster` (the replica fails to start and
        Serve reports it).
    """

    async def __init__(self, serve_args: str | list[str] = "") -> None:  # type: ignore[misc]
        self._config = cluster_config_from_args(serve_args)
        self._handle: ClusterHandle = await start_cluster(self._config)
        log.info("pagedserve replica: gRPC on %s", self._handle.address)

    async def __serve_build_asgi_app__(self) -> Any:
        """The FastAPI app of the HTTP frontend, bound to this replica's cluster."""
        assert self._handle.pipeline is not None
        return build_http_app(self._config, self._handle.pipeline)

    async def check_health(self) -> None:
        """Serve's health check (:func:`replica_health`): raises while draining, while the
        scheduler is down or unreachable (10 s), or when no worker is alive."""
        await replica_health(self._handle)

    async def __del__(self) -> None:
        """When Serve tears the replica down: drain (``--drain-timeout``, capped to fit
        Serve's shutdown limit), then stop the frontends and the actors."""
        drain_s = min(self._config.server.drain_timeout_s, GRACEFUL_SHUTDOWN_S - _STOP_S)
        try:
            aborted = await self._handle.drain(drain_s)
            if aborted:
                log.warning("pagedserve replica: aborted %d request(s) still running", aborted)
        finally:
            await self._handle.stop()


def app(args: dict[str, Any]) -> Application:
    """Serve application builder (``import_path: pagedserve.cluster.serve_app:app``).

    Args:
        args: ``{"serve_args": "<pagedserve serve options>"}`` (string or list; optional).
    """
    unknown = set(args) - {"serve_args"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected serve_args")
    return PagedServeDeployment.bind(args.get("serve_args", ""))  # type: ignore[attr-defined]
