"""A scheduler restarted by Ray after one of its workers was killed for good (embedded
Ray, two CPU workers, tiny random Llama): it starts with the worker left, takes the lost
one out of service, and serves new requests with the tokens of an undisturbed run."""

from __future__ import annotations

import os
import time

import pytest
import ray
from helpers import LoopThread, build_tiny_model

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pagedserve.cluster.launcher import RAY_ENV, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = dict(temperature=0, ignore_eos=True)


def test_restart_serves_on_the_worker_left(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=str(model), max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(routing="round-robin"),
        server=ServerConfig(host="127.0.0.1", port=0),
        num_workers=2,
        cpus_per_worker=0,
        device="cpu",
        worker_max_restarts=2,
        scheduler_max_restarts=2,
    )
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        with Client(handle.address, timeout_s=60) as c:
            ref = [c.generate(f"Prompt {i}", max_tokens=12, **GREEDY) for i in range(2)]
            ref_toks = [r.choices[0].token_ids for r in ref]
        ray.kill(handle.workers[1], no_restart=True)  # gone for good
        ray.kill(handle.scheduler, no_restart=False)  # Ray restarts it
        t0 = time.monotonic()
        got = None
        while got is None:
            assert time.monotonic() - t0 < 90, "the restarted scheduler never served"
            try:
                with Client(handle.address, timeout_s=30) as c:
                    got = [
                        c.generate(f"Prompt {i}", max_tokens=12, **GREEDY).choices[0].token_ids
                        for i in range(2)
                    ]
            except Exception:
                time.sleep(0.5)
        assert got == ref_toks
        assert ray.get(handle.scheduler.num_live_workers.remote(), timeout=30) == 1
        stats = ray.get(handle.scheduler.get_stats.remote(), timeout=30)
        print(f"restarted scheduler served after {time.monotonic() - t0:.1f} s: {stats}")
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()
