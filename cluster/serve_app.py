"""pagedserve as a Ray Serve application (for ``serve run``, ``serve deploy`` and KubeRay's
RayService).

Two Serve deployments:

- :class:`PagedServeCluster`, one replica: its constructor starts the same cluster as
  ``pagedserve serve`` (:func:`~pagedserve.cluster.launcher.start_cluster`) on the Ray cluster
  the replica runs in: the worker actors, the scheduler actor (named by ``--cluster-name``,
  default ``default``) and the gRPC frontend (Generation service, health, reflection) on
  ``--port`` of the replica's node. One replica only: the scheduler actor is the single owner
  of block metadata; scale the model with ``--workers``.
- :class:`PagedServeDeployment`, the HTTP ingress, any number of replicas: each attaches to
  that scheduler by name (:func:`~pagedserve.cluster.launcher.find_cluster`, as ``serve
  --attach`` does) and serves the HTTP routes (``/v1`` OpenAI-compatible API, ``/metrics``,
  ``/health``) through Ray Serve's own HTTP proxy (``serve.ingress``), which spreads requests
  over the replicas; each replica has its own output stream and request pipeline, so the
  Python work of streaming (detokenizing, JSON, SSE) scales with ``num_replicas``.

Serve's health checks (:func:`replica_health`) fail whenever the frontend refuses requests
(draining, scheduler down), the scheduler does not answer, or no worker is alive; a frontend
replica's also fails once its cluster is gone for good (the cluster replica was replaced:
the frontend then attaches to the new one when Serve restarts it). Serve then restarts the
replica. When Serve stops a replica it drains first as ``pagedserve serve`` does on SIGTERM
(new requests UNAVAILABLE, up to ``--drain-timeout`` seconds, capped to fit Serve's
``graceful_shutdown_timeout_s``), then stops (the cluster replica: the actors too).

The application builder :func:`app` takes ``serve_args``, the ``pagedserve serve`` options
as one string (or a list)::

    serve run pagedserve.cluster.serve_app:app serve_args="--workers 2 --host 0.0.0.0"

or, in a Serve config file (deploy/serve_config.yaml, and serveConfigV2 of
deploy/kuberay/rayservice.yaml), with the frontends' replica count there::

    applications:
      - name: pagedserve
        import_path: pagedserve.cluster.serve_app:app
        args: {serve_args: "--workers 1 --host 0.0.0.0"}
        deployments:
          - {name: PagedServeDeployment, num_replicas: 2}

``--http-port`` is ignored here (Serve's proxy owns HTTP).
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
from pagedserve.cluster.flights import watch_scheduler
from pagedserve.cluster.launcher import ClusterHandle, build_http_app, find_cluster, start_cluster
from pagedserve.cluster.pipeline import RequestPipeline

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 45  # Serve's limit on the replica's shutdown (drain + stop)
_STOP_S = 15  # of which stopping the frontends and actors may take this long
ATTACH_WAIT_S = 600.0  # how long a frontend replica waits for the cluster's scheduler


async def replica_health(handle: ClusterHandle, timeout_s: float = 10.0) -> None:
    """Serve's health verdict on a replica's cluster; returns when healthy (as
    :func:`frontend_health` over the handle's scheduler and pipeline)."""
    await frontend_health(handle.scheduler, handle.pipeline, timeout_s)


async def frontend_health(
    scheduler: Any, pipeline: RequestPipeline | None, timeout_s: float = 10.0
) -> None:
    """Serve's health verdict on a frontend (``pipeline`` over ``scheduler``); returns
    when healthy.

    Raises:
        RuntimeError: the frontend drains or the scheduler is known down (the states in
            which the gRPC health service answers NOT_SERVING), or no worker is alive.
        TimeoutError: the scheduler does not answer within ``timeout_s`` seconds.
        ray.exceptions.RayActorError: the scheduler actor is dead.
    """
    flights = pipeline.flights if pipeline is not None else None
    if flights is not None and flights.draining:
        raise RuntimeError("pagedserve: draining (shutting down); not serving")
    if flights is not None and not flights.scheduler_up:
        raise RuntimeError("pagedserve: the scheduler is unavailable; not serving")
    live = await asyncio.wait_for(scheduler.num_live_workers.remote(), timeout=timeout_s)
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
    # The replica only hosts the scheduler's frontend; workers reserve their own CPUs / GPUs.
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
)
class PagedServeCluster:
    """The pagedserve cluster (workers, named scheduler, gRPC frontend) in one Serve replica.

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
        log.info("pagedserve cluster replica: gRPC on %s", self._handle.address)

    async def cluster_name(self) -> str:
        """The name the frontend replicas attach by (``--cluster-name``)."""
        return str(self._config.cluster_name)

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


@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1024,
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
)
@serve.ingress()
class PagedServeDeployment:
    """One HTTP frontend replica of the cluster that :class:`PagedServeCluster` runs.

    Args:
        cluster: the cluster deployment's handle (Serve passes it when the app is bound).
        serve_args: the same ``pagedserve serve`` options (the server settings: API key,
            served model name, body and stream limits; ``--cluster-name``).

    Raises:
        RuntimeError: the cluster's scheduler did not appear within 600 s.
    """

    async def __init__(  # type: ignore[misc]
        self, cluster: Any, serve_args: str | list[str] = ""
    ) -> None:
        config = cluster_config_from_args(serve_args)
        name = await cluster.cluster_name.remote()
        self._config = dataclasses.replace(config, cluster_name=name)
        self._scheduler, info, tokenizer = await find_cluster(self._config, ATTACH_WAIT_S)
        server = self._config.server
        self._pipeline = RequestPipeline(
            self._scheduler,
            tokenizer,
            info,
            max_buffered_outputs=server.max_stream_buffer,
            output_transport=server.output_transport,
        )
        self._watch = asyncio.get_running_loop().create_task(
            watch_scheduler(self._scheduler, self._pipeline.flights)
        )
        log.info("pagedserve frontend replica: attached to cluster %r", name)

    async def __serve_build_asgi_app__(self) -> Any:
        """The FastAPI app of this replica's HTTP frontend."""
        return build_http_app(self._config, self._pipeline)

    async def check_health(self) -> None:
        """Serve's health check: :func:`frontend_health`, and unhealthy once the cluster is
        gone for good (Serve restarts the replica, which attaches to the new cluster)."""
        if self._watch.done():
            raise RuntimeError("pagedserve: the cluster is gone; this frontend must restart")
        await frontend_health(self._scheduler, self._pipeline)

    async def __del__(self) -> None:
        """When Serve tears the replica down: drain its own requests (capped to fit
        Serve's shutdown limit), then close its output stream (the cluster goes on)."""
        drain_s = min(self._config.server.drain_timeout_s, GRACEFUL_SHUTDOWN_S - _STOP_S)
        flights = self._pipeline.flights
        try:
            flights.begin_drain()
            await flights.wait_idle(drain_s)
            if len(flights):
                aborted = await self._pipeline.abort_all()
                log.warning("pagedserve frontend: aborted %d request(s) still running", aborted)
                await flights.wait_idle(2.0)
        finally:
            self._watch.cancel()
            await self._pipeline.router.close()


def app(args: dict[str, Any]) -> Application:
    """Serve application builder (``import_path: pagedserve.cluster.serve_app:app``).

    Args:
        args: ``{"serve_args": "<pagedserve serve options>"}`` (string or list; optional).
    """
    unknown = set(args) - {"serve_args"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected serve_args")
    serve_args = args.get("serve_args", "")
    cluster = PagedServeCluster.bind(serve_args)  # type: ignore[attr-defined]
    return PagedServeDeployment.bind(cluster, serve_args)  # type: ignore[attr-defined]
