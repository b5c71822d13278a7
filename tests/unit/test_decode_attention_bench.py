"""``benchmarks/kernels/decode_attention_vllm.py`` without vLLM: the pagedserve-side cases
(layouts, separate layers, a permutation of the blocks) and that the vLLM child script is
valid Python that answers one JSON line per ``run``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import cpu_native

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "decode_attention_vllm", REPO / "benchmarks" / "kernels" / "decode_attention_vllm.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)


def _args(**kw) -> argparse.Namespace:
    base = dict(batch=3, context=40, heads=4, kv_heads=2, head_dim=64, layers=2,
                block_sizes=[16, 32], seed=0)  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


def test_cases_have_the_paged_layout_separate_layers_and_every_block_once():
    cases = bench.paged_cases(_args())
    assert sorted(cases) == [16, 32]
    for bs, (keys, values, table, lens, cu, q) in cases.items():
        per = -(-40 // bs)
        assert [k.shape for k in keys] == [(3 * per, bs, 2, 64)] * 2
        assert all(k.dtype == torch.bfloat16 for k in (*keys, *values))
        ptrs = {t.data_ptr() for t in (*keys, *values)}
        assert len(ptrs) == 4  # every layer, K and V, its own storage
        assert table.shape == (3, per) and table.dtype == torch.int32
        assert sorted(table.flatten().tolist()) == list(range(3 * per))
        assert lens.tolist() == [40, 40, 40] and cu.tolist() == [0, 1, 2, 3]
        assert q.shape == (3, 4, 64) and q.dtype == torch.float32


@pytest.mark.skipif(not cpu_native.available(), reason="needs the CPU kernels")
def test_a_pass_runs_the_kernel_on_every_layer():
    case = bench.paged_cases(_args(block_sizes=[16]))[16]
    ms = bench.paged_pass(case, 0.125)
    assert ms > 0.0
    keys, values, table, lens, cu, q = case
    out = cpu_native.paged_attention(q, keys[0], values[0], table, cu, lens, 0.125)
    assert out.shape == (3, 4, 64) and torch.isfinite(out).all()


def test_the_vllm_child_is_valid_python_with_a_run_loop():
    compile(bench.VLLM_CHILD, "<vllm-child>", "exec")
    assert "ops.cpu_attention_with_kv_cache(" in bench.VLLM_CHILD
    assert 'line.strip() != "run"' in bench.VLLM_CHILD
