"""Two real Ray nodes on one machine, for the multi-node tests.

Node A runs in this machine's network namespace; node B runs in its own network namespace
(``ip netns add``, its own loopback, joined to A by a veth pair with an address on each end)
and its own mount namespace (``unshare --mount``: a tmpfs over B's Ray temp dir, and over
``hidden_dir`` so files there exist on A only). Each node is one ``ray start --block``
with ``--num-cpus 1`` and a custom resource (``node_a`` / ``node_b``) that places actors
(node B also has ``sched_b``, for the scheduler actor).

Every name (namespace, veth, temp dirs, subnet) is unique per run, so runs side by side do
not collide. Everything started is stopped by process group and PID; ``ray stop`` is never
used (it would end every Ray process on the machine). Needs root, ``ip`` and ``unshare``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

RAY_BIN = Path(sys.executable).with_name("ray")
NODE_WAIT_S = 90.0

# Ray must advertise the veth addresses (not loopback) on both nodes and in every driver.
RAY_NODE_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}


def cannot_make_namespaces() -> str | None:
    """Why two nodes cannot be built here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network and mount namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not RAY_BIN.exists():
        return f"no `ray` command next to {sys.executable}"
    probe = f"psprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def _free_subnet() -> tuple[str, str]:
    """Two addresses of a /30 in 10.200.0.0/13 that no interface here uses."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for _ in range(100):
        base = (
            f"10.{random.randint(200, 207)}.{random.randint(0, 255)}.{random.randrange(0, 252, 4)}"
        )
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        a, b = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
        if a not in used and b not in used:
            return a, b
    raise RuntimeError("no free 10.200.0.0/13 subnet")


@dataclass
class TwoNodes:
    """Node A (head, this namespace) and node B (own network + mount namespaces).

    Attributes:
        ip_a / ip_b: the veth addresses of A and B.
        gcs_address: ``ip_a:port`` of the head (``serve --address``).
        hidden_dir: a folder B sees as empty (a tmpfs over it in B's mount namespace).
        netns: B's network namespace.
    """

    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}{random.randrange(16**4):04x}")
    ip_a: str = ""
    ip_b: str = ""
    gcs_address: str = ""
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ps2n-")))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def netns(self) -> str:
        return f"ps2n{self.tag}"

    @property
    def veth_a(self) -> str:
        """A's end of the veth pair (in this namespace)."""
        return f"psa{self.tag}"

    @property
    def hidden_dir(self) -> Path:
        return self.root / "hidden"

    def temp_dir(self, node: str) -> Path:
        # Short: Ray's unix socket paths live under it (108-byte limit).
        return Path(f"/tmp/r2n{self.tag}{node}")

    def env(self) -> dict[str, str]:
        """Environment for drivers and nodes of this cluster."""
        return {**os.environ, **RAY_NODE_ENV}

    def start(self) -> None:
        """Make the namespace and link, start both nodes, wait until Ray sees two."""
        self.hidden_dir.mkdir()
        veth_a, veth_b = self.veth_a, f"psb{self.tag}"
        self.ip_a, self.ip_b = _free_subnet()
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _run("ip", "link", "set", veth_b, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.ip_a}/30", "dev", veth_a)
        _run("ip", "link", "set", veth_a, "up")
        ns = ("ip", "netns", "exec", self.netns)
        _run(*ns, "ip", "addr", "add", f"{self.ip_b}/30", "dev", veth_b)
        _run(*ns, "ip", "link", "set", veth_b, "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        port = free_port(self.ip_a)
        self.gcs_address = f"{self.ip_a}:{port}"
        common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
        for node in "ab":
            self.temp_dir(node).mkdir(parents=True, exist_ok=True)
        head = [
            str(RAY_BIN), "start", "--head", *common, "--include-dashboard", "false",
            "--node-ip-address", self.ip_a, "--port", str(port),
            "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()),
            "--resources", json.dumps({"node_a": 1}),
            "--temp-dir", str(self.temp_dir("a")),
        ]  # fmt: skip
        self._spawn(head, "a")
        self.wait_nodes(1)
        self._start_node_b()
        self.wait_nodes(2)

    def _start_node_b(self) -> None:
        common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
        worker = [
            str(RAY_BIN), "start", *common, "--address", self.gcs_address,
            "--node-ip-address", self.ip_b,
            "--resources", json.dumps({"node_b": 1, "sched_b": 1}),
            "--temp-dir", str(self.temp_dir("b")),
        ]  # fmt: skip
        mounts = (
            f"mount -t tmpfs tmpfs {self.temp_dir('b')} && "
            f"mount -t tmpfs tmpfs {self.hidden_dir} && exec {' '.join(map(repr, worker))}"
        )
        ns = ("ip", "netns", "exec", self.netns)
        self._spawn(
            [*ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", mounts], "b"
        )

    def ensure_node_b(self) -> None:
        """Node B up: when its raylet is gone (a test killed it), every process left in B's
        namespace is killed by PID, Ray waited on to see one node, and B started afresh
        (new node id, empty temp dir and hidden folder) until Ray sees two."""
        if self._raylet_b() is not None and self.alive_nodes() >= 2:
            return
        for pid in self.netns_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        head, *old_b = self.procs
        for p in old_b:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        self.procs = [head]
        deadline = time.monotonic() + NODE_WAIT_S
        while self.alive_nodes() > 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node B still alive in Ray's view after {NODE_WAIT_S:.0f} s")
            time.sleep(1.0)
        self._start_node_b()
        self.wait_nodes(2)

    @contextlib.contextmanager
    def link_down(self) -> Iterator[None]:
        """A's end of the veth pair down (B unreachable, no connection reset) for the
        ``with`` body; up again after, even on failure."""
        _run("ip", "link", "set", self.veth_a, "down")
        try:
            yield
        finally:
            _run("ip", "link", "set", self.veth_a, "up")

    def _spawn(self, cmd: list[str], node: str) -> None:
        log = open(self.root / f"node-{node}.log", "wb")  # noqa: SIM115 - closed by the child
        self.procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )
        )
        log.close()

    def alive_nodes(self) -> int:
        """Alive nodes in Ray's view (asked from a short-lived driver)."""
        code = f"import ray; ray.init(address={self.gcs_address!r}, log_to_driver=False); "
        code += "print('alive-nodes:', sum(n['Alive'] for n in ray.nodes()))"
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=self.env(), timeout=60
        )
        # Ray may print warnings (e.g. "raylet has lagging heartbeats") on stdout too.
        counts = [
            line.split(":", 1)[1] for line in done.stdout.splitlines()
            if line.startswith("alive-nodes:")
        ]  # fmt: skip
        return int(counts[-1]) if done.returncode == 0 and counts else 0

    def wait_nodes(self, count: int, timeout_s: float = NODE_WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a node exited ({p.returncode}): {self.logs()}")
            try:
                if self.alive_nodes() >= count:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{count} Ray node(s) not up after {timeout_s:.0f} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- node {n}:\n" + (self.root / f"node-{n}.log").read_text(errors="replace")[-3000:]
            for n in "ab"
            if (self.root / f"node-{n}.log").exists()
        )

    def netns_pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def _raylet_b(self) -> int | None:
        for pid in self.netns_pids():
            try:
                exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if exe.endswith(b"/raylet"):
                return pid
        return None

    def actor_pids_b(self, class_name: str) -> list[int]:
        """PIDs of node B's worker processes running an actor of ``class_name`` (Ray titles
        them ``ray::CLASS``, ``ray::CLASS.method`` while one runs)."""
        title = f"ray::{class_name}".encode()
        pids = []
        for pid in self.netns_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(title) and cmdline[len(title) : len(title) + 1] in b".\0 ":
                pids.append(pid)
        return pids

    def raylet_pid_b(self) -> int:
        """The PID of node B's raylet; RuntimeError when it has none."""
        pid = self._raylet_b()
        if pid is None:
            raise RuntimeError("node B has no raylet")
        return pid

    def _own_pids(self) -> list[int]:
        """Processes whose command line names this run's temp dirs (Ray's own children)."""
        marks = [str(self.temp_dir(n)).encode() for n in "ab"]
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(m in cmd for m in marks):
                pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        """Stop every process started (by group and PID), delete the namespace and link."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for _ in range(2):
            for pid in {*self.netns_pids(), *self._own_pids()}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.5)
        subprocess.run(["ip", "link", "delete", f"psa{self.tag}"], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
        for node in "ab":
            shutil.rmtree(self.temp_dir(node), ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
