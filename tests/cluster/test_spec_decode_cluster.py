"""Speculative decoding through the real server (embedded Ray, one worker, tiny random
Llama): greedy ids equal the offline engine's without speculation, GetStats carries the
counters, beam search is refused with INVALID_ARGUMENT, and every block is free after."""

from __future__ import annotations

import grpc
import pytest
from tiny_cluster import assert_all_blocks_free, running_cluster

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.client import Client
from pagedserve.scheduler.config import SchedulerConfig, SpeculativeConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42],
    [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8],
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_through_the_server_equals_plain(tiny_llama_dir, method):
    with LLM(
        str(tiny_llama_dir), block_size=16, num_gpu_blocks=64, device="cpu", dtype="float32"
    ) as llm:
        want = [
            list(o.outputs[0].token_ids)
            for o in llm.generate(
                PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            )
        ]
    draft = str(tiny_llama_dir) if method == "draft" else None  # the target as its draft
    config = SchedulerConfig(
        speculative_config=SpeculativeConfig(method, 3, 1, 3, draft_model=draft)
    )
    with running_cluster(tiny_llama_dir, scheduler=config) as (handle, _):
        c = Client(handle.address, timeout_s=120)
        with c:
            greedy = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
            got = [list(c.generate(token_ids=p, **greedy).choices[0].token_ids) for p in PROMPTS]
            assert got == want
            sd = c.stats()["spec_decode"]
            assert sd["num_drafts"] > 0 and sd["num_draft_tokens"] >= sd["num_accepted_tokens"]
            if method == "draft":
                assert sd["num_accepted_tokens"] == sd["num_draft_tokens"]
            with pytest.raises(grpc.RpcError) as err:
                c.generate(token_ids=PROMPTS[0], max_tokens=4, beam_width=2)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "speculative" in err.value.details()
            assert_all_blocks_free(handle, c)
