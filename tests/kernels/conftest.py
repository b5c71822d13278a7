"""Kernel tests run the Triton kernels under the interpreter when no GPU is present.

TRITON_INTERPRET must be set before the ``pagedserve.kernels.*_triton`` modules are
imported (``@triton.jit`` picks interpreter or compiler at decoration time), and before
``triton`` itself is first imported: Triton 3.9's own jitted helpers (``tl`` builtins)
take the mode then, and a kernel interpreted after them fails with "Cannot call
@triton.jit'd outside of the scope of a kernel". transformers imports triton when it loads
a model, so tests/e2e/conftest.py sets it at load time too; setting it here, when this
conftest is loaded, is early enough as long as no earlier test directory imported triton.
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
