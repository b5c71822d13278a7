"""Graceful shutdown of `pagedserve serve` (a subprocess, tiny random Llama, free ports):
SIGTERM refuses new requests (UNAVAILABLE, health NOT_SERVING), lets a short request in
flight finish, aborts a long one at --drain-timeout, exits 0, leaves no process behind,
and its port is free again at once (TIME-WAIT leftovers do not refuse a restart)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import build_tiny_model

from pagedserve.cluster.client import Client
from pagedserve.cluster.frontend import check_port_free

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
GREEDY = dict(temperature=0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> int | None:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = health_pb2.HealthCheckRequest(service="")
            return health_pb2_grpc.HealthStub(ch).Check(req, timeout=2).status
    except grpc.RpcError:
        return None


def _http_health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(tmp_path: Path):
    model = build_tiny_model(tmp_path / "tiny4k", max_position_embeddings=4096)
    port, http_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [str(BIN / "pagedserve"), "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--http-port", str(http_port), "--num-blocks", "512", "--max-model-len", "4096"]
    cmd += ["--device", "cpu", "--cpus-per-worker", "1", "--drain-timeout", "1.5"]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    seen: dict[int, psutil.Process] = {}

    def descendants() -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)

    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        deadline = time.monotonic() + 180
        while _health(port) != serving:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        with Client(f"127.0.0.1:{port}", timeout_s=120) as c:
            short = c.stream("Tell me a joke.", max_tokens=30, **GREEDY)
            long = c.stream("Tell me a long story.", max_tokens=3500, **GREEDY)
            short_toks, long_toks = list(next(short).token_ids), list(next(long).token_ids)
            descendants()
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while _health(port) == serving:
                assert time.monotonic() - t0 < 2, "health still SERVING after SIGTERM"
                time.sleep(0.02)
            assert _health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _http_health(http_port) == 503
            with pytest.raises(grpc.RpcError) as err:
                c.generate("Hi", max_tokens=2, **GREEDY)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in err.value.details()
            for d in short:
                short_toks.extend(d.token_ids)
                last_short = d
            for d in long:
                long_toks.extend(d.token_ids)
                last_long = d
        assert last_short.finish_reason == "length" and len(short_toks) == 30
        assert last_long.finish_reason == "abort" and len(long_toks) < 3500
        assert proc.wait(timeout=60) == 0
        text = (tmp_path / "serve.log").read_text()
        assert "draining" in text and "aborted 1 request(s)" in text, text[-3000:]
        # Worker names, not handles, in the scheduler's constructor: no warning from Ray
        # (ray-project/ray#53727) at each start.
        assert "constructor arguments in the object store" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    _, alive = psutil.wait_procs(list(seen.values()), timeout=30)
    for p in alive:  # only processes this server started, by pid
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"
    assert seen, "the server had no child processes (Ray)"
    check_port_free("127.0.0.1", port)  # a restart right away may bind again
    check_port_free("127.0.0.1", http_port)
