"""Swap per node through the real launcher: two CPU workers on this node share its host
block store, and worker 1's bandwidth probe is made to fail (it is pointed at a port where
no store listens). Start-up still succeeds, with one warning naming worker 1 and its
node; worker 1 preempts by recompute while worker 0 swaps, and the greedy tokens equal
the same requests served one at a time."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import LoopThread
from tiny_cluster import assert_all_blocks_free

from pagedserve.cluster import launcher
from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

pytestmark = pytest.mark.slow

UNREACHABLE = "127.0.0.1:9"  # nothing listens there: every call is refused


@pytest.fixture(scope="module")
def two_workers(tiny_llama_dir):
    for k, v in launcher.RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=str(tiny_llama_dir), max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=14),
        scheduler=SchedulerConfig(preemption_mode="swap", host_prefix_cache=False),
        swap_space=64 << 20,
        server=ServerConfig(host="127.0.0.1", port=0, http_port=None),
        num_workers=2,
        cpus_per_worker=0,  # schedulable next to the session's other clusters
        device="cpu",
    )
    probe = launcher._probe_swap

    async def failing_for_worker_1(worker_id, worker, address):
        return await probe(worker_id, worker, UNREACHABLE if worker_id == 1 else address)

    mp = pytest.MonkeyPatch()
    mp.setattr(launcher, "_probe_swap", failing_for_worker_1)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.WARNING)
    logging.getLogger(launcher.__name__).addHandler(keep)
    lt = LoopThread()
    try:
        handle = lt.run(launcher.start_cluster(config))
    finally:
        mp.undo()
        logging.getLogger(launcher.__name__).removeHandler(keep)
    try:
        yield handle, records
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


def test_a_failed_probe_disables_swap_for_that_worker_only(two_workers):
    handle, records = two_workers
    infos = ray.get([w.get_info.remote() for w in handle.workers], timeout=60)
    node = infos[1].node_id
    assert node and infos[0].node_id == node  # both on this node
    (store,) = handle.host_stores.values()  # one node: one store
    assert list(handle.host_stores) == [node]
    warnings = [r.getMessage() for r in records if "swap disabled" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"worker 1 on node {node}: swap disabled")
    assert "the swap bandwidth probe through 127.0.0.1:" in warnings[0]
    assert "SwapError" in warnings[0] and "\n" not in warnings[0]

    prompts = [[(7 * i + j) % 120 + 3 for j in range(12)] for i in range(8)]
    kw = dict(max_tokens=90, temperature=0, ignore_eos=True)
    with Client(handle.address, timeout_s=300) as c:
        alone = [c.generate(token_ids=p, **kw).choices[0].token_ids for p in prompts]
        before = c.stats()

    def one(prompt: list[int]) -> list[int]:
        with Client(handle.address, timeout_s=300) as c:
            return c.generate(token_ids=prompt, **kw).choices[0].token_ids

    # 8 x 7 blocks at full length over two pools of 14: both workers preempt.
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == alone
    with Client(handle.address, timeout_s=30) as c:
        assert_all_blocks_free(handle, c)
        st = c.stats()
    sw = st["swap"]
    assert sw["num_swap_outs"] > before["swap"]["num_swap_outs"]  # worker 0 swapped
    assert sw["num_swap_ins"] == sw["num_swap_outs"] and sw["num_swap_failures"] == 0
    w0, w1 = sorted(st["workers"], key=lambda w: w["worker_id"])
    assert not w1["can_swap"] and w1["num_swap_outs"] == w1["num_swap_failures"] == 0
    assert w1["num_preemptions"] > 0  # worker 1 preempts by recompute only
    assert w0["can_swap"] and w0["num_swap_outs"] == sw["num_swap_outs"]  # every swap: 0's
    assert w0["num_preemptions"] == w0["num_swap_outs"]  # worker 0 swapped every victim
    assert sw["host_blocks_free"] == sw["host_blocks_total"] == (64 << 20) // infos[0].block_bytes
    assert ray.get(store.used_bytes.remote(), timeout=30) == 0
