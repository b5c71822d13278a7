"""Prefill/decode disaggregation through the real server: Ray, two CPU workers (worker 0
prefills prompts of at least 48 tokens, worker 1 decodes), the node's host block store
actor carrying the KV between them, gRPC, SmolLM2.

Long and short prompts served at once equal HF greedy (a long one with n = 2 choices);
the 10-block pools preempt; the long ones moved through the store (swap counters, with no
swap preemption: the mode is recompute), and every device and host block is free
afterwards.
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

MAX_NEW = 16
DOC = (
    "The committee met on Tuesday to review the quarterly budget, the hiring plan and the "
    "schedule for the new warehouse. After a long discussion they agreed to postpone the "
    "decision on the warehouse until the next meeting, approved the hiring plan with two "
    "changes, and asked the finance team for a revised budget. Summary:"
)
SHORT = ["What is the capital of France?", "Name three colors.", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def disagg_cluster(served_model_dir: str):
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=served_model_dir, dtype="float32", max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks=10),
        scheduler=SchedulerConfig(
            preemption_mode="recompute", max_num_batched_tokens=512, host_prefix_cache=False
        ),
        server=ServerConfig(host="127.0.0.1", port=0),
        num_workers=2,
        cpus_per_worker=0,  # schedulable next to the session's test cluster in this process
        device="cpu",
        swap_space=1 << 28,
        prefill_workers=1,
        disagg_min_prompt_tokens=48,
    )
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        yield handle, lt
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


@pytest.fixture(scope="module")
def hf(served_model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_model_dir)
    model = AutoModelForCausalLM.from_pretrained(served_model_dir, torch_dtype=torch.float32)

    def greedy(ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.eval().generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
        return out[0, len(ids) :].tolist()

    return tok, greedy


def wait_idle(address: str) -> dict:
    with Client(address, timeout_s=30) as c:
        for _ in range(300):
            st = c.stats()
            if st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0:
                return st
            time.sleep(0.1)
    raise AssertionError("the cluster did not go idle")


def test_long_prompts_prefill_on_one_worker_and_decode_on_the_other(disagg_cluster, hf) -> None:
    import ray

    handle, _ = disagg_cluster
    tok, greedy = hf
    long = [tok(DOC)["input_ids"], tok("Notes. " + DOC)["input_ids"]]
    short = [tok(q)["input_ids"] for q in SHORT]
    assert all(len(p) >= 48 for p in long) and all(len(p) < 48 for p in short)
    prompts = long + short
    kw = dict(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    def one(i: int):
        with Client(handle.address, timeout_s=600) as c:
            return c.generate(token_ids=prompts[i], n=2 if i == 0 else 1, **kw)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    for i, r in enumerate(results):
        ref = greedy(prompts[i])
        assert [ch.token_ids for ch in r.choices] == [ref] * (2 if i == 0 else 1), i
    st = wait_idle(handle.address)
    sw = st["swap"]
    # one group per long request moved through the store, nothing preempted by swap
    assert sw["num_swap_outs"] == sw["num_swap_ins"] == len(long)
    assert sw["swap_out_bytes"] == sw["swap_in_bytes"] > 0
    assert sw["preemptions_by_mode"].get("swap", 0) == 0 and sw["num_swap_failures"] == 0
    assert sw["host_blocks_free"] == sw["host_blocks_total"]
    w0, w1 = st["workers"]
    assert (w0["num_swap_outs"], w0["num_swap_ins"]) == (len(long), 0)
    assert (w1["num_swap_outs"], w1["num_swap_ins"]) == (0, len(long))
    assert w0["num_free_blocks"] == w0["num_blocks"] and w1["num_free_blocks"] == w1["num_blocks"]
    assert st["num_preemptions"] > 0  # 10-block pools
    (store,) = handle.host_stores.values()
    assert ray.get(store.used_bytes.remote()) == 0
