"""An HTTP server under test in its own process: started, waited for, stopped by its PID.

``serving/vllm_bench.py`` runs ``pagedserve serve`` and ``vllm serve`` through this, one at
a time: :func:`start_server` starts the command in a new session (its own process group)
with its output in a log file, :func:`wait_healthy` polls ``GET /health`` until it answers
200 (bounded; it fails early when the process exits), and :func:`stop_server` sends SIGTERM
to that process group, waits, then SIGKILLs whatever of the group and of the descendants
recorded before the SIGTERM is still alive (by PID: nothing else on the machine is touched).

A script imports it after putting this folder on its path (see ``workloads.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session with ``env`` (the whole environment) in ``cwd``;
    stdout and stderr go to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, env=env, cwd=str(cwd), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, poll_s: float = 1.0
) -> float:
    """Poll ``url`` until it answers 200; returns the seconds waited.

    Raises:
        RuntimeError: when the process exits first (with its return code).
        TimeoutError: when ``timeout_s`` passes without a 200.
    """
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with rc {proc.returncode} before {url} was up")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=5) as r,
        ):
            if r.status == 200:
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(poll_s)


def _descendants(pid: int) -> list[tuple[int, float]]:
    """(PID, creation time) of every descendant of ``pid`` (none without psutil)."""
    try:
        import psutil
    except ImportError:
        return []
    try:
        return [(p.pid, p.create_time()) for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _kill_if_same(pid: int, created: float) -> None:
    """SIGKILL ``pid`` only if it is still the process created at ``created`` (not a
    reused PID)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        if p.create_time() == created:
            p.kill()


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> int | None:
    """SIGTERM the server's process group, wait up to ``grace_s``, then SIGKILL what is left
    of the group and of the descendants seen before the SIGTERM; returns its return code."""
    if proc.poll() is not None:
        return proc.returncode
    kids = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # the group leader's PID is the group's id
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid, created in kids:
        _kill_if_same(pid, created)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    return proc.returncode
