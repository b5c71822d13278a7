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
import sys
import time
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
from pagedserve.cluster.openai_api import OpenAIServer, openapi_components
from pagedserve.cluster.pipeline import RequestPipeline
from pagedserve.cluster.request_prep import ModelInfo
from pagedserve.cluster.tp_group import start_rank_group
from pagedserve.scheduler.config import SchedulerConfig, default_max_num_batched_tokens
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
        ranks = config.num_workers * config.tensor_parallel_size
        cpus = max(os.cpu_count() or 1, ranks * (config.cpus_per_worker or 1))
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


def resolved_scheduler_config(
    sched: SchedulerConfig, max_model_len: int, devices: list[str]
) -> SchedulerConfig:
    """``sched`` with what the workers decide filled in: ``max_model_len`` (the smallest
    the workers serve) and, where ``None``, the step token budget of the first worker's
    device (:func:`default_max_num_batched_tokens`; ``devices``: each worker's
    ``"cpu"`` / ``"cuda:N"``)."""
    budget = sched.max_num_batched_tokens
    if budget is None:
        budget = default_max_num_batched_tokens(devices[0])
    return dataclasses.replace(sched, max_model_len=max_model_len, max_num_batched_tokens=budget)


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
    watch_task: asyncio.Task[str] | None = None
    host_stores: dict[str, Any] = dataclasses.field(default_factory=dict)  # node id -> store
    rank_groups: list[Any] = dataclasses.field(default_factory=list)  # tp_group.RankGroup

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
        for store in self.host_stores.values():
            ray.kill(store)
        for group in self.rank_groups:
            group.kill()
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
        workers, names, infos, groups = await _start_workers(config, store_access, digest)
        max_model_len = min(i.max_model_len for i in infos)
        specs = [
            WorkerSpec(i.worker_id, i.num_blocks, i.block_size, i.dtype, i.kv_cache_dtype)
            for i in infos
        ]
        sched_cfg = resolved_scheduler_config(
            config.scheduler, max_model_len, [i.device for i in infos]
        )
        # NOTE: a host block of a tensor-parallel worker holds every rank's chunk (each
        # rank's KV heads), so it costs T times a rank's block bytes.
        host_block_bytes = infos[0].block_bytes * infos[0].tensor_parallel_size
        host_store, swap = await start_host_store(
            config, workers, host_block_bytes, store_keys, infos[0].kv_cache_dtype
        )
        info = ModelInfo(
            name=str(model_dir),
            max_model_len=max_model_len,
            vocab_size=infos[0].vocab_size,
            eos_token_ids=tuple(infos[0].eos_token_ids),
            max_kv_slots=max(s.num_blocks * s.block_size for s in specs),
            block_size=max(specs, key=lambda s: s.num_blocks * s.block_size).block_size,
        )
        scheduler: Any = (
            ray.remote(SchedulerActor)
            .options(
                num_cpus=0,
                max_concurrency=10_000,
                max_restarts=config.scheduler_max_restarts,
                **_scheduler_placement(config),
                **scheduler_actor_options(config.cluster_name),
            )
            .remote(  # names: see SchedulerActor
                sched_cfg,
                names,
                specs,
                swap=swap,
                disagg=config.disagg_config(),
                tune_gc=True,
                namespace=ray.get_runtime_context().namespace,
                frontend_info=frontend_info(info, tokenizer),
                step_channel=config.step_transport == "socket",
            )
        )
        await scheduler.ready.remote()
        pipeline, servicer, http, server, port = await _start_frontend(
            config, scheduler, tokenizer, info
        )
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
        groups,
    )


CLUSTER_NAMESPACE = "pagedserve"


def scheduler_actor_name(cluster_name: str) -> str:
    """The Ray name of a named cluster's scheduler actor (in :data:`CLUSTER_NAMESPACE`)."""
    return f"pagedserve-scheduler-{cluster_name}"


def scheduler_actor_options(cluster_name: str | None) -> dict[str, Any]:
    """Ray actor options naming the scheduler of cluster ``cluster_name`` (none: anonymous).

    Raises:
        RuntimeError: a live cluster of that name already runs on this Ray cluster.
    """
    import ray

    if cluster_name is None:
        return {}
    name = scheduler_actor_name(cluster_name)
    try:
        ray.get_actor(name, namespace=CLUSTER_NAMESPACE)
    except ValueError:
        return {"name": name, "namespace": CLUSTER_NAMESPACE}
    raise RuntimeError(
        f"a pagedserve cluster named {cluster_name!r} already runs on this Ray cluster: "
        "attach to it (serve --attach) or pick another --cluster-name"
    )


def frontend_info(info: ModelInfo, tokenizer: Any) -> dict[str, Any]:
    """What an attached frontend needs, as plain data the scheduler actor holds for it
    (:meth:`SchedulerActor.get_frontend_info`): ``model_info`` (the :class:`ModelInfo`
    fields) and ``tokenizer_files`` (file name -> bytes, from ``save_pretrained``), so
    the frontend needs no model files of its own."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="pagedserve-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    return {"model_info": dataclasses.asdict(info), "tokenizer_files": files}


def _frontend_from_info(data: dict[str, Any]) -> tuple[ModelInfo, Any]:
    """:func:`frontend_info`'s inverse: ``(ModelInfo, tokenizer)``."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    fields = dict(data["model_info"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    with tempfile.TemporaryDirectory(prefix="pagedserve-tokenizer-") as tmp:
        for name, blob in data["tokenizer_files"].items():
            (Path(tmp) / Path(name).name).write_bytes(blob)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    return ModelInfo(**fields), tokenizer


@dataclass
class AttachedFrontend(ClusterHandle):
    """A frontend attached to a running cluster (:func:`attach_frontend`): :meth:`stop`
    stops this frontend only; the scheduler, the workers and the other frontends go on
    (the scheduler aborts this frontend's requests still running when its output stream
    closes)."""

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop this frontend's servers and output stream (and leave Ray if joined)."""
        import ray

        for task in (self.watch_task, self.health_task):
            if task is not None:
                task.cancel()
        if self.http is not None:
            await self.http.stop(grace_s)
        await self.server.stop(grace_s)
        if self.pipeline is not None:
            await self.pipeline.router.close()
        if self.owns_ray:
            ray.shutdown()


async def find_cluster(config: ClusterConfig, wait_s: float = 0.0) -> tuple[Any, ModelInfo, Any]:
    """The running cluster named ``config.cluster_name`` on the Ray cluster this process
    joined: ``(scheduler actor, ModelInfo, tokenizer)``, waiting up to ``wait_s`` seconds
    for its scheduler to appear (a cluster still starting).

    Raises:
        ValueError: no ``cluster_name``.
        RuntimeError: no cluster of that name runs there (after ``wait_s``), or it serves
            no attached frontends.
    """
    import ray

    if config.cluster_name is None:
        raise ValueError("attaching needs the cluster's name (cluster_name)")
    name = scheduler_actor_name(config.cluster_name)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            scheduler = ray.get_actor(name, namespace=CLUSTER_NAMESPACE)
            break
        except ValueError:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"no pagedserve cluster named {config.cluster_name!r} runs on the Ray "
                    f"cluster at {config.ray_address or 'this process'}"
                ) from None
            await asyncio.sleep(0.5)
    await scheduler.ready.remote()
    data = await scheduler.get_frontend_info.remote()
    if data is None:
        raise RuntimeError(f"cluster {config.cluster_name!r} serves no attached frontends")
    info, tokenizer = _frontend_from_info(data)
    return scheduler, info, tokenizer


async def attach_frontend(config: ClusterConfig) -> AttachedFrontend:
    """Start another gRPC (+ HTTP) frontend against the running cluster named
    ``config.cluster_name`` on the Ray cluster at ``config.ray_address`` (joined unless
    this process is in it already). It shares the cluster's scheduler, workers, KV and
    routing; the model description and tokenizer come from the scheduler actor. The
    frontend's own settings are ``config.server``'s; the model, worker and scheduler
    settings of ``config`` are not used.

    Raises:
        ValueError: no ``cluster_name``.
        RuntimeError: no cluster of that name runs there.
        PortUnavailable: a port is taken.
    """
    import ray

    if config.cluster_name is None:
        raise ValueError("attaching needs the cluster's name (cluster_name)")
    warning = exposure_warning(config.server.host, config.server.api_key)
    if warning is not None:
        log.warning(warning)
    check_tls_files(config.server.tls_cert, config.server.tls_key, config.server.tls_client_ca)
    check_port_free(config.server.host, config.server.port)
    if config.server.http_port is not None:
        check_port_free(config.server.host, config.server.http_port)
    owns_ray = init_ray(config)
    try:
        scheduler, info, tokenizer = await find_cluster(config)
        pipeline, servicer, http, server, port = await _start_frontend(
            config, scheduler, tokenizer, info
        )
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    log.info(
        "attached to cluster %r: serving on %s:%d", config.cluster_name, config.server.host, port
    )
    loop = asyncio.get_running_loop()
    return AttachedFrontend(
        config,
        scheduler,
        [],
        server,
        port,
        info,
        owns_ray,
        loop.create_task(servicer.watch_health()),
        http,
        pipeline,
        servicer,
        loop.create_task(watch_scheduler(scheduler, pipeline.flights)),
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
) -> tuple[list[Any], list[str], list[Any], list[Any]]:
    """Create the worker actors on the cluster's nodes and wait for their ``get_info``:
    device and CPUs from Ray's view of the nodes, placement checked first, the start-up
    bounded by ``startup_timeout_s``, every worker's weights equal to ``digest``. With
    ``tensor_parallel_size`` T > 1 each worker is a group of T ranks
    (:mod:`pagedserve.cluster.tp_group`) and its actor is rank 0.

    Returns ``(actors, names, infos, rank groups)``.

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
    tp = config.tensor_parallel_size
    requests = [startup.worker_request(config, w, cuda, cpus) for w in range(config.num_workers)]
    requests = [r for r in requests for _ in range(tp)]  # one per rank
    labels = None
    if config.scheduler_resources is not None:
        requests.append({"num_cpus": 0, "resources": dict(config.scheduler_resources)})
        labels = [f"worker {w // tp}" for w in range(len(requests))] + ["the scheduler"]
    await asyncio.to_thread(startup.check_placeable, requests, _node_wait(config), labels=labels)
    worker_cls = ray.remote(startup.Worker)
    workers: list[Any] = []
    groups: list[Any] = []
    names = [f"pagedserve-worker-{uuid.uuid4().hex[:12]}-{w}" for w in range(config.num_workers)]
    for wid in range(config.num_workers):
        wcfg = dataclasses.replace(config.worker_config(wid), host_store_access=store_access)
        if cuda:
            wcfg = dataclasses.replace(wcfg, device="cuda", num_threads=0)
        else:
            wcfg = dataclasses.replace(wcfg, device="cpu")
        if tp > 1:
            group = await start_rank_group(
                worker_cls,
                wcfg,
                tp,
                requests[wid * tp],
                names[wid],
                config.startup_timeout_s,
                env=config.worker_env(wcfg.device),
            )
            groups.append(group)
            workers.append(group.driver)
            continue
        env = config.worker_env(wcfg.device)
        workers.append(
            worker_cls.options(
                name=names[wid],
                max_concurrency=1,
                max_restarts=config.worker_max_restarts,
                **requests[wid],
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(wcfg)
        )
    try:
        answers = await startup.wait_workers(workers, requests[::tp], config.startup_timeout_s)
        infos = [info for info, _ in answers]
        startup.check_same_weights(infos, [node for _, node in answers], digest)
    except BaseException:
        for actor in workers:
            ray.kill(actor)
        for group in groups:
            group.kill()
        raise
    return workers, names, infos, groups


def _scheduler_placement(config: ClusterConfig) -> dict[str, Any]:
    """Ray options that place the scheduler actor: its ``scheduler_resources`` when given
    (it and its restarts go to the nodes that hold them), else the driver's node, whose
    frontend reads its output stream (the driver dies with that node anyway; without it a
    zero-CPU actor may land on any node, and die with it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if config.scheduler_resources is not None:
        return {"resources": dict(config.scheduler_resources)}
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def _node_wait(config: ClusterConfig) -> float:
    """Seconds to wait for joining nodes: none in an embedded cluster (no node joins)."""
    return 0.0 if config.ray_address is None else config.node_wait_s


async def _start_frontend(
    config: ClusterConfig, scheduler: Any, tokenizer: Any, info: ModelInfo
) -> tuple[RequestPipeline, GenerationServicer, Any, Any, int]:
    """The request pipeline over ``scheduler``, the gRPC server and (when configured) the
    HTTP server: ``(pipeline, servicer, http or None, grpc server, grpc port)``. The HTTP
    server is stopped again when the gRPC one cannot start."""
    pipeline = RequestPipeline(
        scheduler,
        tokenizer,
        info,
        max_buffered_outputs=config.server.max_stream_buffer,
        output_transport=config.server.output_transport,
    )
    servicer = GenerationServicer(pipeline)
    http = await _start_http(config, pipeline)
    try:
        server, port = await start_server(config.server, servicer)
    except BaseException:
        if http is not None:
            await http.stop()
        raise
    return pipeline, servicer, http, server, port


async def start_host_store(
    config: ClusterConfig,
    workers: list[Any],
    block_bytes: int,
    keys: StoreKeys,
    kv_cache_dtype: str | None = None,
) -> tuple[dict[str, Any], dict[int, SwapSpec] | None]:
    """Start one host block store actor on every node that runs workers (Ray node
    affinity; ``WorkerInfo.node_id``), each guarded by ``keys`` (the workers carry their
    side in ``WorkerConfig.host_store_access``) and accepting blocks of
    ``kv_cache_dtype`` only; connect every worker to its own node's store and measure its
    swap bandwidth (to that store) and prefill cost, the nodes in parallel.

    A worker whose probe fails (or whose node's store does not start) gets no spec: it
    preempts by recompute, with one warning naming the worker, its node and the cause;
    start-up goes on.

    Returns ``(node id -> store actor, worker id -> SwapSpec)``, or ``({}, None)`` when
    swapping is off (``preemption_mode`` recompute without ``prefill_workers``, or
    ``swap_space`` 0).

    Raises:
        ValueError: ``swap_space`` holds no KV block.
    """
    # NOTE: disaggregation moves KV through the stores under every preemption mode.
    recompute = config.scheduler.preemption_mode == "recompute" and not config.prefill_workers
    if recompute or config.swap_space == 0:
        return {}, None
    num_host_blocks = config.swap_space // block_bytes
    if num_host_blocks < 1:
        raise ValueError(
            f"swap space of {config.swap_space} bytes holds no KV block ({block_bytes} bytes)"
        )
    infos = await asyncio.gather(*(w.get_info.remote() for w in workers))
    by_node: dict[str, dict[int, Any]] = {}
    for wid, info in enumerate(infos):
        by_node.setdefault(info.node_id, {})[wid] = workers[wid]
    size = (config.swap_space, num_host_blocks, block_bytes)
    started = await asyncio.gather(
        *(
            _start_node_store(node, members, size, keys, kv_cache_dtype)
            for node, members in by_node.items()
        )
    )
    stores: dict[str, Any] = {}
    specs: dict[int, SwapSpec] = {}
    for node, (store, node_specs) in zip(by_node, started):
        if store is not None:
            stores[node] = store
        specs.update(node_specs)
    return stores, await _probe_pulls(workers, specs)


async def _probe_pulls(workers: list[Any], specs: dict[int, SwapSpec]) -> dict[int, SwapSpec]:
    """``specs`` with each worker's pull bandwidth from every other node's store that is
    reachable from other nodes (``SwapSpec.pull_bandwidth_bytes_per_s``), one probe at a
    time (each writes host blocks ``0..`` of the store it probes). A failed probe leaves
    that pair unmeasured (its groups are recomputed there), with one warning."""
    remote = {s.store_id: s.remote_address for s in specs.values() if s.remote_address}
    out: dict[int, SwapSpec] = {}
    for wid, spec in specs.items():
        pulls: dict[str, float] = {}
        for store, address in remote.items():
            if store == spec.store_id:
                continue
            try:
                pulls[store] = float(await workers[wid].measure_pull_bandwidth.remote(address))
            except Exception as exc:  # any cause: that pair recomputes
                _warn_no_pull(wid, store, address, exc)
                continue
            log.info(
                "worker %d: pulls from the store of node %s (%s) at %.1f MB/s",
                wid,
                store,
                address,
                pulls[store] / 1e6,
            )
        out[wid] = dataclasses.replace(spec, pull_bandwidth_bytes_per_s=pulls)
    return out


async def _start_node_store(
    node_id: str,
    workers: dict[int, Any],
    size: tuple[int, int, int],
    keys: StoreKeys,
    kv_cache_dtype: str | None,
) -> tuple[Any, dict[int, SwapSpec]]:
    """The store of one node and the specs of its ``workers`` (worker id -> actor) whose
    probe succeeded; ``(None, {})`` when none can swap (the store is then stopped).
    ``size``: ``(swap_space bytes, host blocks, bytes per block)``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    swap_space, num_host_blocks, block_bytes = size
    # NOTE: served on the node's loopback (its own workers) and on the node's address:
    # workers of other nodes pull groups from it there (remote swap-ins), with the key.
    node = NodeAffinitySchedulingStrategy(node_id, soft=False)
    store: Any = (
        ray.remote(HostStoreActor)
        .options(num_cpus=0, max_concurrency=4, scheduling_strategy=node)
        .remote(swap_space, keys=keys, kv_cache_dtype=kv_cache_dtype, serve_node_address=True)
    )
    specs: dict[int, SwapSpec] = {}
    try:
        address = await store.address.remote()
        remote_address = await store.remote_address.remote()
    except Exception as exc:  # any cause: that node's workers recompute
        for wid in workers:
            _warn_no_swap(wid, node_id, "its node's host block store did not start", exc)
        ray.kill(store)
        return None, specs
    # NOTE: one probe at a time per store: every probe writes host blocks 0.., and
    # concurrent probes would measure each other's traffic.
    for wid, worker in workers.items():
        try:
            bandwidth, prefill = await _probe_swap(wid, worker, address)
        except Exception as exc:  # any cause: this worker recomputes
            _warn_no_swap(wid, node_id, f"the swap bandwidth probe through {address} failed", exc)
            continue
        specs[wid] = SwapSpec(
            num_host_blocks,
            block_bytes,
            bandwidth,
            prefill,
            address,
            store_id=node_id,
            remote_address=remote_address,
        )
        log.info(
            "worker %d on node %s: host block store %s, %d blocks; swap %.1f MB/s, "
            "prefill %.2f ms/token",
            wid,
            node_id,
            address,
            num_host_blocks,
            bandwidth / 1e6,
            prefill * 1e3,
        )
    if not specs:
        ray.kill(store)
        return None, specs
    return store, specs


async def _probe_swap(worker_id: int, worker: Any, address: str) -> tuple[float, float]:
    """Connect worker ``worker_id`` (``worker``: its actor) to the store at ``address``;
    its ``(swap bytes/s, prefill s/token)`` (``Worker.measure_swap_costs``). Raises
    whatever the probe raised."""
    await worker.connect_host_store.remote(address)
    bandwidth, prefill = await worker.measure_swap_costs.remote()
    return float(bandwidth), float(prefill)


def _warn_no_pull(worker_id: int, store: str, address: str, exc: BaseException) -> None:
    """The one line for a pair whose pull probe failed (see :func:`_warn_no_swap`)."""
    cause = getattr(exc, "cause", None) or exc
    lines = str(cause).strip().splitlines()
    log.warning(
        "worker %d: no remote swap-in from the store of node %s: the pull probe through "
        "%s failed (its groups are recomputed there): %s: %s",
        worker_id,
        store,
        address,
        type(cause).__name__,
        lines[0] if lines else "no message",
    )


def _warn_no_swap(worker_id: int, node_id: str, what: str, exc: BaseException) -> None:
    """The one line a worker that cannot swap gets: ``what`` failed, and the first line of
    the exception the actor raised (``RayTaskError.cause``, not Ray's traceback)."""
    cause = getattr(exc, "cause", None) or exc
    lines = str(cause).strip().splitlines()
    log.warning(
        "worker %d on node %s: swap disabled (preempts by recompute): %s: %s: %s",
        worker_id,
        node_id or "?",
        what,
        type(cause).__name__,
        lines[0] if lines else "no message",
    )


def build_http_app(config: ClusterConfig, pipeline: RequestPipeline) -> Any:
    """The HTTP frontend's ASGI app: ``/metrics``, ``/health`` and the OpenAI-compatible
    API ``/v1``, bound to ``pipeline`` (served by uvicorn here, or by Ray Serve's proxy in
    :mod:`pagedserve.cluster.serve_app`)."""
    from pathlib import Path

    info, scheduler = pipeline.info, pipeline.scheduler
    short_name = Path(info.name).name or info.name
    exporter = MetricsExporter(scheduler, model_name=short_name)
    names = (config.server.served_model_name or short_name, info.name)
    openai = OpenAIServer(
        pipeline, names, config.server.max_http_body_bytes, config.server.tool_call_parser
    )
    app: Any = create_app(
        scheduler,
        exporter,
        routers=[openai.router()],
        serving=lambda: pipeline.flights.serving,
        exception_handlers=openai.exception_handlers(),
        openapi_components=openapi_components(),
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


async def serve_forever(config: ClusterConfig, grace_s: float = 2.0, attach: bool = False) -> int:
    """Run the cluster (``attach``: one more frontend of the running cluster
    ``config.cluster_name``, :func:`attach_frontend`) until Ctrl-C / SIGTERM, then shut
    down gracefully: refuse new
    requests (UNAVAILABLE, health NOT_SERVING), let the ones in flight finish for up to
    ``config.server.drain_timeout_s`` seconds (a second signal cuts that short), abort
    the rest (ABORT), and stop the frontends (``grace_s`` seconds), the actors and Ray
    (an attached frontend: its own requests and servers only).

    Returns the exit status: 0 after a stop signal, 1 when the cluster went away for good
    first (an attached frontend's owning cluster stopped, or the scheduler actor died with
    no restart left), which is printed as an ``error:`` line."""
    import signal

    handle = await (attach_frontend(config) if attach else start_cluster(config))
    print(f"pagedserve: serving on {handle.address} (Ctrl-C to stop)", flush=True)
    if config.cluster_name is not None and not attach:
        import ray

        ray_address = ray.get_runtime_context().gcs_address
        print(
            f"pagedserve: cluster {config.cluster_name!r}; attach more frontends with "
            f"`pagedserve serve --attach {ray_address} --cluster-name {config.cluster_name}`",
            flush=True,
        )
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
    gone: str | None = None
    try:
        gone = await _until_stop_or_gone(stop, handle.watch_task)
        if gone is not None:
            print(f"pagedserve: error: {gone}; this frontend stops", file=sys.stderr, flush=True)
        else:
            await _drain(handle, config.server.drain_timeout_s, force)
    finally:
        print("pagedserve: shutting down", flush=True)
        await handle.stop(grace_s)
    return 0 if gone is None else 1


async def _drain(handle: ClusterHandle, drain_s: float, force: asyncio.Event) -> None:
    print(
        f"pagedserve: draining: refusing new requests, waiting up to {drain_s:g} s for "
        f"{len(handle.pipeline.flights) if handle.pipeline else 0} in flight "
        "(Ctrl-C again to stop now)",
        flush=True,
    )
    aborted = await handle.drain(drain_s, force)
    if aborted:
        print(f"pagedserve: aborted {aborted} request(s) still running", flush=True)


async def _until_stop_or_gone(
    stop: asyncio.Event, watch_task: asyncio.Task[str] | None
) -> str | None:
    """Wait for a stop signal (None) or for the scheduler watcher to report the cluster
    gone for good (its reason): the owning cluster stopped, or its scheduler actor died
    with no restart left."""
    waiter = asyncio.ensure_future(stop.wait())
    tasks: set[asyncio.Future[Any]] = {waiter}
    if watch_task is not None:
        tasks.add(watch_task)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if watch_task is None or not watch_task.done() or watch_task.cancelled():
        return None
    exc = watch_task.exception()
    return watch_task.result() if exc is None else f"the scheduler watcher failed ({exc!r})"
