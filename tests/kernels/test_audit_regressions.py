"""Regressions found by the kernel/worker audit (see the stop-5 closing note)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve import kernels
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampler import SamplingRow


def _caches(num_blocks=6, block_size=4, kv_heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_permuted_query_gives_the_same_output(backend):
    k, v = _caches()
    q = torch.randn(2, 16, 4)  # [num_seqs, head_dim, num_heads] -> permute to [S, H, D]
    query = q.permute(0, 2, 1)
    assert not query.is_contiguous()
    tables = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32)
    out = kernels.paged_decode_attention(query, k, v, tables, seq_lens, 0.25, backend=backend)
    ref = kernels.paged_decode_attention(
        query.contiguous(), k, v, tables, seq_lens, 0.25, backend="torch"
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = kernels.paged_prefill_attention(query, k, v, tables, cu, seq_lens, 0.25, backend)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


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
    k, v = _caches()
    with pytest.raises(ValueError, match=fragment):
        kernels.copy_blocks([k], [v], torch.tensor(mapping, dtype=torch.int64), backend="torch")


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingRow(temperature=1e-300).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_weights_follow_the_safetensors_index(tiny_llama_dir: Path, tmp_path: Path):
    from safetensors.torch import save_file

    from pagedserve.cluster.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.worker import Worker

    folder = tmp_path / "with_extra"
    shutil.copytree(tiny_llama_dir, folder)
    weights = next(folder.glob("*.safetensors")).name
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, folder / "consolidated.safetensors")
    worker = Worker(
        WorkerConfig(model=ModelConfig(model=str(folder)), cache=CacheConfig(num_blocks=8))
    )
    assert worker.get_info().num_blocks == 8
