"""Ray Serve's view of a replica's health agrees with the gRPC health service: a drain or a
scheduler known down makes both say "not serving"; an HTTP frontend replica is unhealthy
once its cluster is gone for good. No Ray, no Serve: the deployment classes' methods on a
cluster handle whose frontend is the real gRPC server (loopback) in front of a scheduler
stand-in."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.cluster.config import ClusterConfig, ServerConfig
from pagedserve.cluster.frontend import GenerationServicer, start_server
from pagedserve.cluster.launcher import ClusterHandle
from pagedserve.cluster.pipeline import RequestPipeline
from pagedserve.cluster.request_prep import ModelInfo
from pagedserve.cluster.serve_app import (
    GRACEFUL_SHUTDOWN_S,
    PagedServeCluster,
    PagedServeDeployment,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Method:
    def __init__(self, value: Any) -> None:
        self.value = value

    async def _answer(self) -> Any:
        return self.value

    def remote(self) -> Any:
        return self._answer()


class _Scheduler:
    """Answers ``num_live_workers.remote()`` as an actor handle would."""

    def __init__(self, live: int) -> None:
        self.num_live_workers = _Method(live)


class _Tok:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 0}


class _Replica:
    """The deployment's methods (as Serve's ingress wrapper defines them) on a stand-in
    for the replica's state, without Serve calling the constructor."""

    def __init__(self, handle: Any, config: ClusterConfig) -> None:
        self._state = SimpleNamespace(_handle=handle, _config=config)

    async def check_health(self) -> None:
        await PagedServeCluster.func_or_class.check_health(self._state)

    async def shutdown(self) -> None:
        await PagedServeCluster.func_or_class.__del__(self._state)


async def _grpc_health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        return reply.status


async def _drain_scenario() -> None:
    config = ClusterConfig(server=ServerConfig(host="127.0.0.1", port=0))
    info = ModelInfo("m", 16, 2, (1,), 64)
    scheduler = _Scheduler(live=1)
    pipeline = RequestPipeline(scheduler=scheduler, tokenizer=_Tok(), info=info)
    servicer = GenerationServicer(pipeline)
    server, port = await start_server(config.server, servicer)
    handle = ClusterHandle(
        config, scheduler, [], server, port, info, False, pipeline=pipeline, servicer=servicer
    )
    replica = _Replica(handle, config)
    try:
        await replica.check_health()
        assert await _grpc_health(port) == SERVING
        # No live worker: Serve's check fails (the gRPC watcher would say NOT_SERVING).
        scheduler.num_live_workers.value = 0
        with pytest.raises(RuntimeError, match="no live worker"):
            await replica.check_health()
        scheduler.num_live_workers.value = 1
        # The scheduler known down (the frontend saw it die): both say not serving.
        pipeline.flights.scheduler_up = False
        await servicer.set_not_serving()
        assert await _grpc_health(port) == NOT_SERVING
        with pytest.raises(RuntimeError, match="scheduler is unavailable"):
            await replica.check_health()
        pipeline.flights.scheduler_up = True
        await servicer._set_serving(True)
        await replica.check_health()
        assert await _grpc_health(port) == SERVING
        # A drain (SIGTERM, or Serve stopping the replica): NOT_SERVING and unhealthy, even
        # though the scheduler still answers with a live worker.
        assert await handle.drain(0.1) == 0
        assert await _grpc_health(port) == NOT_SERVING
        with pytest.raises(RuntimeError, match="draining"):
            await replica.check_health()
    finally:
        await server.stop(0)


def test_serve_health_check_follows_the_drain_like_grpc_health() -> None:
    asyncio.run(_drain_scenario())


class _RecordingHandle:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []

    async def drain(self, timeout_s: float) -> int:
        self.calls.append(("drain", timeout_s))
        return 0

    async def stop(self) -> None:
        self.calls.append(("stop", None))


@pytest.mark.parametrize("drain_timeout_s", [5.0, 600.0])
def test_replica_shutdown_drains_within_serves_limit(drain_timeout_s: float) -> None:
    handle = _RecordingHandle()
    config = ClusterConfig(server=ServerConfig(drain_timeout_s=drain_timeout_s))
    asyncio.run(_Replica(handle, config).shutdown())
    (what, drain_s), stop = handle.calls
    assert what == "drain" and stop == ("stop", None)
    assert drain_s == min(drain_timeout_s, GRACEFUL_SHUTDOWN_S - 15)


async def _frontend_scenario() -> None:
    config = ClusterConfig(server=ServerConfig(host="127.0.0.1", port=0))
    info = ModelInfo("m", 16, 2, (1,), 64)
    scheduler = _Scheduler(live=1)
    pipeline = RequestPipeline(scheduler=scheduler, tokenizer=_Tok(), info=info)
    watch = asyncio.ensure_future(asyncio.Event().wait())  # the watcher, still watching
    state = SimpleNamespace(_config=config, _scheduler=scheduler, _pipeline=pipeline, _watch=watch)
    frontend = PagedServeDeployment.func_or_class
    await frontend.check_health(state)
    pipeline.flights.scheduler_up = False
    with pytest.raises(RuntimeError, match="scheduler is unavailable"):
        await frontend.check_health(state)
    pipeline.flights.scheduler_up = True
    watch.cancel()  # the watcher returned: the cluster is gone for good
    with contextlib.suppress(asyncio.CancelledError):
        await watch
    with pytest.raises(RuntimeError, match="the cluster is gone"):
        await frontend.check_health(state)
    await frontend.__del__(state)  # drains its own (no) requests, closes its stream
    assert pipeline.flights.draining


def test_a_frontend_replica_is_unhealthy_once_its_cluster_is_gone() -> None:
    asyncio.run(_frontend_scenario())
