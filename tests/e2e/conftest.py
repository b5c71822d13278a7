"""End-to-end tests that run the Triton backend on CPU do so under the interpreter.

TRITON_INTERPRET must be set before ``triton`` itself is imported (its own
``triton.language`` helpers are ``@triton.jit`` functions, interpreted or compiled as
decided at decoration time), and HF transformers imports it when it loads a model; so it is
set when this conftest is loaded, before any test here runs, as in tests/kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
