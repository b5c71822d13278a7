"""``benchmarks/engine/gpu_check.py`` runs without Ray, gRPC or protobuf, as on the bare GPU image.

The check has one real try on a lent GPU; these tests keep it from failing there on an
import that the project's full venv hides (``--cpu-smoke``: the same code paths on CPU
with tiny shapes, under the script's import hook that makes those packages missing).
"""

from __future__ import annotations

import importlib.util
import json
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


@pytest.mark.parametrize("name", ["grpc", "grpc.aio", "ray", "google.protobuf.message"])
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
