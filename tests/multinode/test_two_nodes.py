"""Serving across two real Ray nodes (node B in its own network and mount namespaces).

The driver is ``pagedserve serve --address`` in a subprocess on node A, as a user runs it;
worker placement by ``--worker-resources`` (node A has ``node_a``, node B ``node_b``).
The raylet case ends node B, so it runs last.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import hf_greedy
from two_nodes import TwoNodes

from pagedserve.cluster.client import Client

pytestmark = pytest.mark.slow

MAX_TOKENS = 120
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
RECOMPUTE = ("--preemption-mode", "recompute", "--device", "cpu")
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


@contextmanager
def serving(nodes: TwoNodes, model: Path, *extra: str) -> Iterator[str]:
    """``serve`` running; yields its gRPC address; SIGTERM (then SIGKILL) by PID after."""
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
                    yield line.split()[-4]
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
    with serving(two_nodes, tiny_model) as address:
        assert _greedy(address) == hf_reference


@pytest.fixture(scope="module")
def recompute_serving(two_nodes: TwoNodes, tiny_model: Path) -> Iterator[str]:
    """``serve`` with worker 0 on node B and worker 1 on A, recompute preemption."""
    with serving(two_nodes, tiny_model, *RECOMPUTE) as address:
        yield address


def test_worker_on_node_b_serves_greedy_equal_to_hf(
    recompute_serving: str, hf_reference: list[list[int]]
) -> None:
    assert _greedy(recompute_serving) == hf_reference
    with Client(recompute_serving, timeout_s=30) as client:
        workers = client.stats()["workers"]
    assert len(workers) == 2 and all(w["alive"] for w in workers)


def test_node_b_raylet_killed_mid_stream_requests_finish_on_a(
    two_nodes: TwoNodes, recompute_serving: str, hf_reference: list[list[int]]
) -> None:
    with Client(recompute_serving, timeout_s=180) as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            first_token = [0] * len(PROMPTS)

            def one(i: int) -> list[int]:
                out: list[int] = []
                stream = client.stream(token_ids=PROMPTS[i], **GREEDY)
                for delta in stream:
                    out.extend(delta.token_ids)
                    first_token[i] = len(out)
                return out

            futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 60
            while not all(first_token) and time.monotonic() < deadline:
                time.sleep(0.02)
            on_b = client.stats()["workers"][0]["num_requests_running"]
            os.kill(two_nodes.raylet_pid_b(), signal.SIGKILL)
            assert on_b > 0, "node B's worker ran nothing when its raylet was killed"
            results = [f.result(timeout=180) for f in futures]
        assert results == hf_reference
        assert client.stats()["workers"][1]["alive"]
