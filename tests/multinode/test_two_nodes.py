"""Serving across two real Ray nodes (node B in its own network and mount namespaces).

The driver is ``pagedserve serve --address`` in a subprocess on node A, as a user runs it;
worker placement by ``--worker-resources`` (worker 0 on node B, worker 1 on node A). One
``serve`` runs at a time (one CPU per node): the swap cases share a class-scoped ``serve``,
the recompute cases the module's last one; the scheduler-restart case has its own. The cases that kill B's raylet end their
group; ``serving`` starts node B again when it is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import hf_greedy
from two_nodes import TwoNodes

from pagedserve.cluster.client import Client

pytestmark = pytest.mark.slow

MAX_TOKENS = 120
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
RECOMPUTE = ("--preemption-mode", "recompute", "--device", "cpu")
# A step unanswered for 3 s (or 10 x the worker's mean step) requeues its sequences.
DEADLINE = ("--step-deadline-floor", "3", "--step-deadline-factor", "10")
# 10 blocks of 16 per worker: three 125-token sequences (8 blocks each) cannot run side by
# side, so every worker preempts, and `swap` moves every victim to its node's host store.
SWAP = (
    "--preemption-mode", "swap", "--device", "cpu", "--swap-space", "0.25",
    "--num-blocks", "10", "--max-model-len", "160",
)  # fmt: skip
# Ray declares a node dead after 5 failed health checks 3 s apart at the soonest (Ray 2.60's
# health_check_failure_threshold and health_check_period_ms: 15 s); every request must
# finish, and the link be back, before that.
LINK_CUT_BOUND_S = 12.0
PROMPTS = [[1, 40 + i, 50 + 2 * i, 60 + 3 * i, 70] for i in range(6)]
START_S = 150.0


class ServeFailed(AssertionError):
    """``serve`` exited (or hung) before serving; the message holds the end of its output."""


def _serve_cmd(nodes: TwoNodes, model: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pagedserve.cluster.cli", "serve",
        "--address", nodes.gcs_address, "--model", str(model),
        "--port", "0", "--http-port", "0", "--num-blocks", "64", "--max-model-len", "256",
        "--workers", "2", "--worker-resources", '[{"node_b": 1}, {"node_a": 1}]',
        "--startup-timeout", "120", "--dtype", "float32", *extra,
    ]  # fmt: skip


class Served(NamedTuple):
    """A running ``serve``: its gRPC address and the file its output goes to."""

    address: str
    log: Path


@contextmanager
def serving(nodes: TwoNodes, model: Path, *extra: str) -> Iterator[Served]:
    """``serve`` running (node B started again first when a test killed it); yields its
    address and log; SIGTERM (then SIGKILL) by PID after."""
    nodes.ensure_node_b()
    log = nodes.root / f"serve-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _serve_cmd(nodes, model, *extra), stdout=out, stderr=subprocess.STDOUT, env=nodes.env()
        )
    try:
        deadline = time.monotonic() + START_S
        while True:
            text = log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("pagedserve: serving on "):
                    yield Served(line.split()[-4], log)
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServeFailed(f"serve did not start (rc {proc.poll()}):\n{text[-4000:]}")
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def hf_reference(tiny_model: Path) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).float().eval()
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def _greedy(address: str) -> list[list[int]]:
    with Client(address, timeout_s=120) as client:
        client.wait_ready(60)

        def one(prompt: list[int]) -> list[int]:
            r = client.generate(token_ids=prompt, **GREEDY)
            return list(r.choices[0].token_ids)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(one, PROMPTS))


def _streams(
    client: Client, pool: ThreadPoolExecutor, *, wait_first_tokens: bool = True
) -> list[Future[list[int]]]:
    """Every prompt streamed greedily; returns once each has its first token (60 s), or at
    once without ``wait_first_tokens``."""
    first_token = [0] * len(PROMPTS)

    def one(i: int) -> list[int]:
        out: list[int] = []
        for delta in client.stream(token_ids=PROMPTS[i], **GREEDY):
            out.extend(delta.token_ids)
            first_token[i] = len(out)
        return out

    futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
    deadline = time.monotonic() + 60
    while wait_first_tokens and not all(first_token) and time.monotonic() < deadline:
        time.sleep(0.02)
    return futures


def _running_on(client: Client, worker_id: int, futures: list[Future[list[int]]]) -> int:
    """Sequences worker ``worker_id`` runs, polled from ``GetStats`` until it runs one (or
    every stream has ended, or 60 s passed: then 0). Waiting for every first token instead
    lets a fast worker finish its streams before the other worker's first token arrives."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(f.done() for f in futures):
        running = int(client.stats()["workers"][worker_id]["num_requests_running"])
        if running > 0:
            return running
        time.sleep(0.01)
    return 0


def _swap_log(log: Path) -> dict[int, tuple[str, float]]:
    """Worker id -> (node id, swap MB/s) from the launcher's probe lines in ``serve``'s log."""
    pattern = re.compile(r"worker (\d+) on node (\w+): host block store \S+, \d+ blocks; "
                         r"swap ([\d.]+) MB/s")  # fmt: skip
    found = (pattern.search(ln) for ln in log.read_text(errors="replace").splitlines())
    return {int(m[1]): (m[2], float(m[3])) for m in found if m}


def test_model_missing_on_node_b_is_one_error_line(two_nodes: TwoNodes, hidden_model: Path) -> None:
    done = subprocess.run(
        _serve_cmd(two_nodes, hidden_model, *RECOMPUTE),
        capture_output=True, text=True, env=two_nodes.env(), timeout=START_S,
    )  # fmt: skip
    assert done.returncode != 0
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, done.stderr[-4000:]
    assert two_nodes.ip_b in errors[0], errors[0]
    assert "does not exist" in errors[0] and str(hidden_model) in errors[0], errors[0]


def test_worker_on_node_b_with_default_flags_matches_hf(
    two_nodes: TwoNodes, tiny_model: Path, hf_reference: list[list[int]]
) -> None:
    with serving(two_nodes, tiny_model) as served:
        assert _greedy(served.address) == hf_reference


class TestSwapOnNodeB:
    """``--preemption-mode swap`` with a small pool: worker 0 on B swaps to B's store."""

    @pytest.fixture(scope="class")
    def swap_serving(self, two_nodes: TwoNodes, tiny_model: Path) -> Iterator[Served]:
        with serving(two_nodes, tiny_model, *SWAP) as served:
            yield served

    def test_swap_forced_on_node_b_counts_transfers_to_its_own_store(
        self, swap_serving: Served, hf_reference: list[list[int]]
    ) -> None:
        assert _greedy(swap_serving.address) == hf_reference
        with Client(swap_serving.address, timeout_s=30) as client:
            on_b, on_a = client.stats()["workers"]
        # A group swapped out to B's store resumes on B, or on A by a pull from B's store
        # (``swap`` pulls whenever the pair's bandwidth is measured): either way from B's.
        resumed_from_b = (
            on_b["num_swap_ins"] - on_b["num_remote_swap_ins"] + on_a["num_remote_swap_ins"]
        )
        assert on_b["num_swap_outs"] >= 1 and resumed_from_b >= 1, (on_b, on_a)
        assert on_b["num_swap_failures"] == 0, on_b
        assert on_b["can_swap"] and on_a["can_swap"], (on_b, on_a)
        probes = _swap_log(swap_serving.log)
        assert set(probes) == {0, 1}, probes
        assert probes[0][0] != probes[1][0], f"one store for both nodes: {probes}"
        print(  # the figures docs/operations.md quotes (run with -s)
            f"swap bandwidth: worker 0 (node B) {probes[0][1]:.1f} MB/s, "
            f"worker 1 (node A) {probes[1][1]:.1f} MB/s"
        )

    def test_swapped_group_on_node_b_recomputed_on_a_when_b_dies(
        self, two_nodes: TwoNodes, swap_serving: Served, hf_reference: list[list[int]]
    ) -> None:
        with (
            Client(swap_serving.address, timeout_s=180) as client,
            ThreadPoolExecutor(len(PROMPTS)) as pool,
        ):
            futures = _streams(client, pool)
            held: dict[str, object] = {}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(f.done() for f in futures):
                on_b = client.stats()["workers"][0]
                if on_b["num_swap_outs"] > on_b["num_swap_ins"]:  # a group in B's store
                    held = on_b
                    break
                time.sleep(0.05)
            os.kill(two_nodes.raylet_pid_b(), signal.SIGKILL)
            assert held, "no group was swapped out on node B when its raylet was killed"
            results = [f.result(timeout=180) for f in futures]
            stats = client.stats()
        assert results == hf_reference
        # Worker 1 (on A) finished them; whether worker 0 is marked dead yet depends on when
        # Ray or the probe notices B's raylet is gone, so it is not asserted here.
        assert stats["workers"][1]["alive"]
        assert stats["swap"]["num_requests_swapped"] == 0, stats["swap"]


def _pull_log(log: Path) -> dict[int, float]:
    """Worker id -> MB/s of its pull probe from the other node's store (launcher log)."""
    pattern = re.compile(r"worker (\d+): pulls from the store of node \w+ \(\S+\) at ([\d.]+) MB/s")
    found = (pattern.search(ln) for ln in log.read_text(errors="replace").splitlines())
    return {int(m[1]): float(m[2]) for m in found if m}


def _kill_while_a_group_is_stored(pid: int, client: Client, futures: list[Future]) -> dict:
    """SIGKILL ``pid`` (node B's worker) at a moment its group sits in B's store: the
    worker is stopped (SIGSTOP) while the stats are read, resumed if none is stored."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(f.done() for f in futures):
        os.kill(pid, signal.SIGSTOP)
        stats = client.stats()
        on_b = stats["workers"][0]
        if on_b["num_swap_outs"] > on_b["num_swap_ins"]:
            os.kill(pid, signal.SIGKILL)
            return on_b
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return {}


def test_swapped_group_on_node_b_pulled_by_a_when_b_worker_dies(
    two_nodes: TwoNodes, tiny_model: Path, hf_reference: list[list[int]]
) -> None:
    """Node B's worker process is killed for good (its raylet and store keep running)
    while a group sits in B's store: worker 1 on A pulls it from B's store over the veth
    link (a remote swap-in; ``swap`` mode pulls whatever it can, whatever the cost model
    says) and every request ends with HF's tokens."""
    with serving(two_nodes, tiny_model, *SWAP, "--worker-max-restarts", "0") as served:
        probes, pulls = _swap_log(served.log), _pull_log(served.log)
        assert set(pulls) == {0, 1}, pulls  # each worker measured the other node's store
        with (
            Client(served.address, timeout_s=180) as client,
            ThreadPoolExecutor(len(PROMPTS)) as pool,
        ):
            client.wait_ready(60)
            futures = _streams(client, pool)
            (pid,) = two_nodes.actor_pids_b("Worker")
            held = _kill_while_a_group_is_stored(pid, client, futures)
            assert held, "no group was in node B's store when its worker was killed"
            results = [f.result(timeout=180) for f in futures]
            stats = client.stats()
    on_b, on_a = stats["workers"]
    print(  # the figures docs/operations.md quotes (run with -s)
        f"pull bandwidth over the veth link: worker 1 (A) <- B's store {pulls[1]:.1f} MB/s, "
        f"worker 0 (B) <- A's store {pulls[0]:.1f} MB/s; local: worker 1 (A) "
        f"{probes[1][1]:.1f} MB/s, worker 0 (B) {probes[0][1]:.1f} MB/s; "
        f"remote swap-ins {on_a['num_remote_swap_ins']}, {on_a['remote_swap_in_bytes']} B"
    )
    assert results == hf_reference
    assert not on_b["alive"] and on_a["alive"]
    assert on_a["num_remote_swap_ins"] >= 1 and on_a["remote_swap_in_bytes"] > 0, on_a
    # B's worker may have pulled one of A's groups (a thief) before it died
    total = on_a["num_remote_swap_ins"] + on_b["num_remote_swap_ins"]
    assert stats["swap"]["num_remote_swap_ins"] == total, stats["swap"]
    assert stats["swap"]["num_requests_swapped"] == 0, stats["swap"]


def test_prefill_on_node_b_decode_on_node_a_pulls_the_kv(
    two_nodes: TwoNodes, tiny_model: Path, hf_reference: list[list[int]]
) -> None:
    """``--prefill-workers 1``: worker 0 on B prefills every prompt, worker 1 on A pulls
    each request's KV from B's store over the veth link (a remote swap-in) and decodes it
    without recomputing; the tokens equal HF's."""
    disagg = ("--preemption-mode", "recompute", "--device", "cpu", "--swap-space", "0.25",
              "--prefill-workers", "1", "--disagg-min-prompt-tokens", "4")  # fmt: skip
    with serving(two_nodes, tiny_model, *disagg) as served:
        assert _greedy(served.address) == hf_reference
        with Client(served.address, timeout_s=30) as client:
            stats = client.stats()
    on_b, on_a = stats["workers"]
    n = len(PROMPTS)
    assert (on_b["num_swap_outs"], on_b["num_swap_ins"]) == (n, 0), on_b
    assert (on_a["num_swap_ins"], on_a["num_remote_swap_ins"]) == (n, n), on_a
    assert on_a["remote_swap_in_bytes"] == stats["swap"]["swap_out_bytes"] > 0
    assert stats["swap"]["num_swap_failures"] == 0 and stats["num_recomputed_tokens"] == 0


def test_scheduler_on_node_b_killed_comes_back_and_serves(
    two_nodes: TwoNodes, tiny_model: Path, hf_reference: list[list[int]]
) -> None:
    placed = ("--scheduler-resources", '{"sched_b": 1}')
    with serving(two_nodes, tiny_model, *RECOMPUTE, *placed) as served:
        assert _greedy(served.address) == hf_reference
        (pid,) = two_nodes.actor_pids_b("SchedulerActor")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # Ray restarts it where sched_b is: on node B
            restarted = two_nodes.actor_pids_b("SchedulerActor")
            if restarted and restarted != [pid]:
                break
            time.sleep(0.5)
        assert restarted and restarted != [pid], "the scheduler was not restarted on node B"
        deadline = time.monotonic() + 120
        while True:  # the frontend admits again once the restarted scheduler answers
            try:
                results = _greedy(served.address)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        assert results == hf_reference
        with Client(served.address, timeout_s=30) as client:
            assert all(w["alive"] for w in client.stats()["workers"])
        log = served.log.read_text(errors="replace")
        assert "the scheduler actor died" in log
        # The frontend on A took its outputs over its output channel from the scheduler on
        # B, before the kill and after the restart, never a Ray stream.
        assert log.count("on the output channel") >= 2 and "no output channel" not in log, log


@pytest.fixture(scope="module")
def recompute_serving(two_nodes: TwoNodes, tiny_model: Path) -> Iterator[str]:
    """``serve`` with worker 0 on node B and worker 1 on A, recompute preemption, a 3 s
    step deadline floor; yields its address."""
    with serving(two_nodes, tiny_model, *RECOMPUTE, *DEADLINE) as served:
        yield served.address


def test_worker_on_node_b_serves_greedy_equal_to_hf(
    recompute_serving: str, hf_reference: list[list[int]]
) -> None:
    assert _greedy(recompute_serving) == hf_reference
    with Client(recompute_serving, timeout_s=30) as client:
        workers = client.stats()["workers"]
    assert len(workers) == 2 and all(w["alive"] for w in workers)


def test_link_cut_mid_stream_requests_finish_on_a_after_the_step_deadline(
    two_nodes: TwoNodes, recompute_serving: str, hf_reference: list[list[int]]
) -> None:
    with (
        Client(recompute_serving, timeout_s=180) as client,
        ThreadPoolExecutor(len(PROMPTS)) as pool,
    ):
        futures = _streams(client, pool, wait_first_tokens=False)
        on_b = _running_on(client, 0, futures)
        with two_nodes.link_down():
            cut = time.monotonic()
            assert on_b > 0, "node B's worker ran nothing when the link was cut"
            wait(futures, timeout=LINK_CUT_BOUND_S)
            elapsed = time.monotonic() - cut
            stalled = sum(not f.done() for f in futures)
            b_suspect = not client.stats()["workers"][0]["alive"]
        assert stalled == 0, f"{stalled} request(s) stalled {LINK_CUT_BOUND_S:.0f} s after the cut"
        results = [f.result() for f in futures]
    assert results == hf_reference
    assert b_suspect, "node B's worker was not taken out of service during the cut"
    print(f"link cut: every request finished {elapsed:.1f} s after the cut")
    # Node B outlived the cut (the deadline, not Ray's node death, ended the stall) and its
    # worker rejoins once it answers.
    assert two_nodes.alive_nodes() == 2
    with Client(recompute_serving, timeout_s=30) as client:
        deadline = time.monotonic() + 60
        while not client.stats()["workers"][0]["alive"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.stats()["workers"][0]["alive"], "node B's worker did not rejoin"


def test_node_b_raylet_killed_mid_stream_requests_finish_on_a(
    two_nodes: TwoNodes, recompute_serving: str, hf_reference: list[list[int]]
) -> None:
    with (
        Client(recompute_serving, timeout_s=180) as client,
        ThreadPoolExecutor(len(PROMPTS)) as pool,
    ):
        futures = _streams(client, pool, wait_first_tokens=False)
        on_b = _running_on(client, 0, futures)
        os.kill(two_nodes.raylet_pid_b(), signal.SIGKILL)
        assert on_b > 0, "node B's worker ran nothing when its raylet was killed"
        results = [f.result(timeout=180) for f in futures]
        assert results == hf_reference
        assert client.stats()["workers"][1]["alive"]
