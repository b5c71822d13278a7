"""Swap preemption at tensor_parallel_size 2 through the real server: embedded Ray, one
logical worker of two rank actors (gloo on 127.0.0.1), the host block store actor, gRPC,
the tiny Llama (6 heads / 2 KV heads: one KV head per rank).

The cluster is configured by the ``serve`` command line with the default swap space
(4 GiB at any T) and ``--preemption-mode swap``: the store starts, its host blocks are
sized for both ranks' chunks, and the five prompts at once in a pool too small for them
are swap-preempted and resume with HF's greedy tokens; every device block is free and no
group stays swapped afterwards.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import TINY_PROMPTS, LoopThread, hf_greedy

from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.cluster.client import Client
from pagedserve.cluster.launcher import RAY_ENV, start_cluster

pytestmark = pytest.mark.slow
NEW = 12
# Only what the test environment needs; the swap flags stay at their defaults.
FLAGS = [
    "--tensor-parallel-size", "2",
    "--preemption-mode", "swap",
    # 14 blocks of 4 tokens: the five prompts at once (~76 tokens + outputs) preempt.
    "--block-size", "4",
    "--num-blocks", "14",
    "--max-model-len", "128",
    "--dtype", "float32",
    "--port", "0",
    "--http-port", "0",
    "--cpus-per-worker", "0",
    "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def tp_swap_cluster(tiny_llama_dir: Path):
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = serve_config(
        build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), *FLAGS])
    )
    assert config.swap_space == 4 << 30 and config.tensor_parallel_size == 2
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        yield handle
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


def generate(address: str, prompt: list[int]) -> list[int]:
    with Client(address, timeout_s=300) as c:
        result = c.generate(token_ids=prompt, max_tokens=NEW, temperature=0.0, ignore_eos=True)
        return list(result.choices[0].token_ids)


def wait_idle(address: str) -> dict:
    with Client(address, timeout_s=30) as c:
        for _ in range(300):
            st = c.stats()
            (w,) = st["workers"]
            if st["num_requests_running"] == 0 and w["num_free_blocks"] == w["num_blocks"]:
                return st
            time.sleep(0.1)
    raise AssertionError("the cluster did not go idle")


def test_default_swap_space_swaps_at_t2_and_resumes_equal_to_hf(
    tp_swap_cluster, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")
    expected = [hf_greedy(hf.eval(), p, NEW) for p in TINY_PROMPTS]
    address = tp_swap_cluster.address
    before = wait_idle(address)["swap"]
    assert before["preemption_mode"] == "swap" and before["num_swap_outs"] == 0
    # 4 GiB of host blocks that each hold both ranks' chunks: 2 layers x (K, V) x 4 tokens
    # x 1 KV head x 16 dims x 4 bytes = 1 KiB a rank.
    assert before["host_blocks_total"] == (4 << 30) // (2 * 1024)

    with ThreadPoolExecutor(len(TINY_PROMPTS)) as pool:
        got = list(pool.map(lambda p: generate(address, p), TINY_PROMPTS))
    assert got == expected
    st = wait_idle(address)
    sw = st["swap"]
    assert sw["preemptions_by_mode"]["swap"] > 0
    assert sw["num_swap_outs"] > 0 and sw["num_swap_failures"] == 0
    assert sw["swap_out_bytes"] > 0 and sw["swap_out_bytes"] % (2 * 1024) == 0
    assert sw["num_requests_swapped"] == 0
