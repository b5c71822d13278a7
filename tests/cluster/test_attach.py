"""Several frontends of one cluster (embedded Ray, one CPU worker, tiny random Llama): a
second frontend attached by the cluster's name streams at the same time as the first,
each request's tokens reach only its own frontend and equal an undisturbed run's, and
stopping the second frontend mid-stream aborts only its own requests."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import build_tiny_model
from tiny_cluster import running_cluster

from pagedserve.cluster.client import Client
from pagedserve.cluster.launcher import attach_frontend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "Hello"]


def streamed(address: str, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    with Client(address, timeout_s=120) as c:
        toks: list[int] = []
        reason = ""
        for d in c.stream(prompt, max_tokens=max_tokens, **GREEDY):
            toks.extend(d.token_ids)
            reason = d.finish_reason or reason
        return toks, reason


@pytest.fixture(scope="module")
def named_cluster(tmp_path_factory):
    """One named cluster for the module (one Ray session: the suite starts and stops fewer
    of them in this process)."""
    model = build_tiny_model(tmp_path_factory.mktemp("attach") / "tiny")
    with running_cluster(model, num_blocks=256, cluster_name="attach-test") as running:
        yield running


def test_attach_to_a_cluster_that_is_not_there(named_cluster):
    handle, lt = named_cluster
    cfg = dataclasses.replace(handle.config, cluster_name="no-such-cluster")
    with pytest.raises(RuntimeError, match="no pagedserve cluster named 'no-such-cluster'"):
        lt.run(attach_frontend(cfg), timeout=60)


def test_two_frontends_share_the_cluster(named_cluster):
    handle, lt = named_cluster
    with Client(handle.address, timeout_s=120) as c:
        refs = {p: c.generate(p, max_tokens=24, **GREEDY).choices[0].token_ids for p in PROMPTS}
    second = lt.run(attach_frontend(dataclasses.replace(handle.config)), timeout=60)
    try:
        assert second.address != handle.address and second.info == handle.info
        jobs = [(a, p) for p in PROMPTS for a in (handle.address, second.address)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda j: streamed(j[0], j[1], 24), jobs))
        for (_, p), (toks, reason) in zip(jobs, got, strict=True):
            assert toks == refs[p] and reason == "length", p
        # The second frontend stops while both have a request streaming.
        first_done: list[tuple[list[int], str]] = []
        t = threading.Thread(
            target=lambda: first_done.append(streamed(handle.address, PROMPTS[0], 200))
        )
        t.start()
        with Client(second.address, timeout_s=120) as c2:
            s2 = c2.stream(PROMPTS[1], max_tokens=200, **GREEDY)
            assert next(s2).token_ids
            lt.run(second.stop(), timeout=60)
            second = None
        t.join(120)
    finally:
        if second is not None:
            lt.run(second.stop(), timeout=60)
    with Client(handle.address, timeout_s=120) as c:
        long_ref = c.generate(PROMPTS[0], max_tokens=200, **GREEDY).choices[0].token_ids
        assert (
            c.generate(PROMPTS[2], max_tokens=24, **GREEDY).choices[0].token_ids
            == (refs[PROMPTS[2]])
        )
    assert first_done == [(long_ref, "length")]  # not aborted with the other frontend
