"""Precision as a choice: the ``auto`` rule (checkpoint dtype x device x CPU flags), the
``--dtype`` / ``--kv-cache-dtype`` flags and configs, the KV pool's dtype and size, and a
bf16 model and a bf16 KV cache running on CPU through the offline API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.kv_pool import bytes_per_block
from pagedserve.worker.precision import (
    checkpoint_dtype,
    cpu_has_native_bf16,
    native_dtypes,
    parse_cpu_flags,
    read_cpu_flags,
    resolve_kv_cache_dtype,
    resolve_model_dtype,
)
from pagedserve.worker.worker import Worker

SPR = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})  # Sapphire Rapids
ICL = frozenset({"avx2", "avx512f", "avx512_vnni"})  # Ice Lake: bf16 emulated
AMX_ONLY = frozenset({"avx512f", "amx_bf16"})


@pytest.mark.parametrize(
    ("checkpoint", "device", "flags", "bf16_kernels", "expected"),
    [
        # CUDA: the checkpoint's 16-bit dtype; bf16 for fp32 (or unknown) checkpoints.
        ("bfloat16", "cuda", frozenset(), False, "bfloat16"),
        ("float16", "cuda", frozenset(), False, "float16"),
        ("float32", "cuda", frozenset(), False, "bfloat16"),
        (None, "cuda", frozenset(), False, "bfloat16"),
        # CPU today: the fast kernels are fp32, whatever the checkpoint or the flags.
        ("bfloat16", "cpu", SPR, False, "float32"),
        ("float16", "cpu", SPR, False, "float32"),
        ("float32", "cpu", SPR, False, "float32"),
        ("float32", "cpu", ICL, False, "float32"),
        # CPU with a bf16 path: bf16 where the flags say native, fp32 where emulated.
        ("float32", "cpu", SPR, True, "bfloat16"),
        ("float32", "cpu", AMX_ONLY, True, "bfloat16"),
        ("bfloat16", "cpu", SPR, True, "bfloat16"),
        ("float16", "cpu", SPR, True, "bfloat16"),
        ("float32", "cpu", ICL, True, "float32"),
        ("bfloat16", "cpu", ICL, True, "float32"),
        (None, "cpu", frozenset(), True, "float32"),
    ],
)
def test_auto_resolution_table(checkpoint, device, flags, bf16_kernels, expected) -> None:
    native = native_dtypes(device, flags, cpu_bf16_kernels=bf16_kernels)
    assert resolve_model_dtype("auto", checkpoint, native) == expected
    assert resolve_kv_cache_dtype("auto", expected) == expected


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [("bfloat16", "float16"), ("float16", "float16"), ("float32", "float16"), (None, "float16")],
)
def test_auto_on_a_gpu_without_bf16_is_fp16(checkpoint, expected) -> None:
    native = native_dtypes("cuda", frozenset(), cuda_bf16=False)
    assert native == {"float32", "float16"}
    assert resolve_model_dtype("auto", checkpoint, native) == expected


def test_explicit_dtypes_win_over_the_rule() -> None:
    cpu = native_dtypes("cpu", ICL)
    assert resolve_model_dtype("bfloat16", "float32", cpu) == "bfloat16"
    assert resolve_model_dtype("float32", "bfloat16", native_dtypes("cuda", frozenset())) == (
        "float32"
    )
    assert resolve_kv_cache_dtype("float16", "float32") == "float16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_model_dtype("fp8", None, cpu)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", "float32")
    for name in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        assert resolve_kv_cache_dtype(name, "bfloat16") == "float8_e4m3fn"


def test_cpu_flags_from_cpuinfo(tmp_path: Path) -> None:
    text = (
        "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    flags = parse_cpu_flags(text)
    assert flags == {"fpu", "avx512f", "avx512_bf16", "amx_tile"}
    assert cpu_has_native_bf16(flags)
    assert cpu_has_native_bf16(frozenset({"amx_bf16"}))
    assert not cpu_has_native_bf16(ICL)
    assert parse_cpu_flags("Features\t: fp asimd bf16\n") == frozenset()
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert read_cpu_flags(str(path)) == flags
    assert read_cpu_flags(str(tmp_path / "absent")) == frozenset()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32", "dtype": "bfloat16"}, "float32"),
        ({"torch_dtype": "float"}, "float32"),
        ({"torch_dtype": "int8"}, None),
        ({}, None),
    ],
)
def test_checkpoint_dtype_from_config_json(tmp_path: Path, config, expected) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(str(tmp_path)) == expected


def test_checkpoint_dtype_without_config_json(tmp_path: Path) -> None:
    assert checkpoint_dtype(str(tmp_path)) is None


def test_configs_refuse_unknown_dtypes_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^dtype must be auto, float32, float16 or bfloat16"):
        ModelConfig(dtype="fp8")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be auto, float32"):
        CacheConfig(kv_cache_dtype="int4")
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    assert CacheConfig().kv_cache_dtype == "auto"


def test_serve_flags_reach_the_configs() -> None:
    parser = build_parser()
    cfg = serve_config(
        parser.parse_args(["serve", "--dtype", "bfloat16", "--kv-cache-dtype", "float16"])
    )
    assert (cfg.model.dtype, cfg.cache.kv_cache_dtype) == ("bfloat16", "float16")
    wc = cfg.worker_config(0)
    assert (wc.model.dtype, wc.cache.kv_cache_dtype) == ("bfloat16", "float16")
    default = serve_config(parser.parse_args(["serve"]))
    assert (default.model.dtype, default.cache.kv_cache_dtype) == ("auto", "auto")
    fp8 = serve_config(parser.parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    assert fp8.cache.kv_cache_dtype == "fp8"
    i8 = serve_config(parser.parse_args(["serve", "--kv-cache-dtype", "int8"]))
    assert i8.cache.kv_cache_dtype == "int8"


@pytest.mark.parametrize(("flag", "bad"), [("--dtype", "fp8"), ("--kv-cache-dtype", "int4")])
def test_a_bad_dtype_flag_is_refused_by_name(flag: str, bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", flag, bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: '{bad}'" in err


def worker_for(model_dir: Path, dtype: str = "auto", **cache) -> Worker:
    return Worker(
        WorkerConfig(
            model=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=64),
            cache=CacheConfig(block_size=4, **cache),
            device="cpu",
        )
    )


def test_bf16_kv_holds_twice_the_blocks_of_fp32(tiny_llama_dir: Path) -> None:
    fp32 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20)
    per_block = bytes_per_block(fp32.runner.arch, 4, torch.float32)
    assert per_block == 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 layers, 4 tokens, 2 heads, dim 16
    bf16 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20, kv_cache_dtype="bfloat16")
    a, b = fp32.get_info(), bf16.get_info()
    assert (a.dtype, a.kv_cache_dtype, a.num_blocks) == ("float32", "float32", 512)
    assert (b.dtype, b.kv_cache_dtype, b.num_blocks) == ("float32", "bfloat16", 1024)
    assert (a.block_bytes, b.block_bytes) == (per_block, per_block // 2)
    assert bf16.runner.kv_pool.dtype == torch.bfloat16
    assert bf16.runner.kv_pool.nbytes == fp32.runner.kv_pool.nbytes == 1 << 20
    # The fused CPU kernels read either cache (fp32 weights and activations both times).
    assert fp32.runner.model.model_forward.name == "cpu-fused"
    assert bf16.runner.model.model_forward.name == "cpu-fused"


def test_fp8_kv_holds_four_times_the_blocks_of_fp32(tiny_llama_dir: Path) -> None:
    fp32 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20)
    fp8 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    bf16 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20, kv_cache_dtype="bfloat16")
    a, b, c = fp32.get_info(), fp8.get_info(), bf16.get_info()
    assert (b.dtype, b.kv_cache_dtype, b.num_blocks) == ("float32", "float8_e4m3fn", 2048)
    assert (a.num_blocks, c.num_blocks) == (512, 1024)
    assert b.block_bytes == a.block_bytes // 4 == 2 * 2 * 4 * 2 * 16
    assert fp8.runner.kv_pool.dtype == torch.float8_e4m3fn
    assert fp8.runner.kv_pool.nbytes == 1 << 20
    assert fp8.runner.model.model_forward.name == "cpu-fused"


def test_int8_kv_holds_its_elements_and_scales_in_each_block(tiny_llama_dir: Path) -> None:
    fp32 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20)
    i8 = worker_for(tiny_llama_dir, "float32", kv_cache_memory=1 << 20, kv_cache_dtype="int8")
    a, b = fp32.get_info(), i8.get_info()
    # per (token, KV head): 16 int8 elements and a 4-byte scale, against 64 bytes of fp32
    assert b.block_bytes == 2 * 2 * 4 * 2 * (16 + 4) == a.block_bytes * 20 // 64
    assert (b.dtype, b.kv_cache_dtype, b.num_blocks) == ("float32", "int8", (1 << 20) // 640)
    assert a.num_blocks == 512 and b.num_blocks == 1638  # 3.2x here; 3.76x at head_dim 64
    pool = i8.runner.kv_pool
    assert pool.dtype == torch.int8 and pool.key_caches[0].shape == (1638, 4, 2, 20)
    assert pool.nbytes == 1638 * 640 <= 1 << 20
    assert i8.runner.model.model_forward.name == "cpu-fused"


def test_int8_kv_resolves_to_its_name() -> None:
    assert resolve_kv_cache_dtype("int8", "bfloat16") == "int8"
    assert CacheConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


PROMPT = "hello paged world"


@pytest.fixture(scope="module")
def fp32_tokens(tiny_llama_dir: Path) -> list[int]:
    with LLM(
        str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, device="cpu", dtype="float32"
    ) as engine:
        return list(engine.generate([PROMPT], greedy(8))[0].outputs[0].token_ids)


@pytest.mark.parametrize(
    ("options", "dtype", "kv_dtype"),
    [
        ({"dtype": "bfloat16"}, "bfloat16", "bfloat16"),
        # fp32 pinned: "auto" is bf16 on a CPU with the bf16 kernels.
        ({"dtype": "float32", "kv_cache_dtype": "bfloat16"}, "float32", "bfloat16"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, "bfloat16", "float32"),
        ({"dtype": "float32", "kv_cache_dtype": "fp8"}, "float32", "float8_e4m3fn"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}, "bfloat16", "float8_e4m3fn"),
        ({"dtype": "float32", "kv_cache_dtype": "int8"}, "float32", "int8"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "int8"}, "bfloat16", "int8"),
    ],
)
def test_llm_runs_other_precisions_on_cpu(
    tiny_llama_dir: Path, fp32_tokens: list[int], options, dtype: str, kv_dtype: str
) -> None:
    with LLM(
        str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, device="cpu", **options
    ) as engine:
        assert (engine.info.dtype, engine.info.kv_cache_dtype) == (dtype, kv_dtype)
        spec = engine.scheduler.workers[0].spec
        assert (spec.dtype, spec.kv_cache_dtype) == (dtype, kv_dtype)
        out = engine.generate([PROMPT], greedy(8))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text
    assert all(0 <= t < 128 for t in out.token_ids)
    # Rounding may flip a near tie late; the first greedy token is far from one here.
    assert out.token_ids[0] == fp32_tokens[0]


def test_int8_kv_generic_layers_match_the_c_kernels(tiny_llama_dir: Path) -> None:
    """The torch reference (the generic layers) and the C kernels read the same dequantised
    int8 values: the same greedy tokens."""
    runs = []
    for backend in ("torch", "auto"):
        with LLM(
            str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, device="cpu", dtype="float32",
            kv_cache_dtype="int8", attention_backend=backend,
        ) as engine:  # fmt: skip
            out = engine.generate([PROMPT, "abc " * 9], greedy(8))
            runs.append([list(o.outputs[0].token_ids) for o in out])
    assert runs[0] == runs[1]


def test_batch_invariance_needs_an_fp32_kv_cache(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype float32.*kv_cache_dtype bfloat16,"):
        Worker(
            WorkerConfig(
                model=ModelConfig(model=str(tiny_llama_dir), batch_invariant=True),
                cache=CacheConfig(block_size=4, num_blocks=8, kv_cache_dtype="bfloat16"),
                device="cpu",
            )
        )
