"""Fixtures of the two-node tests: two real Ray nodes on this machine (see two_nodes.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import build_tiny_model
from two_nodes import TwoNodes, cannot_make_namespaces


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    """Node A (head, ``node_a``) and node B (own network and mount namespaces, ``node_b``),
    one CPU each; stopped by PID and the namespace deleted at teardown, even on failure."""
    reason = cannot_make_namespaces()
    if reason is not None:
        pytest.skip(f"two Ray nodes need network namespaces: {reason}")
    nodes = TwoNodes()
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama in a folder both nodes see."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny2n") / "tiny", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def hidden_model(two_nodes: TwoNodes, tiny_model: Path) -> Path:
    """A copy of the tiny model that only node A sees (B has a tmpfs over its folder)."""
    dest = two_nodes.hidden_dir / "tiny"
    shutil.copytree(tiny_model, dest)
    return dest
