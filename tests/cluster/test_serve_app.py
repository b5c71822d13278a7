"""pagedserve as a Ray Serve application: `serve run` of deploy/serve_config.yaml (loopback).

`serve run` starts its own local Ray and Serve (controller + HTTP proxy) and deploys
cluster/serve_app.py: the OpenAI API, /metrics and /health answer through Serve's proxy from
two HTTP frontend replicas attached to one pagedserve cluster, whose replica serves gRPC on
its port. Ctrl-C (SIGINT) must take everything down. Runs in its own session so no other Ray
instance is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

from pagedserve.cluster.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout_s: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.status, r.read().decode()


def _default_sigint() -> None:
    """In the child: take SIGINT's default action back. A shell running this suite in the
    background starts it with SIGINT ignored, and children inherit that, so `serve run`
    would never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _name(p: psutil.Process) -> str:
    """The process name without the method Ray adds to an actor's title while a call
    runs (the scheduler actor always has one running: the frontend's output stream)."""
    try:
        return p.name().split(".", 1)[0]
    except psutil.Error:
        return ""


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def test_serve_run_serves_http_and_grpc_from_one_cluster(tmp_path: Path):
    if not (BIN / "serve").exists():
        pytest.skip("the Ray Serve CLI is not installed next to this interpreter")
    http_port, grpc_port = _free_port(), _free_port()
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = http_port
    cfg["applications"][0]["args"]["serve_args"] = (
        f"--host 127.0.0.1 --port {grpc_port} --num-blocks 64 --cpus-per-worker 1 --device cpu"
    )
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{BIN}:{env.get('PATH', '')}",
    )
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(BIN / "serve"), "run", str(config_path)],
        env=env,
        cwd=tempfile.gettempdir(),  # nothing relative to the checkout
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    seen: dict[int, psutil.Process] = {}

    def descendants() -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        return [p for p in seen.values() if p.is_running()]

    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # Serve starts, the replica starts the worker + scheduler actors
            descendants()
            with contextlib.suppress(OSError):
                if _http(f"{base}/health")[0] == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise AssertionError(
                    "serve run did not serve: " + (tmp_path / "serve.log").read_text()[-3000:]
                )
            time.sleep(1.0)

        status, body = _http(
            f"{base}/v1/completions",
            {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            timeout_s=120,
        )
        assert status == 200
        http_text = json.loads(body)["choices"][0]["text"]
        # Both frontend replicas are up (attached to the one scheduler), and requests spread
        # over them by Serve's proxy all get the same greedy text.
        frontends = [
            p for p in descendants()
            if _cmdline(p).startswith("ray::ServeReplica:pagedserve:PagedServeDeployment")
        ]  # fmt: skip
        assert len(frontends) == 2, [_cmdline(p) for p in descendants()]
        body_8 = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8,
                  "temperature": 0}  # fmt: skip
        with ThreadPoolExecutor(6) as pool:
            many = list(pool.map(lambda _: _http(f"{base}/v1/completions", body_8, 120), range(6)))
        assert [json.loads(b)["choices"][0]["text"] for _, b in many] == [http_text] * 6
        with Client(f"127.0.0.1:{grpc_port}", timeout_s=120) as c:
            r = c.generate(prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text == http_text and len(r.choices[0].token_ids) == 8
        # Every request was counted by the one scheduler behind both surfaces (8 x 8 tokens).
        _, metrics = _http(f"{base}/metrics")
        line = 'pagedserve:generation_tokens_total{model_name="SmolLM2-135M-Instruct"} 64.0'
        assert line in metrics, [m for m in metrics.splitlines() if "generation_tokens" in m]
        names = {_name(p) for p in descendants()}
        assert {"ray::Worker", "ray::SchedulerActor"} <= names, names
    finally:
        descendants()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: serve run shuts Serve and Ray down
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=60)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        log.close()
    assert not [_name(p) for p in alive], "processes left running after Ctrl-C"
    for port in (grpc_port, http_port):
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
