"""``benchmarks/engine/gpu_check.py`` runs without Ray, gRPC, protobuf or matplotlib, as on the bare GPU image.

The check has one real try on a lent GPU; these tests keep it from failing there on an
import that the project's full venv hides (``--cpu-smoke``: the same code paths on CPU
with tiny shapes, under the script's import hook that makes those packages missing, in
its subprocesses too), and check that the kernel benchmark's own code ran and wrote its
figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "engine" / "gpu_check.py"

# Loaded from its file: its folder on sys.path would make the other scripts there
# (scheduler.py, ...) importable as top-level modules for the whole test session.
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)
_kspec = importlib.util.spec_from_file_location(
    "gpu_check_kernels", REPO / "benchmarks" / "kernels" / "kernels.py"
)
assert _kspec is not None and _kspec.loader is not None
gpu_check_kernels = importlib.util.module_from_spec(_kspec)
sys.modules[_kspec.name] = gpu_check_kernels  # its dataclasses look their module up
_kspec.loader.exec_module(gpu_check_kernels)


@pytest.mark.parametrize(
    "name", ["grpc", "grpc.aio", "ray", "google.protobuf.message", "matplotlib.pyplot"]
)
def test_the_import_hook_makes_forbidden_modules_missing(name: str) -> None:
    with pytest.raises(ModuleNotFoundError, match="not on the bare GPU image") as info:
        gpu_check.ForbidImports().find_spec(name)
    assert info.value.name == name


@pytest.mark.parametrize("name", ["torch", "grpcio_tools_x", "rayon", "pagedserve.worker"])
def test_the_import_hook_lets_other_modules_through(name: str) -> None:
    assert gpu_check.ForbidImports().find_spec(name) is None


def test_cpu_smoke_runs_the_decode_loop_without_the_forbidden_packages(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke",
         "--skip-tests", "--batches", "1,2", "--steps", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-smoke"
    assert report["kernels"]["ok"] and report["decode_loop"]["ok"]
    assert [row["batch"] for row in report["decode_loop"]["result"]] == [1, 2]
    assert all(row["tokens_per_s"] > 0 for row in report["decode_loop"]["result"])
    assert report["imported_forbidden"] == []
    bench = report["kernels"]["result"]
    # The benchmark's own paths: the Triton kernels under the interpreter on CPU tensors,
    # bf16 upcast before tl.dot there, no plot without matplotlib, the JSON written anyway.
    assert bench["device"] == "cpu (Triton interpreter)"
    assert (bench["backend"], bench["triton_interpret"]) == ("triton", "1")
    assert bench["dtype"] == "bf16" and bench["native_16bit_dot"] is False
    assert bench["plot"] is None and "no plot: matplotlib not installed" in proc.stdout
    assert not (tmp_path / "kernels.png").exists()
    decode = bench["decode"]
    assert [(r["batch"], r["context"]) for r in decode] == [(1, 40)]
    for row in decode:
        assert row["pagedserve"]["GBps"] > 0 and row["sdpa_contiguous"]["GBps"] > 0
        assert 0 < row["max_abs_err_vs_reference"] < 2e-2  # bf16 output rounding
        # 2 x (40 tokens x 2 KV heads x 32 dims) K/V + Q and O (4 heads x 32), bf16.
        assert row["working_set_bytes"] == 2 * (40 * 2 * 32 + 4 * 32) * 2
        assert row["rotation"] == gpu_check_kernels.rotation_count(
            row["working_set_bytes"], bench["l2_bytes"]
        )
        assert row["bytes_between_reuse"] >= 2 * bench["l2_bytes"]
        assert row["l2_resident"] is False
    assert [r["seq_len"] for r in bench["prefill"]] == [24]
    assert bench["prefill"][0]["pagedserve"]["TFLOPs"] > 0


@pytest.mark.parametrize(
    ("working_set", "l2", "copies"),
    [(1, 1, 2), (25 << 20, 50 << 20, 4), (24 << 20, 50 << 20, 5), (200 << 20, 50 << 20, 1)],
)
def test_rotation_reads_twice_l2_between_two_uses_of_a_copy(
    working_set: int, l2: int, copies: int
) -> None:
    n = gpu_check_kernels.rotation_count(working_set, l2)
    assert n == copies
    assert n * working_set >= 2 * l2 > (n - 1) * working_set


def test_rotation_refuses_empty_sizes() -> None:
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        gpu_check_kernels.rotation_count(0, 50 << 20)


def test_cycle_calls_each_in_turn() -> None:
    seen: list[int] = []
    run = gpu_check_kernels.cycle([lambda: seen.append(0), lambda: seen.append(1)])
    for _ in range(5):
        run()
    assert seen == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("gpus", [0, 1])
def test_the_tensor_parallel_phase_skips_below_two_gpus(monkeypatch, gpus: int) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    ran: list[object] = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: ran.append(a))
    report: dict = {}
    gpu_check.run_phase("tensor_parallel", lambda: gpu_check.tensor_parallel({}, False, 1), report)
    assert report["tensor_parallel"]["ok"] and not ran
    assert report["tensor_parallel"]["result"] == {
        "skipped": f"{gpus} GPU(s): tensor parallelism needs 2"
    }


@pytest.mark.slow  # ~30 s: two rank processes start torch
def test_the_tensor_parallel_phase_runs_its_tests_on_cpu_in_smoke_mode() -> None:
    shim = gpu_check.package_shim()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(REPO / "tests")]))
    result = gpu_check.tensor_parallel(env, smoke=True, timeout_s=300)
    assert result["returncode"] == 0 and "1 passed" in result["summary"]
