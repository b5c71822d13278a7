"""A real in-process cluster (embedded Ray, one CPU worker, SmolLM2) for the gRPC tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from helpers import LoopThread

from pagedserve.cluster.config import CacheConfig, ClusterConfig, ModelConfig, ServerConfig
from pagedserve.cluster.launcher import RAY_ENV, ClusterHandle, start_cluster

NUM_BLOCKS = 192
BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def served_model_dir() -> str:
    from pagedserve.worker.model_store import resolve_model

    return str(resolve_model("default", progress=False))


@pytest.fixture(scope="session")
def cluster(served_model_dir: str) -> Iterator[tuple[ClusterHandle, LoopThread]]:
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=served_model_dir, dtype="float32", max_model_len=4096),
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
