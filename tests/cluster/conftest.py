"""A real in-process cluster (embedded Ray, one CPU worker, SmolLM2) for the gRPC tests."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from pagedserve.cluster.config import CacheConfig, ClusterConfig, ModelConfig, ServerConfig
from pagedserve.cluster.launcher import RAY_ENV, ClusterHandle, start_cluster

NUM_BLOCKS = 192
BLOCK_SIZE = 16


class LoopThread:
    """An asyncio loop on a daemon thread; the cluster's frontend lives there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300.0):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def served_model_dir() -> str:
    from pagedserve.worker.model_store import resolve_model

    return str(resolve_model("default", progress=False))


@pytest.fixture(scope="session")
def cluster(served_model_dir: str) -> Iterator[tuple[ClusterHandle, LoopThread]]:
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=served_model_dir, max_model_len=4096),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        server=ServerConfig(host="127.0.0.1", port=0, http_port=0),
        num_workers=1,
        cpus_per_worker=2,
        device="cpu",
    )
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        yield handle, lt
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


@pytest.fixture()
def address(cluster) -> str:
    return cluster[0].address
