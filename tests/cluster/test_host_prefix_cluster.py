"""The host tier of the prefix cache through the real server: Ray, the store actor, gRPC.

A one-worker cluster on the tiny model with a 16-block pool (block size 16), 64 MiB of
swap space and ``preemption_mode="swap"`` (every host hit is loaded) serves multi-turn conversations (each turn resends the conversation with its
last answer and a new user turn), more of them than the pool keeps. With the tier (the
default whenever a store runs) later turns load their evicted prefix from the host store;
greedy tokens equal those of a cluster started with ``host_prefix_cache=False``, and the
tier's counters reach GetStats.
"""

from __future__ import annotations

import pytest
from tiny_cluster import assert_all_blocks_free, running_cluster

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import SchedulerConfig

pytestmark = pytest.mark.slow

KW = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


def conversations(model_dir, tier: bool) -> tuple[list[list[int]], dict]:
    """Four conversations, three turns each, sent one request at a time; the answers and
    the final GetStats."""
    convs = [[1, 10 + c, *range(20 + 7 * c, 60 + 7 * c)] for c in range(4)]
    answers: list[list[int]] = []
    # NOTE: swap loads every host hit; under auto the tiny model's prefill is cheaper
    # than moving its blocks through the store on this machine, so nothing would load.
    scheduler = SchedulerConfig(preemption_mode="swap", host_prefix_cache=tier)
    cluster = running_cluster(model_dir, num_blocks=16, scheduler=scheduler, swap_space=64 << 20)
    with cluster as (handle, _), Client(handle.address, timeout_s=120) as c:
        for turn in range(3):
            for i, conv in enumerate(convs):
                out = c.generate(token_ids=conv, **KW).choices[0].token_ids
                answers.append(out)
                conv.extend([*out, 3, 70 + turn, 80 + i, *range(90, 100)])
        assert_all_blocks_free(handle, c)
        return answers, c.stats()


def test_resent_conversations_hit_the_host_tier_and_equal_no_tier(tiny_llama_dir) -> None:
    ref, off = conversations(tiny_llama_dir, tier=False)
    got, on = conversations(tiny_llama_dir, tier=True)
    assert got == ref
    hp = on["swap"]["host_prefix"]
    assert hp["enabled"] and hp["num_spills"] > 0 and hp["num_hit_tokens"] > 0, on["swap"]
    assert hp["num_hit_blocks"] * 16 == hp["num_hit_tokens"] and hp["num_failures"] == 0
    assert hp["load_bytes"] > 0 and hp["load_seconds"] > 0
    assert not off["swap"]["host_prefix"]["enabled"]
