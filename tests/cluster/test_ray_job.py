"""`ray job submit` of the job entrypoint on a `ray start --head` cluster (loopback only).

The head runs with ``--block`` in its own session on free ports and a private temp dir, so
the test never touches another Ray instance on the machine (no `ray stop`, which would end
every Ray process of the user): it is stopped by signalling that one process, whose
reaper ends the cluster's processes, and the test then checks that every process the
cluster ever had is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pagedserve.cluster.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB_ID = "pagedserve-test-job"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{BIN}:{env.get('PATH', '')}",  # the job's `python` is this interpreter
    )
    return env


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.status, r.read().decode()


def _ray(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ray"), *args],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


class Head:
    """A `ray start --head --block` process and every process it ever had below it."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.dashboard_port = _free_port()
        ports = {
            "--port": _free_port(),
            "--dashboard-port": self.dashboard_port,
            "--node-manager-port": _free_port(),
            "--object-manager-port": _free_port(),
            "--ray-client-server-port": _free_port(),
            "--dashboard-agent-listen-port": _free_port(),
            "--dashboard-agent-grpc-port": _free_port(),
            "--runtime-env-agent-port": _free_port(),
            "--metrics-export-port": _free_port(),
        }
        cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
        cmd += ["--dashboard-host", "127.0.0.1", "--num-cpus", "2", "--temp-dir", tmp]
        cmd += ["--disable-usage-stats", "--include-dashboard", "true"]
        for flag, port in ports.items():
            cmd += [flag, str(port)]
        self.log = open(Path(tmp) / "head.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.seen: dict[int, psutil.Process] = {}

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def descendants(self) -> list[psutil.Process]:
        """The head's live descendants (remembered, so leftovers can be found later)."""
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            self.seen.setdefault(p.pid, p)
        return procs

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                if _get(f"{self.address}/api/version")[0] == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "ray head did not start: " + (Path(self.tmp) / "head.log").read_text()[-2000:]
                )
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> list[psutil.Process]:
        """SIGTERM the head (its reaper ends the cluster); returns processes still alive."""
        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=timeout_s)
        for p in alive:  # only processes this head started, by pid
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.log.close()
        return alive


@pytest.fixture()
def ray_head() -> Iterator[Head]:
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("the ray CLI is not installed next to this interpreter")
    tmp = tempfile.mkdtemp(prefix="psray", dir="/tmp")  # short: Ray's socket paths
    head = Head(tmp)
    try:
        head.wait_ready()
        yield head
    finally:
        leftover = head.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not leftover, f"processes left running: {[p.pid for p in leftover]}"


def _name(p: psutil.Process, cmdline: bool = False) -> str:
    try:
        return " ".join(p.cmdline()) if cmdline else p.name()
    except psutil.Error:  # exited meanwhile
        return ""


def _job_status(head: Head) -> str:
    out = _ray("job", "status", "--address", head.address, JOB_ID, timeout_s=60)
    text = out.stdout + out.stderr
    for status in ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"):
        if status.lower() in text.lower():
            return status
    return "UNKNOWN:" + text[-300:]


def _job_logs(head: Head) -> str:
    return _ray("job", "logs", "--address", head.address, JOB_ID, timeout_s=60).stdout


def test_ray_job_submit_serves_grpc_and_stops_cleanly(ray_head: Head):
    grpc_port, http_port = _free_port(), _free_port()
    submit = _ray(
        "job", "submit", "--address", ray_head.address, "--submission-id", JOB_ID, "--no-wait",
        "--runtime-env", "deploy/runtime_env.yaml", "--",
        "python", "-m", "pagedserve.cluster.job", "serve", "--port", str(grpc_port),
        "--http-port", str(http_port), "--num-blocks", "64", "--cpus-per-worker", "1",
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr

    deadline = time.monotonic() + 240
    while True:  # the job's driver starts the scheduler + worker actors and both frontends
        with contextlib.suppress(OSError):
            if _get(f"http://127.0.0.1:{http_port}/health")[0] == 200:
                break
        status = _job_status(ray_head) if time.monotonic() > deadline - 200 else "RUNNING"
        if status in ("FAILED", "SUCCEEDED", "STOPPED") or time.monotonic() > deadline:
            raise AssertionError(f"job not serving ({status}): {_job_logs(ray_head)[-3000:]}")
        time.sleep(1.0)

    with Client(f"127.0.0.1:{grpc_port}", timeout_s=120) as c:
        r = c.generate(token_ids=[1, 2, 3, 4], max_tokens=4, temperature=0, ignore_eos=True)
    assert len(r.choices[0].token_ids) == 4 and r.choices[0].finish_reason == "length"
    _, text = _get(f"http://127.0.0.1:{http_port}/metrics")
    assert 'pagedserve:generation_tokens_total{model_name="SmolLM2-135M-Instruct"} 4.0' in text
    names = {_name(p) for p in ray_head.descendants()}
    assert {"ray::Worker", "ray::SchedulerActor", "ray::JobSupervisor"} <= names, names

    stop = _ray("job", "stop", "--address", ray_head.address, JOB_ID, timeout_s=90)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert _job_status(ray_head) == "STOPPED"
    logs = _job_logs(ray_head)
    assert "pagedserve: stopped" in logs, logs[-3000:]  # SIGTERM handled, not SIGKILLed

    # Nothing of the job is left: no driver, no actors, and both ports are closed.
    deadline = time.monotonic() + 30
    while True:
        left = [
            _name(p)
            for p in ray_head.descendants()
            if _name(p) in ("ray::Worker", "ray::SchedulerActor", "ray::JobSupervisor")
            or "pagedserve.cluster.job" in _name(p, cmdline=True)
        ]
        if not left:
            break
        assert time.monotonic() < deadline, f"still running after ray job stop: {left}"
        time.sleep(0.5)
    for port in (grpc_port, http_port):
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
