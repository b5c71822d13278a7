"""Bring a pagedserve cluster up and down: Ray, worker actors, scheduler actor, frontend.

Embedded mode (``ClusterConfig.ray_address is None``) starts a local Ray instance in the
driver (``ray.init(address="local")``) on loopback with token auth off (see ``RAY_ENV``);
otherwise the driver joins an existing cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.auth import (
    ApiKeyMiddleware,
    check_tls_files,
    exposure_warning,
    uvicorn_ssl_options,
)
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.flights import watch_scheduler
from pagedserve.cluster.frontend import GenerationServicer, check_port_free, start_server
from pagedserve.cluster.host_store import HostStoreActor, StoreKeys, cluster_store_keys
from pagedserve.cluster.http_server import HttpServer, create_app
from pagedserve.cluster.metrics import MetricsExporter
from pagedserve.cluster.openai_api import OpenAIServer
from pagedserve.cluster.pipeline import RequestPipeline
from pagedserve.cluster.request_prep import ModelInfo
from pagedserve.scheduler.scheduler import WorkerSpec
from pagedserve.scheduler.swap import SwapSpec

log = logging.getLogger(__name__)

# Environment for an embedded, loopback-only Ray: Ray advertises the interface address even
# when told 127.0.0.1 unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; 2.60 turns token auth on.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}


def init_ray(config: ClusterConfig) -> bool:
    """Start or join Ray. Returns True when this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    for key, value in RAY_ENV.items():
        # NOTE: the loopback switch only for the embedded cluster: a driver joining a
        # cluster must advertise the address its nodes reach it on.
        if config.ray_address is None or key != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER":
            os.environ.setdefault(key, value)
    if config.ray_address is None:
        cpus = max(os.cpu_count() or 1, config.num_workers * (config.cpus_per_worker or 1))
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=256 << 20,
            log_to_driver=True,
            configure_logging=False,
        )
    else:
        ray.init(address=config.ray_address, log_to_driver=True, configure_logging=False)
    return True


@dataclass
class ClusterHandle:
    """A running cluster (actors + frontend). Call :meth:`stop` when done."""

    config: ClusterConfig
    scheduler: Any
    workers: list[Any]
    server: Any
    port: int
    info: ModelInfo
    owns_ray: bool
    health_task: asyncio.Task[None] | None = None
    http: HttpServer | None = None
    pipeline: RequestPipeline | None = None
    servicer: GenerationServicer | None = None
    watch_task: asyncio.Task[None] | None = None
    host_store: Any = None

    @property
    def address(self) -> str:
        """``host:port`` of the gRPC frontend."""
        return f"{self.config.server.host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the HTTP frontend (/metrics, /health, /v1); None without one."""
        return None if self.http is None else f"{self.config.server.host}:{self.http.port}"

    async def drain(self, timeout_s: float, force: asyncio.Event | None = None) -> int:
        """Stop admitting (new requests: UNAVAILABLE; health: NOT_SERVING), let the
        requests in flight finish for up to ``timeout_s`` seconds (or until ``force`` is
        set), then abort the rest (their streams end with ABORT) and give them a moment
        to say so. Returns how many requests were aborted."""
        if self.pipeline is None:
            return 0
        flights = self.pipeline.flights
        flights.begin_drain()
        if self.servicer is not None:
            await self.servicer.set_not_serving()
        idle = asyncio.ensure_future(flights.wait_idle(timeout_s))
        waits: list[asyncio.Future[Any]] = [idle]
        if force is not None:
            waits.append(asyncio.ensure_future(force.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if not len(flights):
            return 0
        aborted = await self.pipeline.abort_all()
        await flights.wait_idle(2.0)
        return aborted

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop the frontend, abort requests, kill the actors and (if owned) Ray."""
        import ray

        if self.watch_task is not None:
            self.watch_task.cancel()
        if self.health_task is not None:
            self.health_task.cancel()
        if self.http is not None:
            await self.http.stop(grace_s)
        await self.server.stop(grace_s)
        if self.pipeline is not None:
            await self.pipeline.router.close()  # the output stream, before its actor goes
        try:
            await asyncio.wait_for(self.scheduler.shutdown.remote(), timeout=10)
        except Exception:
            log.debug("scheduler shutdown failed", exc_info=True)
        for actor in [self.scheduler, *self.workers]:
            ray.kill(actor)
        if self.host_store is not None:
            ray.kill(self.host_store)
        if self.owns_ray:
            ray.shutdown()


async def start_cluster(config: ClusterConfig) -> ClusterHandle:
    """Resolve the model, start Ray, the actors and the gRPC frontend.

    Raises:
        ModelStoreError / ValueError: the model cannot be found or is unsupported (here).
        PortUnavailable: the gRPC port is taken.
        StartupError: a worker cannot be placed, fails on its node, has other weights, or
            does not start in time; GPUs are missing (one line naming the node and cause).
    """
    import ray
    from transformers import AutoTokenizer

    from pagedserve.scheduler.actor import SchedulerActor
    from pagedserve.worker.model_store import worker_model_spec

    warning = exposure_warning(config.server.host, config.server.api_key)
    if warning is not None:
        log.warning(warning)
    check_tls_files(config.server.tls_cert, config.server.tls_key, config.server.tls_client_ca)
    check_port_free(config.server.host, config.server.port)
    if config.server.http_port is not None:
        check_port_free(config.server.host, config.server.http_port)
    model_dir, digest = _resolve_model(config)
    # Each worker resolves the model on its own node from the spec, not the driver's path.
    model_cfg = dataclasses.replace(config.model, model=worker_model_spec(config.model.model))
    config = dataclasses.replace(config, model=model_cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    store_keys, store_access = cluster_store_keys(config.server)
    owns_ray = init_ray(config)
    try:
        workers, names, infos = await _start_workers(config, store_access, digest)
        max_model_len = min(i.max_model_len for i in infos)
        specs = [
            WorkerSpec(i.worker_id, i.num_blocks, i.block_size, i.dtype, i.kv_cache_dtype)
            for i in infos
        ]
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
        host_store, swap = await start_host_store(
            config, workers, infos[0].block_bytes, store_keys, infos[0].kv_cache_dtype
        )
        scheduler: Any = (
            ray.remote(SchedulerActor)
            .options(
                num_cpus=0,
                max_concurrency=10_000,
                max_restarts=config.scheduler_max_restarts,
                scheduling_strategy=_near_driver(),
            )
            .remote(sched_cfg, names, specs, swap=swap, tune_gc=True)  # names: see SchedulerActor
        )
        await scheduler.ready.remote()
        info = ModelInfo(
            name=str(model_dir),
            max_model_len=max_model_len,
            vocab_size=infos[0].vocab_size,
            eos_token_ids=tuple(infos[0].eos_token_ids),
            max_kv_slots=max(s.num_blocks * s.block_size for s in specs),
            block_size=max(specs, key=lambda s: s.num_blocks * s.block_size).block_size,
        )
        pipeline = RequestPipeline(
            scheduler, tokenizer, info, max_buffered_outputs=config.server.max_stream_buffer
        )
        servicer = GenerationServicer(pipeline)
        http = await _start_http(config, pipeline)
        try:
            server, port = await start_server(config.server, servicer)
        except BaseException:
            if http is not None:
                await http.stop()
            raise
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    log.info("serving %s on %s:%d", model_dir, config.server.host, port)
    loop = asyncio.get_running_loop()
    health_task = loop.create_task(servicer.watch_health())
    watch_task = loop.create_task(watch_scheduler(scheduler, pipeline.flights))
    return ClusterHandle(
        config,
        scheduler,
        workers,
        server,
        port,
        info,
        owns_ray,
        health_task,
        http,
        pipeline,
        servicer,
        watch_task,
        host_store,
    )


def _resolve_model(config: ClusterConfig) -> tuple[Any, str]:
    """The driver's model folder (for the tokenizer) and its weights' digest.

    Raises:
        ModelStoreError / ValueError: the model cannot be found or is unsupported.
    """
    from pagedserve.worker.arch import ModelArch
    from pagedserve.worker.model_store import resolve_model, weights_digest

    model_dir = resolve_model(config.model, progress=True)
    # Refuse unsupported models here, with one clear error, before any actor starts.
    ModelArch.from_pretrained(model_dir, config.model.max_model_len)
    return model_dir, weights_digest(model_dir)


async def _start_workers(
    config: ClusterConfig, store_access: Any, digest: str
) -> tuple[list[Any], list[str], list[Any]]:
    """Create the worker actors on the cluster's nodes and wait for their ``get_info``:
    device and CPUs from Ray's view of the nodes, placement checked first, the start-up
    bounded by ``startup_timeout_s``, every worker's weights equal to ``digest``.

    Returns ``(actors, names, infos)``.

    Raises:
        StartupError: see :mod:`pagedserve.cluster.startup`.
    """
    import ray

    from pagedserve.cluster import startup

    cuda = await asyncio.to_thread(startup.decide_cuda, config, _node_wait(config))
    cpus = config.cpus_per_worker
    if cpus is None:
        cpus = startup.default_cpus_per_worker(config, startup.cluster_nodes())
        config = dataclasses.replace(config, cpus_per_worker=cpus)
    requests = [startup.worker_request(config, w, cuda, cpus) for w in range(config.num_workers)]
    await asyncio.to_thread(startup.check_placeable, requests, _node_wait(config))
    worker_cls = ray.remote(startup.Worker)
    workers: list[Any] = []
    names = [f"pagedserve-worker-{uuid.uuid4().hex[:12]}-{w}" for w in range(config.num_workers)]
    for wid in range(config.num_workers):
        wcfg = dataclasses.replace(config.worker_config(wid), host_store_access=store_access)
        if cuda:
            wcfg = dataclasses.replace(wcfg, device="cuda", num_threads=0)
        else:
            wcfg = dataclasses.replace(wcfg, device="cpu")
        workers.append(
            worker_cls.options(
                name=names[wid],
                max_concurrency=1,
                max_restarts=config.worker_max_restarts,
                **requests[wid],
            ).remote(wcfg)
        )
    try:
        answers = await startup.wait_workers(workers, requests, config.startup_timeout_s)
        infos = [info for info, _ in answers]
        startup.check_same_weights(infos, [node for _, node in answers], digest)
    except BaseException:
        for actor in workers:
            ray.kill(actor)
        raise
    return workers, names, infos


def _near_driver() -> Any:
    """Ray scheduling strategy for the scheduler actor: the driver's node, whose frontends
    read its output stream (the driver dies with that node anyway). Without it a zero-CPU
    actor may land on any node, and dies with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _node_wait(config: ClusterConfig) -> float:
    """Seconds to wait for joining nodes: none in an embedded cluster (no node joins)."""
    return 0.0 if config.ray_address is None else config.node_wait_s


async def start_host_store(
    config: ClusterConfig,
    workers: list[Any],
    block_bytes: int,
    keys: StoreKeys,
    kv_cache_dtype: str | None = None,
) -> tuple[Any, SwapSpec | None]:
    """Start the host block store actor on this node, guarded by ``keys`` (the workers
    carry their side in ``WorkerConfig.host_store_access``) and accepting blocks of
    ``kv_cache_dtype`` only, connect the workers to it and
    measure swap bandwidth and prefill cost on worker 0 (the cost model's start).

    Returns ``(actor, SwapSpec)``, or ``(None, None)`` when swapping is off
    (``preemption_mode`` recompute or ``swap_space`` 0).

    Raises:
        ValueError: ``swap_space`` holds no KV block.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if config.scheduler.preemption_mode == "recompute" or config.swap_space == 0:
        return None, None
    num_host_blocks = config.swap_space // block_bytes
    if num_host_blocks < 1:
        raise ValueError(
            f"swap space of {config.swap_space} bytes holds no KV block ({block_bytes} bytes)"
        )
    # NOTE: one store, on the driver's node: workers on this node reach it on loopback.
    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    store: Any = (
        ray.remote(HostStoreActor)
        .options(num_cpus=0, max_concurrency=4, scheduling_strategy=node)
        .remote(config.swap_space, keys=keys, kv_cache_dtype=kv_cache_dtype)
    )
    address = await store.address.remote()
    await asyncio.gather(*(w.connect_host_store.remote(address) for w in workers))
    bandwidth, prefill = await workers[0].measure_swap_costs.remote()
    log.info(
        "host block store %s: %d blocks; swap %.1f MB/s, prefill %.2f ms/token",
        address,
        num_host_blocks,
        bandwidth / 1e6,
        prefill * 1e3,
    )
    return store, SwapSpec(num_host_blocks, block_bytes, bandwidth, prefill, address)


def build_http_app(config: ClusterConfig, pipeline: RequestPipeline) -> Any:
    """The HTTP frontend's ASGI app: ``/metrics``, ``/health`` and the OpenAI-compatible
    API ``/v1``, bound to ``pipeline`` (served by uvicorn here, or by Ray Serve's proxy in
    :mod:`pagedserve.cluster.serve_app`)."""
    from pathlib import Path

    info, scheduler = pipeline.info, pipeline.scheduler
    short_name = Path(info.name).name or info.name
    exporter = MetricsExporter(scheduler, model_name=short_name)
    names = (config.server.served_model_name or short_name, info.name)
    openai = OpenAIServer(pipeline, names, config.server.max_http_body_bytes)
    app: Any = create_app(
        scheduler,
        exporter,
        routers=[openai.router()],
        serving=lambda: pipeline.flights.serving,
        exception_handlers=openai.exception_handlers(),
    )
    if config.server.api_key:
        app = ApiKeyMiddleware(app, config.server.api_key)
    return app


async def _start_http(config: ClusterConfig, pipeline: RequestPipeline) -> HttpServer | None:
    """Start the HTTP frontend (:func:`build_http_app`) when ``http_port`` is set, over
    TLS when ``tls_cert`` is set.

    Raises:
        PortUnavailable: the HTTP port cannot be bound.
    """
    from pagedserve.cluster.frontend import PortUnavailable

    server = config.server
    if server.http_port is None:
        return None
    app = build_http_app(config, pipeline)
    ssl_options = uvicorn_ssl_options(server.tls_cert, server.tls_key, server.tls_client_ca)
    http = HttpServer(app, server.host, server.http_port, ssl_options)
    try:
        await http.start()
    except OSError as exc:
        raise PortUnavailable(
            f"cannot bind {config.server.host}:{config.server.http_port}: {exc.strerror}"
        ) from exc
    return http


async def serve_forever(config: ClusterConfig, grace_s: float = 2.0) -> None:
    """Run the cluster until Ctrl-C / SIGTERM, then shut down gracefully: refuse new
    requests (UNAVAILABLE, health NOT_SERVING), let the ones in flight finish for up to
    ``config.server.drain_timeout_s`` seconds (a second signal cuts that short), abort
    the rest (ABORT), and stop the frontends (``grace_s`` seconds), the actors and Ray."""
    import signal

    handle = await start_cluster(config)
    print(f"pagedserve: serving on {handle.address} (Ctrl-C to stop)", flush=True)
    if handle.http_address is not None:
        scheme = "https" if config.server.tls else "http"
        print(f"pagedserve: metrics on {scheme}://{handle.http_address}/metrics", flush=True)
        print(
            f"pagedserve: OpenAI-compatible API on {scheme}://{handle.http_address}/v1", flush=True
        )
    stop = asyncio.Event()
    force = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        drain_s = config.server.drain_timeout_s
        print(
            f"pagedserve: draining: refusing new requests, waiting up to {drain_s:g} s for "
            f"{len(handle.pipeline.flights) if handle.pipeline else 0} in flight "
            "(Ctrl-C again to stop now)",
            flush=True,
        )
        aborted = await handle.drain(drain_s, force)
        if aborted:
            print(f"pagedserve: aborted {aborted} request(s) still running", flush=True)
    finally:
        print("pagedserve: shutting down", flush=True)
        await handle.stop(grace_s)
