"""Swap preemption through the real server: Ray, the host block store actor, gRPC, SmolLM2.

A one-worker cluster with an 8-block pool and ``preemption_mode="swap"`` (1 GiB of swap
space) serves 4 concurrent greedy requests: their outputs equal the same requests served
one at a time (no preemption), GetStats shows swapped bytes, and every device and host
block is free afterwards. Then the store actor is killed: the same requests recover by
recompute and the server keeps serving.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import LoopThread

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pagedserve.cluster.launcher import RAY_ENV, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.model]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Who wrote Hamlet?",
]
KW = dict(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def swap_cluster(served_model_dir: str):
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=served_model_dir, dtype="float32", max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks=8),
        scheduler=SchedulerConfig(
            preemption_mode="swap", max_num_batched_tokens=512, host_prefix_cache=False
        ),
        server=ServerConfig(host="127.0.0.1", port=0),
        num_workers=1,
        cpus_per_worker=0,  # schedulable next to the session's test cluster in this process
        device="cpu",
        swap_space=1 << 30,
    )
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        yield handle, lt
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


def run_all(address: str) -> list[list[int]]:
    def one(q: str) -> list[int]:
        with Client(address, timeout_s=600) as c:
            return c.generate(chat=[{"role": "user", "content": q}], **KW).choices[0].token_ids

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, QUESTIONS))


def wait_idle(address: str) -> dict:
    with Client(address, timeout_s=30) as c:
        for _ in range(300):
            st = c.stats()
            if st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0:
                return st
            time.sleep(0.1)
    raise AssertionError("the cluster did not go idle")


def test_swap_preemption_through_the_server(swap_cluster) -> None:
    import ray

    handle, _ = swap_cluster
    address = handle.address
    with Client(address, timeout_s=600) as c:
        alone = [
            c.generate(chat=[{"role": "user", "content": q}], **KW).choices[0].token_ids
            for q in QUESTIONS
        ]
    before = wait_idle(address)["swap"]
    assert before["preemption_mode"] == "swap"
    assert before["num_swap_outs"] == 0 and before["host_blocks_total"] > 0

    assert run_all(address) == alone
    st = wait_idle(address)
    sw = st["swap"]
    assert sw["num_swap_outs"] > 0 and sw["num_swap_ins"] == sw["num_swap_outs"]
    assert sw["swap_out_bytes"] == sw["swap_in_bytes"] > 0
    assert sw["preemptions_by_mode"]["swap"] > 0
    assert sw["num_requests_swapped"] == 0
    assert sw["host_blocks_free"] == sw["host_blocks_total"]
    (w,) = st["workers"]
    assert w["num_free_blocks"] == w["num_blocks"]
    (store,) = handle.host_stores.values()  # one node: one store
    assert ray.get(store.used_bytes.remote()) == 0

    # The store dies: swapping fails, every request recovers by recompute.
    ray.kill(store)
    assert run_all(address) == alone
    st = wait_idle(address)
    sw = st["swap"]
    assert sw["num_swap_failures"] > 0
    assert sw["host_blocks_free"] == sw["host_blocks_total"]
    (w,) = st["workers"]
    assert w["num_free_blocks"] == w["num_blocks"]
