"""``benchmarks/memory/kv_dtype.py`` without a server: the KV block arithmetic (against the
worker's own sizing), the ``pagedserve serve`` command it builds through ``pressure.py``
(parsed by the real CLI), the run order and the ratio math."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.cluster.cli import build_parser as cli_parser
from pagedserve.cluster.cli import serve_config
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.kv_pool import num_blocks_for

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "kv_dtype", REPO / "benchmarks" / "memory" / "kv_dtype.py"
)
assert _spec is not None and _spec.loader is not None
kv_dtype = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kv_dtype  # its dataclasses look their module up
_spec.loader.exec_module(kv_dtype)
import pressure  # noqa: E402  (benchmarks/memory, on the path kv_dtype set)

# SmolLM2-135M-Instruct's config.json (the fields the KV shape reads).
SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
}
SHAPE = kv_dtype.KVShape.from_config(SMOLLM2)


def _arch() -> ModelArch:
    return ModelArch(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_parameters=(("rope_theta", 100000.0), ("rope_type", "default")),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def test_smollm2_block_bytes_and_budget():
    assert kv_dtype.KVShape(num_layers=30, num_kv_heads=3, head_dim=64) == SHAPE
    # 2 (K, V) * 30 layers * 16 tokens * 3 heads * 64 dims * 4 bytes
    assert kv_dtype.bytes_per_block(SHAPE, 16, "float32") == 737_280
    assert kv_dtype.bytes_per_block(SHAPE, 16, "bfloat16") == 368_640
    args = kv_dtype.build_parser().parse_args([])
    budget = kv_dtype.resolve_budget(args, SHAPE)
    assert budget == 96 * 737_280 == 70_778_880
    assert kv_dtype.expected_blocks(budget, SHAPE, 16, "float32") == 96
    assert kv_dtype.expected_blocks(budget, SHAPE, 16, "bfloat16") == 192


def test_head_dim_given_in_config_wins():
    shape = kv_dtype.KVShape.from_config({**SMOLLM2, "head_dim": 128})
    assert kv_dtype.bytes_per_block(shape, 8, "float16") == 2 * 30 * 8 * 3 * 128 * 2


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "fp8", "int8"])
@pytest.mark.parametrize("budget", [70_778_880, 70_778_880 + 368_639, 1 << 30])
def test_expected_blocks_match_the_workers_sizing(kv: str, budget: int):
    argv = ["serve", "--kv-cache-memory", str(budget), "--kv-cache-dtype", kv]
    cache = serve_config(cli_parser().parse_args(argv)).cache
    torch_dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(kv) or getattr(torch, kv)
    want = num_blocks_for(cache, _arch(), torch_dtype)
    assert kv_dtype.expected_blocks(budget, SHAPE, 16, kv) == want


def test_budget_too_small_and_bad_dtype_raise():
    args = kv_dtype.build_parser().parse_args(["--kv-cache-memory", "368640"])
    with pytest.raises(ValueError, match="no float32 block"):
        kv_dtype.resolve_budget(args, SHAPE)
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_dtype.bytes_per_block(SHAPE, 16, "int4")
    with pytest.raises(SystemExit):
        kv_dtype.build_parser().parse_args(["--kv-cache-dtypes", "float32,int4"])
    # the 8-bit dtypes: fp8 a quarter of fp32's bytes, int8 plus 4 scale bytes per head vector
    assert kv_dtype.bytes_per_block(SHAPE, 16, "fp8") == 737_280 // 4
    assert kv_dtype.bytes_per_block(SHAPE, 16, "int8") == 2 * 30 * 16 * 3 * (64 + 4)


def test_server_command_sizes_by_bytes_and_parses(monkeypatch: pytest.MonkeyPatch):
    seen: list[list[str]] = []

    class Stop(Exception):
        pass

    def fake_popen(cmd: list[str], **_: Any) -> None:
        seen.append(cmd)
        raise Stop

    monkeypatch.setattr(pressure.subprocess, "Popen", fake_popen)
    args = kv_dtype.build_parser().parse_args(["--server-log", "/dev/null"])
    flags = kv_dtype.serve_flags(70_778_880, "bfloat16", "float32", ["--no-prefix-caching"])
    sargs = kv_dtype.argparse.Namespace(**{**vars(args), "num_blocks": None})
    with pytest.raises(Stop), pressure.server(sargs, flags):
        pass
    (cmd,) = seen
    assert "--num-blocks" not in cmd  # the CLI makes it exclusive with --kv-cache-memory
    parsed = cli_parser().parse_args(cmd[1:])
    assert parsed.kv_cache_memory == 70_778_880 and parsed.num_blocks is None
    assert (parsed.dtype, parsed.kv_cache_dtype) == ("bfloat16", "float32")
    assert parsed.no_prefix_caching and parsed.block_size == 16


def test_run_order_interleaves_kv_dtypes_within_each_round():
    order = kv_dtype.run_order(["float32", "bfloat16"], ["float32", "bfloat16"], 2)
    assert order == [
        ("float32", 0, "float32"),
        ("float32", 0, "bfloat16"),
        ("float32", 1, "float32"),
        ("float32", 1, "bfloat16"),
        ("bfloat16", 0, "float32"),
        ("bfloat16", 0, "bfloat16"),
        ("bfloat16", 1, "float32"),
        ("bfloat16", 1, "bfloat16"),
    ]


def test_summarize_pairs_runs_of_one_round():
    def run(rnd: int, kv: str, blocks: int, tps: float) -> dict[str, Any]:
        res = {
            "num_blocks": blocks,
            "running_peak": blocks // 10,
            "running_mean": blocks / 20,
            "output_tokens_per_s": tps,
            "ttft_p50_s": 1.0,
        }
        return {"dtype": "float32", "round": rnd, "kv_cache_dtype": kv, "result": res}

    runs = [run(0, "float32", 96, 50.0), run(0, "bfloat16", 192, 75.0), run(1, "float32", 96, 40.0)]
    (row,) = kv_dtype.summarize(runs, "float32", "bfloat16")  # round 1 has no bf16 partner
    assert row["round"] == 0
    assert row["num_blocks_ratio"] == 2.0
    assert row["running_peak_ratio"] == pytest.approx(19 / 9)
    assert row["output_tokens_per_s_ratio"] == 1.5
