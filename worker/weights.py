"""Build a :class:`LlamaForCausalLM` and load its weights from ``*.safetensors`` files.

Tensors are read with the safetensors library (never ``torch.load``: no pickle), mapped from
HF parameter names to ours, cast to the serving dtype and copied onto the device. q/k/v and
gate/up projections are written into the row ranges of their fused matrices. Every
parameter must be covered exactly: an unknown tensor name or a missing one raises.

The module skeleton is created on the ``meta`` device and materialized with ``to_empty``,
so no time is spent on random initialization.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedserve.worker.arch import ModelArch
from pagedserve.worker.model import LlamaForCausalLM

# HF tensors that carry no weights we use.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_FUSED = re.compile(
    r"^layers\.(\d+)\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$"
)


def _shard_rows(arch: ModelArch) -> dict[str, tuple[str, int, int]]:
    """Shard name -> (fused module name, first row, row count) inside the fused matrix."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    return {
        "q": ("self_attn.qkv_proj", 0, q),
        "k": ("self_attn.qkv_proj", q, kv),
        "v": ("self_attn.qkv_proj", q + kv, kv),
        "gate": ("mlp.gate_up_proj", 0, inter),
        "up": ("mlp.gate_up_proj", inter, inter),
    }


def _read_whole(f: Any, hf_name: str, name: str) -> torch.Tensor:
    return f.get_tensor(hf_name)


def load_weights(
    model: LlamaForCausalLM,
    model_dir: str | os.PathLike[str],
    read: Callable[[Any, str, str], torch.Tensor] = _read_whole,
) -> None:
    """Copy every tensor of ``model_dir/*.safetensors`` into ``model`` (in place).

    ``read(f, hf_name, name)`` gives the tensor to copy from the open safetensors file
    ``f`` (default: all of it; a tensor-parallel rank reads its slice,
    :meth:`pagedserve.worker.sharding.ShardPlan.read`); the fused row ranges are those of
    ``model.arch``.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_dir``.
        ValueError: an unknown tensor name, a shape mismatch, or parameters left unloaded.
    """
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        # Only the shards the index names: folders may ship other formats side by side
        # (e.g. Mistral's consolidated.safetensors).
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [Path(model_dir) / n for n in names]
    else:
        files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    shards = _shard_rows(model.arch)
    # Row ranges still to fill, per parameter: fused ones need each shard once.
    pending: dict[str, set[str]] = {}
    for name in params:
        if ".qkv_proj." in name:
            pending[name] = {"q", "k", "v"}
        elif ".gate_up_proj." in name:
            pending[name] = {"gate", "up"}
        else:
            pending[name] = {""}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = hf_name.removeprefix("model.")
                if _IGNORED.match(name):
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: some checkpoints store the copy anyway
                _load_one(params, pending, shards, name, read(f, hf_name, name), hf_name)
    missing = sorted(n for n, left in pending.items() if left)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing)}")


def _load_one(
    params: dict[str, torch.nn.Parameter],
    pending: dict[str, set[str]],
    shards: dict[str, tuple[str, int, int]],
    name: str,
    tensor: torch.Tensor,
    hf_name: str,
) -> None:
    fused = _FUSED.match(name)
    if fused:
        layer, _, qkv, gate_up, kind = fused.groups()
        shard = qkv or gate_up
        module, row, rows = shards[shard]
        target = f"layers.{layer}.{module}.{kind}"
        if target not in params:
            raise ValueError(f"unexpected tensor {hf_name!r} (model has no {target})")
        dest = params[target].data[row : row + rows]
    else:
        target, shard = name, ""
        if target not in params:
            raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
        dest = params[target].data
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
        )
    if shard not in pending[target]:
        raise ValueError(f"tensor {hf_name!r} appears twice")
    dest.copy_(tensor.to(dtype=dest.dtype))
    pending[target].discard(shard)


def load_model(
    model_dir: str | os.PathLike[str],
    arch: ModelArch,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "auto",
) -> LlamaForCausalLM:
    """Create the model on ``device`` in ``dtype`` and load its weights (eval mode).

    Args:
        model_dir: HF folder with ``*.safetensors`` weights.
        arch: architecture read from the folder's config.
        max_positions: RoPE table length (serving ``max_model_len``).
        dtype: parameter dtype (float32, float16 or bfloat16); RoPE tables stay fp32.
        device: where parameters live.
        backend: attention kernel backend.

    Raises:
        see :func:`load_weights`.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions, backend)
    model = model.to_empty(device=device)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.rotary_emb.reset_tables()
    with torch.no_grad():
        load_weights(model, model_dir)
    return model.eval().requires_grad_(False)
