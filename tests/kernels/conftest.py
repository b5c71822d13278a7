"""Kernel tests run the Triton kernels under the interpreter when no GPU is present.

TRITON_INTERPRET must be set before the ``pagedserve.kernels.*_triton`` modules are
imported (``@triton.jit`` picks interpreter or compiler at decoration time). Those modules
are only imported lazily, on the first Triton-backend call, so setting it when this
conftest is loaded (before any test module here is imported) is early enough even if
other test directories imported ``pagedserve.kernels`` or Triton itself already.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    """CUDA when present (compiled Triton), else CPU (interpreted Triton)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
