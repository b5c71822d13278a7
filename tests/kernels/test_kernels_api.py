"""Argument validation and backend selection of the public kernel API."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedserve import kernels


def _decode_args():
    kc = torch.zeros(4, 16, 2, 64)
    return {
        "query": torch.zeros(3, 4, 64),
        "key_cache": kc,
        "value_cache": torch.zeros_like(kc),
        "block_tables": torch.zeros(3, 2, dtype=torch.int32),
        "seq_lens": torch.ones(3, dtype=torch.int32),
        "scale": 0.125,
    }


def _prefill_args():
    args = _decode_args()
    args["query"] = torch.zeros(5, 4, 64)
    args["cu_seqlens_q"] = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    return args


@pytest.mark.parametrize(
    "name,bad",
    [
        ("query", torch.zeros(3, 4)),
        ("query", torch.zeros(3, 4, 32)),
        ("query", torch.zeros(3, 3, 64)),
        ("query", torch.zeros(3, 4, 64, dtype=torch.float16)),
        ("key_cache", torch.zeros(4, 16, 128)),
        ("value_cache", torch.zeros(4, 16, 2, 32)),
        ("value_cache", torch.zeros(4, 16, 2, 64, dtype=torch.float16)),
        ("block_tables", torch.zeros(3, 2)),
        ("block_tables", torch.zeros(2, 2, dtype=torch.int32)),
        ("seq_lens", torch.ones(3, 1, dtype=torch.int32)),
        ("seq_lens", torch.ones(4, dtype=torch.int32)),
        ("seq_lens", torch.ones(3)),
    ],
)
def test_decode_rejects_bad_arguments(name, bad):
    args = _decode_args()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        kernels.paged_decode_attention(**args)


@pytest.mark.parametrize(
    "name,bad",
    [
        ("cu_seqlens_q", torch.tensor([0.0, 2.0, 3.0, 5.0])),
        ("cu_seqlens_q", torch.zeros(4, 1, dtype=torch.int32)),
        ("block_tables", torch.zeros(2, 2, dtype=torch.int32)),
        ("query", torch.zeros(5, 4, 80)),
    ],
)
def test_prefill_rejects_bad_arguments(name, bad):
    args = _prefill_args()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        kernels.paged_prefill_attention(**args)


@pytest.mark.parametrize(
    "name,bad",
    [
        ("key", torch.zeros(3, 2, 32)),
        ("key", torch.zeros(3, 2, 64, dtype=torch.float16)),
        ("value", torch.zeros(2, 2, 64)),
        ("slot_mapping", torch.zeros(4, dtype=torch.int64)),
        ("slot_mapping", torch.zeros(3)),
        ("key_cache", torch.zeros(4, 16, 2, 64).transpose(1, 2)),
    ],
)
def test_store_rejects_bad_arguments(name, bad):
    args = {
        "key": torch.zeros(3, 2, 64),
        "value": torch.zeros(3, 2, 64),
        "key_cache": torch.zeros(4, 16, 2, 64),
        "value_cache": torch.zeros(4, 16, 2, 64),
        "slot_mapping": torch.zeros(3, dtype=torch.int64),
    }
    if name == "key_cache":
        args["value_cache"] = bad.clone()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        kernels.store_kv_cache(**args)


def test_block_ops_reject_bad_arguments():
    kcs = [torch.zeros(4, 2, 1, 8) for _ in range(2)]
    vcs = [torch.zeros(4, 2, 1, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="block_mapping"):
        kernels.copy_blocks(kcs, vcs, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="value_caches"):
        kernels.copy_blocks(kcs, vcs[:1], torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key_caches\[1\]"):
        kernels.copy_blocks(
            [kcs[0], torch.zeros(5, 2, 1, 8)],
            [vcs[0], torch.zeros(5, 2, 1, 8)],
            torch.zeros(0, 2, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="key_caches"):
        kernels.gather_blocks([], [], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_ids"):
        kernels.gather_blocks(kcs, vcs, torch.zeros(1))
    with pytest.raises(ValueError, match="out"):
        kernels.gather_blocks(
            kcs, vcs, torch.zeros(1, dtype=torch.int64), out=torch.zeros(2, 2, 2, 2, 1, 8)
        )
    with pytest.raises(ValueError, match="packed"):
        kernels.scatter_blocks(
            kcs, vcs, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 2, 2, 1, 4)
        )
    with pytest.raises(ValueError, match="packed"):
        packed = torch.zeros(1, 2, 2, 2, 1, 8, dtype=torch.float16)
        kernels.scatter_blocks(kcs, vcs, torch.zeros(1, dtype=torch.int64), packed)


@pytest.mark.parametrize(
    "mapping, fragment",
    [
        ([[1, 2], [2, 3]], "both a source and a destination"),
        ([[1, 2], [3, 2]], "repeated destination"),
        ([[1, 9]], "must be in"),
        ([[-1, 2]], "must be in"),
    ],
)
def test_copy_blocks_rejects_ambiguous_mappings(mapping, fragment):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 4, 2, 16, generator=g)
    v = torch.randn(6, 4, 2, 16, generator=g)
    with pytest.raises(ValueError, match=fragment):
        kernels.copy_blocks([k], [v], torch.tensor(mapping, dtype=torch.int64), backend="torch")


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    assert kernels.resolve_backend("auto", cpu) == "torch"
    assert kernels.resolve_backend("auto", torch.device("cuda")) == "triton"
    assert kernels.resolve_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="backend"):
        kernels.resolve_backend("cuda", cpu)
    with pytest.raises(ValueError, match="backend"):
        kernels.paged_decode_attention(**_decode_args(), backend="flash")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.paged_decode_attention(**_decode_args(), backend="triton")


def test_importing_and_auto_backend_on_cpu_never_import_triton():
    code = (
        "import sys, torch\n"
        "from pagedserve import kernels\n"
        "kc = torch.zeros(2, 4, 1, 16); vc = torch.zeros_like(kc)\n"
        "kernels.store_kv_cache(torch.ones(1, 1, 16), torch.ones(1, 1, 16), kc, vc,"
        " torch.tensor([5]))\n"
        "out = kernels.paged_decode_attention(torch.ones(1, 2, 16), kc, vc,"
        " torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 0.25)\n"
        "assert out.shape == (1, 2, 16)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
