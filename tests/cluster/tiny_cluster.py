"""A real in-process cluster (embedded Ray, one CPU worker) on the tiny random Llama, for
tests of the server's surfaces that do not need a real model (auth, limits, fuzz, load)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from helpers import LoopThread

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pagedserve.cluster.launcher import RAY_ENV, ClusterHandle, start_cluster


@contextmanager
def running_cluster(
    model_dir: Path | str,
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    scheduler: SchedulerConfig | None = None,
    swap_space: int = 0,
    cluster_name: str | None = None,
    **server: Any,
) -> Iterator[tuple[ClusterHandle, LoopThread]]:
    """Start a one-worker cluster on 127.0.0.1 (free ports; ``server`` goes to
    :class:`ServerConfig`), yield it, stop it."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    server.setdefault("http_port", None)
    config = ClusterConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=max_model_len, dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=scheduler or SchedulerConfig(),
        swap_space=swap_space,
        server=ServerConfig(host="127.0.0.1", port=0, **server),
        num_workers=1,
        # No Ray CPU reserved: joins the session's Ray (whose SmolLM2 worker may hold every
        # CPU) when another module started it; the tiny model needs one thread.
        cpus_per_worker=0,
        device="cpu",
        cluster_name=cluster_name,
    )
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        yield handle, lt
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


def assert_all_blocks_free(handle: ClusterHandle, client: Client, timeout_s: float = 30.0) -> None:
    """Wait until nothing runs or waits and every block is free; then the scheduler's
    integrity check (ref counts, free queue, block tables, prefix index) must pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.stats()
        idle = st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0
        if idle and all(w["num_free_blocks"] == w["num_blocks"] for w in st["workers"]):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not freed: {st}")
        time.sleep(0.1)
    assert ray.get(handle.scheduler.check_integrity.remote(), timeout=30) is True
