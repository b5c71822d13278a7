"""Architecture parsing, RoPE settings and weight loading: what is accepted and what is
refused with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.worker.arch import ModelArch
from pagedserve.worker.layers import rope_inv_freq
from pagedserve.worker.weights import load_model


def copy_with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_arch_of_tiny_llama(tiny_llama_dir: Path) -> None:
    arch = ModelArch.from_pretrained(tiny_llama_dir)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 6, 2, 16)
    assert arch.rope == {"rope_theta": 10000.0, "rope_type": "default"}
    assert arch.eos_token_ids == (2,) and not arch.tie_word_embeddings


def test_unsupported_architecture_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = copy_with_config(tiny_llama_dir, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="supports LlamaForCausalLM, MistralForCausalLM"):
        ModelArch.from_pretrained(bad)


def test_unsupported_rope_and_activation(tiny_llama_dir: Path, tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        rope_inv_freq(16, yarn)
    with pytest.raises(ValueError, match="lacks 'low_freq_factor'"):
        rope_inv_freq(16, {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})
    gelu = copy_with_config(tiny_llama_dir, tmp_path / "g", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelArch.from_pretrained(gelu)


def test_sliding_window_refused_unless_it_covers_the_context(tmp_path: Path) -> None:
    from helpers import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "mistral", "MistralForCausalLM", sliding_window=32)
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelArch.from_pretrained(model_dir)
    assert ModelArch.from_pretrained(model_dir, max_model_len=32).architecture.startswith("Mis")


def test_llama3_rope_scaling_bands() -> None:
    base = rope_inv_freq(64, {"rope_type": "default", "rope_theta": 500000.0})
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    scaled = rope_inv_freq(64, params)
    wavelen = 2 * torch.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    mid = ~high & ~low
    assert bool(((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all())


def test_missing_and_unknown_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    arch = ModelArch.from_pretrained(tiny_llama_dir)
    weights = load_file(tiny_llama_dir / "model.safetensors")

    def folder_with(tensors: dict[str, torch.Tensor], name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        return d

    missing = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"lacks weights for: layers\.1\.self_attn\.qkv_proj"):
        load_model(folder_with(missing, "missing"), arch, 64, torch.float32, torch.device("cpu"))
    extra = {**weights, "model.layers.0.mlp.fancy.weight": torch.zeros(2)}
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.fancy\.weight'"
    ):
        load_model(folder_with(extra, "extra"), arch, 64, torch.float32, torch.device("cpu"))
    wrong = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="has shape"):
        load_model(folder_with(wrong, "wrong"), arch, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path, arch, 64, torch.float32, torch.device("cpu"))


def test_bf16_load_keeps_fp32_rope_tables(tiny_llama_dir: Path) -> None:
    arch = ModelArch.from_pretrained(tiny_llama_dir)
    model = load_model(tiny_llama_dir, arch, 64, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.cos_table.dtype == torch.float32
    ref = load_file(tiny_llama_dir / "model.safetensors")
    fused = model.layers[1].self_attn.qkv_proj.weight
    torch.testing.assert_close(fused[96:128].float(), ref["model.layers.1.self_attn.k_proj.weight"].bfloat16().float())  # fmt: skip


def test_weights_follow_the_safetensors_index(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from pagedserve.cluster.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.worker import Worker

    folder = tmp_path / "with_extra"
    shutil.copytree(tiny_llama_dir, folder)
    weights = next(folder.glob("*.safetensors")).name
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, folder / "consolidated.safetensors")
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(folder), dtype="float32"), cache=CacheConfig(num_blocks=8)
        )
    )
    assert worker.get_info().num_blocks == 8
