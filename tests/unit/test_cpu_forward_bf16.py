"""The fused CPU forward (``worker/cpu_forward.py`` :class:`FusedCpuForward`) on a bf16
model (``dtype="bfloat16"``: packed bf16 linear layers and head): chosen by the runner with
fp32 and bf16 KV caches, the same bits as the per-layer path on the packed kernel, the same
greedy tokens over chunked prefill and decodes, and an error, not garbage, when its bf16
GEMM fails."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import GREEDY, TINY_PROMPTS, FakeScheduler, use_forward
from torch import nn

from pagedserve.kernels import cpu_native
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.cpu_forward import (
    CpuLayerForward,
    FusedCpuForward,
    bf16_cpu_path_available,
    mlp_forward,
    runs_fused,
)
from pagedserve.worker.forward import select_forward
from pagedserve.worker.input_batch import SequenceState, prepare_inputs
from pagedserve.worker.model import LayerForward
from pagedserve.worker.packed_linear_bf16 import (
    ONEDNN_MIN_ROWS,
    PackedLinearBf16,
    default_onednn_min_rows,
    onednn_bf16_available,
    packed_logits_bf16,
)
from pagedserve.worker.precision import read_cpu_flags
from pagedserve.worker.worker import Worker

pytestmark = pytest.mark.skipif(
    not (cpu_native.gemm_available() and bf16_cpu_path_available()),
    reason="the bf16 CPU path is not built here",
)

BLOCK_SIZE = 4
NUM_BLOCKS = 160
KV_DTYPES = ["float32", "bfloat16"]


def bf16_worker(model_dir: Path, kv_cache_dtype: str = "auto") -> Worker:
    return Worker(
        WorkerConfig(
            model=ModelConfig(model=str(model_dir), dtype="bfloat16"),
            cache=CacheConfig(
                block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, kv_cache_dtype=kv_cache_dtype
            ),
            device="cpu",
        )
    )


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_the_runner_picks_the_fused_forward_for_bf16_weights(
    tiny_llama_dir: Path, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = bf16_worker(tiny_llama_dir, kv).runner
    model = runner.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinearBf16)
    assert runner.kv_pool.dtype == getattr(torch, kv)
    assert model.model_forward.name == "cpu-fused"
    caches = runner.kv_pool.layer_caches()
    chosen = select_forward(model, caches)
    assert isinstance(chosen, FusedCpuForward) and chosen.name == "cpu-fused"
    # On AMX the bf16 layers keep no oneDNN copy: the one C call runs every step.
    # oneDNN copies only beside AMX tiles the packed kernel does not use.
    assert chosen.per_layer_from == default_onednn_min_rows()
    assert chosen.per_layer_from == (
        ONEDNN_MIN_ROWS if "amx_bf16" in read_cpu_flags() and not cpu_native.amx_chosen() else None
    )
    assert [entry.w_bf16 for entry in chosen.layers] == [1, 1]
    assert [entry.kv_type for entry in chosen.layers] == [int(kv == "bfloat16")] * 2
    monkeypatch.setenv("PAGEDSERVE_FUSED_LAYERS", "0")
    assert bf16_worker(tiny_llama_dir, kv).runner.model.model_forward.name == "cpu-layers"


def test_steps_from_the_onednn_crossover_run_per_layer() -> None:
    assert runs_fused(1, None) and runs_fused(4096, None)
    assert runs_fused(ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS)
    assert not runs_fused(ONEDNN_MIN_ROWS, ONEDNN_MIN_ROWS)
    assert not runs_fused(512, ONEDNN_MIN_ROWS)


def small_step(worker: Worker, chunk_len: int = 10):
    """One step's ModelInputs of ``chunk_len + 1`` rows: a ``chunk_len``-token prefill chunk
    over an 8-token cached prefix (of ``TINY_PROMPTS[4]``, or of a longer prompt where the
    chunk needs one) and a decode of ``TINY_PROMPTS[0]`` at position 8."""
    long, short = list(TINY_PROMPTS[4]), TINY_PROMPTS[0]
    if len(long) < 8 + chunk_len:
        long = [3 + (7 * i) % 120 for i in range(8 + chunk_len)]
    chunk = SequenceState("a", long, len(long), list(range(30)), 0, GREEDY, 0, 0)
    chunk.num_computed_tokens = 8
    decode = SequenceState("b", list(short), len(short), [60, 59, 58], 0, GREEDY, 0, 0)
    decode.num_computed_tokens = 8
    return prepare_inputs([(chunk, chunk_len), (decode, 1)], BLOCK_SIZE, NUM_BLOCKS, "cpu")


def run_step(
    worker: Worker, forward: str, chunk_len: int = 10
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits of every row of :func:`small_step` on ``forward``, from the same random
    cache contents, and the caches afterwards."""
    model, pool = worker.runner.model, worker.runner.kv_pool
    inputs = small_step(worker, chunk_len)
    gen = torch.Generator().manual_seed(0)
    for cache in pool.key_caches + pool.value_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    use_forward(worker, forward)
    with torch.inference_mode():
        logits = model(
            inputs.input_ids, inputs.positions, pool.layer_caches(), inputs.attn_metadata,
            torch.arange(chunk_len + 1),
        )  # fmt: skip
    return logits, [c.clone() for c in pool.key_caches + pool.value_caches]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_fused_equals_the_per_layer_path_bit_for_bit(tiny_llama_dir: Path, kv: str) -> None:
    worker = bf16_worker(tiny_llama_dir, kv)
    before = [c.clone() for c in worker.runner.kv_pool.key_caches]
    fused, fused_caches = run_step(worker, "cpu-fused")
    layers, layer_caches = run_step(worker, "cpu-layers")
    assert fused.dtype == torch.float32 and fused.shape == (11, 128)
    assert fused.abs().max() > 0.5  # real logits, not a zeroed buffer
    assert torch.equal(fused, layers)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layer_caches))
    assert not torch.equal(fused_caches[0], before[0])  # the step's K rows were stored


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_a_step_of_more_than_a_tile_of_rows_is_the_per_layer_paths_bits(
    tiny_llama_dir: Path, kv: str
) -> None:
    """41 rows: where AMX is chosen, the fused call runs gate_up, SiLU and the product as one
    tile epilogue (``linear_packed_bf16_silu_mul_amx``); the logits and caches are still the
    per-layer path's (three calls) bit for bit."""
    worker = bf16_worker(tiny_llama_dir, kv)
    fused, fused_caches = run_step(worker, "cpu-fused", chunk_len=40)
    layers, layer_caches = run_step(worker, "cpu-layers", chunk_len=40)
    assert fused.shape == (41, 128) and fused.abs().max() > 0.5
    assert torch.equal(fused, layers)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layer_caches))


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_equals_the_per_layer_path_over_prefill_and_decode(
    tiny_llama_dir: Path, kv: str
) -> None:
    worker = bf16_worker(tiny_llama_dir, kv)
    results = []
    for forward in ("cpu-fused", "cpu-layers"):
        use_forward(worker, forward)
        # A budget of 24: whole prompts (steps past the crossover, on the per-layer path),
        # chunks mixed with decodes, then decode-only steps of up to 3 rows (fused).
        sched = FakeScheduler(worker, BLOCK_SIZE, NUM_BLOCKS, token_budget=24, max_num_seqs=3)
        results.append(sched.generate(TINY_PROMPTS, 20))
    fused, layers = results
    assert len({tuple(o[:4]) for o in fused}) == len(TINY_PROMPTS)
    assert fused == layers


@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 here")
@pytest.mark.parametrize("rows", [ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 70])
def test_the_mlp_on_bf16_activations_is_the_fp32_chains_bits(rows: int) -> None:
    """From the oneDNN crossover up, gate/up's bf16 output feeds SiLU * up in bf16 and the
    down layer reads that: the bits of widening gate/up to fp32 and rounding the product
    inside the down layer (below the crossover the fp32 chain itself runs)."""
    torch.manual_seed(3)
    hidden, inter = 64, 96
    gate_up = PackedLinearBf16(nn.Linear(hidden, 2 * inter, bias=False), ONEDNN_MIN_ROWS)
    down = PackedLinearBf16(nn.Linear(inter, hidden, bias=False), ONEDNN_MIN_ROWS)
    layer = SimpleNamespace(mlp=SimpleNamespace(gate_up_proj=gate_up, down_proj=down))
    normed = torch.randn(rows, hidden)
    with torch.inference_mode():
        want = down(cpu_native.silu_mul(gate_up(normed)))
        got = mlp_forward(layer, normed.to(torch.bfloat16))  # type: ignore[arg-type]
        assert gate_up.runs_onednn(rows) == (rows >= ONEDNN_MIN_ROWS)
        assert gate_up(normed, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert got.dtype == torch.float32 and got.shape == (rows, hidden)
    assert got.abs().max() > 0.01
    assert torch.equal(got, want)


@pytest.mark.parametrize(("rows", "bias"), [(1, False), (41, True), (65, False), (300, True)])
def test_the_packed_mlp_runs_one_fused_call_with_the_three_calls_bits(
    rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed bf16 gate/up and down: mlp_forward computes gate/up, SiLU * up and its bf16
    rounding in one call where the kernel takes it (AVX512-BF16: from 65 rows; AMX: above
    16 rows with a width a multiple of 32), and the result is the three-call chain's bits
    either way."""
    torch.manual_seed(rows)
    hidden, inter = 64, 80
    gate_up = PackedLinearBf16(nn.Linear(hidden, 2 * inter, bias=bias), None)
    down = PackedLinearBf16(nn.Linear(inter, hidden, bias=bias), None)
    layer = SimpleNamespace(mlp=SimpleNamespace(gate_up_proj=gate_up, down_proj=down))
    normed = torch.randn(rows, hidden).to(torch.bfloat16)
    fused_calls = []
    real = cpu_native.linear_packed_bf16_silu_mul

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        fused_calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_native, "linear_packed_bf16_silu_mul", counting)
    with torch.inference_mode():
        want = down(cpu_native.silu_mul(gate_up(normed)))
        got = mlp_forward(layer, normed)  # type: ignore[arg-type]
    assert got.dtype == torch.float32 and got.shape == (rows, hidden)
    assert got.abs().max() > 0.01
    assert torch.equal(got, want)
    takes = rows >= 65 if not cpu_native.amx_chosen() else (rows > 16 and inter % 32 == 0)
    assert fused_calls == [takes]


def test_onednn_runs_by_default_only_beside_amx_tiles_the_packed_kernel_leaves() -> None:
    amx_cpu = frozenset({"avx512_bf16", "amx_tile", "amx_bf16"})
    assert default_onednn_min_rows(frozenset({"avx512f", "avx512_bf16"})) is None
    assert default_onednn_min_rows(amx_cpu) == (None if cpu_native.amx_chosen() else 16)


def test_a_failed_bf16_gemm_raises_instead_of_returning_logits(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = bf16_worker(tiny_llama_dir)
    use_forward(worker, "cpu-fused")
    lib = cpu_native.load()
    assert lib is not None
    real = lib.decoder_layers_f32

    def failing(*args: object) -> int:
        real(*args)
        return -1  # as when linear_packed_bf16 cannot allocate its scratch

    monkeypatch.setattr(lib, "decoder_layers_f32", failing)
    with pytest.raises(RuntimeError, match="bf16 linear layer failed on 11 rows"):
        run_step(worker, "cpu-fused")


def test_layers_of_mixed_weight_dtypes_are_not_fused(tiny_llama_dir: Path) -> None:
    bf16 = bf16_worker(tiny_llama_dir).runner.model
    fp32 = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
            device="cpu",
        )
    ).runner
    caches = fp32.kv_pool.layer_caches()
    fp32.model.layers[1].mlp.down_proj = bf16.layers[1].mlp.down_proj
    assert FusedCpuForward.build(fp32.model, caches) is None
    assert CpuLayerForward.build(fp32.model, caches) is not None


def test_without_the_packed_gemm_a_bf16_model_runs_the_generic_path(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PAGEDSERVE_CPU_GEMM=0 leaves the bf16 nn.Linear layers and bf16 norm weights, which
    # the C kernels cannot read (they read fp32 norms and feed fp32 rows): the generic
    # torch path runs the model instead, in bf16.
    packed, _ = run_step(bf16_worker(tiny_llama_dir), "cpu-fused", chunk_len=40)
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "0")
    worker = bf16_worker(tiny_llama_dir)
    model = worker.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert type(qkv) is torch.nn.Linear and qkv.weight.dtype == torch.bfloat16
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    caches = worker.runner.kv_pool.layer_caches()
    assert CpuLayerForward.build(model, caches) is None
    assert FusedCpuForward.build(model, caches) is None
    assert isinstance(model.model_forward, LayerForward)
    logits, _ = run_step(worker, model.model_forward.name, chunk_len=40)
    assert logits.shape == packed.shape == (41, 128) and torch.isfinite(logits).all()
    # bf16 activations against fp32 ones: close, and the same greedy token on every row
    err = (logits.float() - packed).abs().max().item()
    assert 0 < err < 0.1 * packed.abs().max().item()
    assert torch.equal(logits.float().argmax(-1), packed.argmax(-1))


def test_a_bf16_model_gives_the_logits_rounded_to_bf16(tiny_llama_dir: Path) -> None:
    # As an unpacked bf16 head (HF's, vLLM's) returns them: a greedy tie in bf16 then goes
    # to the lowest id, as theirs does.
    worker = bf16_worker(tiny_llama_dir)
    model = worker.runner.model
    h = torch.randn(5, model.arch.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model.lm_logits(h)
        if model.lm_head is not None:
            sums = model.lm_head(h)
        else:
            sums = packed_logits_bf16(h, model.packed_head, model.arch.vocab_size)
    assert got.dtype == torch.float32 and got.shape == (5, model.arch.vocab_size)
    assert not torch.equal(got, sums)  # the fp32 sums were rounded
    assert torch.equal(got, sums.to(torch.bfloat16).float())
    logits, _ = run_step(worker, "cpu-fused")
    assert logits.abs().max() > 0.5
    assert (logits.view(torch.int32) & 0xFFFF).eq(0).all()
