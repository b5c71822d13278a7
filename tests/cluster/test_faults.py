"""Faults through a real in-process cluster (embedded Ray, two CPU workers, tiny random
Llama): a worker actor killed mid-generation, the scheduler actor killed, Abort right
after Generate, a request id reused right after a cancel, a non-streaming HTTP client that
disconnects. Every wait is bounded."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import LoopThread, build_tiny_model

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import (
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pagedserve.cluster.launcher import RAY_ENV, ClusterHandle, start_cluster

pytestmark = pytest.mark.slow

NUM_BLOCKS = 512
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[tuple[ClusterHandle, LoopThread]]:
    model = build_tiny_model(tmp_path_factory.mktemp("tiny4k"), max_position_embeddings=4096)
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model=str(model), max_model_len=4096, dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=1),  # one running per worker, others queue
        server=ServerConfig(host="127.0.0.1", port=0, http_port=0, max_stream_buffer=64),
        num_workers=2,
        cpus_per_worker=0,  # schedulable next to another test cluster in this process
        device="cpu",
        worker_max_restarts=2,
        scheduler_max_restarts=2,
    )
    lt = LoopThread()
    handle = lt.run(start_cluster(config))
    try:
        yield handle, lt
    finally:
        lt.run(handle.stop(), timeout=60)
        lt.close()


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def all_free(address: str) -> bool:
    with Client(address, timeout_s=10) as c:
        st = c.stats()
    idle = st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0
    return idle and all(w["num_free_blocks"] == w["num_blocks"] for w in st["workers"])


def test_abort_right_after_generate_is_never_lost(tiny):
    """The reported race: with both workers busy (max_num_seqs 1), Generate then Abort
    within ~10 ms, 8 times: every abort is answered True and ends its request."""
    handle, _ = tiny
    with Client(handle.address, timeout_s=60) as c:
        busy = [
            threading.Thread(target=lambda: c.generate("load", max_tokens=600, **GREEDY))
            for _ in range(2)
        ]
        for t in busy:
            t.start()
        wait_for(lambda: c.stats()["num_requests_running"] == 2, 30, "both workers busy", 0.01)
        with ThreadPoolExecutor(1) as ex:
            for i in range(8):
                rid = f"race-{i}"
                fut = ex.submit(
                    c.generate, "Tell me a joke.", request_id=rid, max_tokens=8, **GREEDY
                )
                time.sleep(0.01)
                assert c.abort(rid) is True, rid
                choice = fut.result(timeout=30).choices[0]
                assert choice.finish_reason == "abort" and choice.token_ids == []
        for t in busy:
            t.join(60)
    wait_for(lambda: all_free(handle.address), 10, "blocks freed")


def test_request_id_reused_right_after_a_client_cancel(tiny):
    handle, _ = tiny
    with Client(handle.address, timeout_s=60) as c:
        for _ in range(20):
            stream = c.stream("Tell me a joke.", request_id="reuse", max_tokens=500, **GREEDY)
            assert next(stream).token_ids
            stream.close()  # cancels the call; the id is reused at once
        r = c.generate("Tell me a joke.", request_id="reuse", max_tokens=4, **GREEDY)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].token_ids) == 4
    wait_for(lambda: all_free(handle.address), 10, "blocks freed")


def test_non_streaming_http_client_that_disconnects_is_aborted(tiny):
    handle, _ = tiny
    snap0 = ray.get(handle.scheduler.get_metrics.remote(), timeout=30)
    body = {"model": handle.info.name, "prompt": "Once upon a time", "max_tokens": 3000}
    body["ignore_eos"] = True  # runs to max_tokens unless aborted
    try:
        r = httpx.post(f"http://{handle.http_address}/v1/completions", json=body, timeout=1.0)
        raise AssertionError(f"answered before the client gave up: {r.status_code} {r.text}")
    except httpx.ReadTimeout:
        pass  # the client gives up and closes the connection
    t0 = time.monotonic()
    wait_for(lambda: all_free(handle.address), 10, "the request to be aborted")
    snap = ray.get(handle.scheduler.get_metrics.remote(), timeout=30)
    assert snap.generation_tokens - snap0.generation_tokens < 3000
    assert time.monotonic() - t0 < 10


def test_killed_worker_requests_finish_elsewhere_and_it_rejoins(tiny):
    handle, _ = tiny
    prompts = [f"Tell me joke number {i}." for i in range(4)]

    def run(prompt: str, started: threading.Event | None = None):
        with Client(handle.address, timeout_s=120) as c:
            toks, last = [], None
            for d in c.stream(prompt, max_tokens=200, **GREEDY):
                toks.extend(d.token_ids)
                last = d
                if started is not None:
                    started.set()
            return toks, last

    with ThreadPoolExecutor(4) as ex:
        refs = [r[0] for r in ex.map(run, prompts)]
    events = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(run, p, e) for p, e in zip(prompts, events)]
        for e in events:
            assert e.wait(60)
        ray.kill(handle.workers[0], no_restart=False)  # Ray restarts it (max_restarts 2)
        results = [f.result(timeout=120) for f in futs]
    for (toks, last), ref in zip(results, refs):
        assert toks == ref  # recomputed on worker 1: the same greedy tokens
        assert last.finish_reason == "length"
    assert sum(last.usage["num_preemptions"] for _, last in results) >= 1
    assert health(handle.address) == health_pb2.HealthCheckResponse.SERVING

    def both_alive():
        with Client(handle.address, timeout_s=10) as c:
            st = c.stats()
        return [w["alive"] for w in st["workers"]] == [True, True] and st

    t_kill = time.monotonic()
    st = wait_for(both_alive, 60, "worker 0 to be restarted and rejoin", poll_s=0.5)
    print(f"worker 0 back in service {time.monotonic() - t_kill:.1f} s after the requests ended")
    assert st["workers"][0]["num_free_blocks"] == NUM_BLOCKS  # an empty pool
    seen_on_0 = []

    def poll():
        with Client(handle.address, timeout_s=10) as c:
            while not done.is_set():
                seen_on_0.append(c.stats()["workers"][0]["num_requests_running"])
                time.sleep(0.02)

    done = threading.Event()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with ThreadPoolExecutor(4) as ex:
        again = list(ex.map(run, prompts))
    done.set()
    poller.join(10)
    assert [r[0] for r in again] == refs
    assert max(seen_on_0) > 0  # routed to again
    assert health(handle.address) == health_pb2.HealthCheckResponse.SERVING
    wait_for(lambda: all_free(handle.address), 10, "blocks freed")


def test_killed_scheduler_gives_unavailable_at_once_and_comes_back(tiny):
    handle, _ = tiny
    with Client(handle.address, timeout_s=60) as c:
        ref = c.generate("Tell me a joke.", max_tokens=16, **GREEDY).choices[0].token_ids
        stream = c.stream("Tell me a long story.", max_tokens=3000, **GREEDY)
        assert next(stream).token_ids
        t_kill = time.monotonic()
        ray.kill(handle.scheduler, no_restart=False)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        in_flight_s = time.monotonic() - t_kill
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert in_flight_s < 1.0
        # A new request now is refused at once, or already served by the restarted actor.
        t0 = time.monotonic()
        try:
            r = c.generate("Tell me a joke.", max_tokens=16, **GREEDY)
            assert r.choices[0].token_ids == ref
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            assert time.monotonic() - t0 < 1.0
    serving = health_pb2.HealthCheckResponse.SERVING
    wait_for(lambda: health(handle.address) == serving, 60, "SERVING again", poll_s=0.2)
    print(
        f"scheduler killed: stream UNAVAILABLE after {in_flight_s:.2f} s, "
        f"SERVING again after {time.monotonic() - t_kill:.1f} s"
    )
    with Client(handle.address, timeout_s=60) as c:
        r = c.generate("Tell me a joke.", max_tokens=16, **GREEDY)
    assert r.choices[0].token_ids == ref  # the restarted, empty scheduler serves
    wait_for(lambda: all_free(handle.address), 10, "blocks freed")


def test_client_that_stops_reading_is_aborted_with_resource_exhausted(tiny):
    """A gRPC client reads one message and stalls: once the transport's windows are full,
    the server holds at most max_stream_buffer (64) outputs, then aborts the request."""
    from pagedserve.cluster.client import build_request
    from pagedserve.v1 import generate_pb2_grpc as pb_grpc

    handle, _ = tiny
    snap0 = ray.get(handle.scheduler.get_metrics.remote(), timeout=30)
    # No BDP probing: the client's HTTP/2 window stays at its 64 KiB default.
    with grpc.insecure_channel(handle.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        req = build_request("Tell me a long story.", max_tokens=3000, logprobs=20, **GREEDY)
        call = pb_grpc.GenerationStub(ch).Generate(req, timeout=120)
        first = next(call)
        assert len(first.logprobs) == 1
        t0 = time.monotonic()
        wait_for(lambda: all_free(handle.address), 60, "the stalled request to be aborted")
        stalled_s = time.monotonic() - t0
        received = 1
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                received += 1
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "not reading" in err.value.details()
    snap = ray.get(handle.scheduler.get_metrics.remote(), timeout=30)
    generated = snap.generation_tokens - snap0.generation_tokens
    assert received < generated < 3000  # cut off, not run to max_tokens
    print(f"stalled client: {generated} tokens generated, {received} received, {stalled_s:.1f} s")
