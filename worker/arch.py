"""The architecture facts the worker needs, read from a model folder's config.json.

:func:`ModelArch.from_pretrained` reads the config with transformers' ``AutoConfig`` and
flattens it into a frozen dataclass. Only decoder families whose forward pass equals the
Llama one implemented in :mod:`pagedserve.worker.model` are accepted; each is covered by a
test against HF transformers (``tests/unit/test_model_tiny.py``):

* ``LlamaForCausalLM`` (Touvron et al., 2023): optional attention / MLP biases.
* ``MistralForCausalLM``: Llama with a sliding window, accepted only when the window is
  absent or covers ``max_model_len`` (then it is full attention).
* ``Qwen2ForCausalLM``: Llama with q/k/v biases, same sliding-window rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelArch:
    """Shapes and options of a Llama-family decoder.

    Attributes:
        architecture: HF class name, one of ``SUPPORTED_ARCHITECTURES``.
        vocab_size, hidden_size, intermediate_size: model widths.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention heads (grouped-query when
            ``num_kv_heads < num_heads``) and their width.
        rms_norm_eps: RMSNorm epsilon.
        rope_parameters: ``rope_parameters`` items (``rope_theta``, ``rope_type``, ...) as
            a sorted tuple of pairs (hashable); see :attr:`rope`.
        max_position_embeddings: the model's context length.
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        qkv_bias, o_bias, mlp_bias: which projections carry a bias.
        eos_token_ids: end-of-sequence ids from config.json and generation_config.json.
        bos_token_id: beginning-of-sequence id, or None.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def rope(self) -> dict[str, Any]:
        """``rope_parameters`` as a dict."""
        return dict(self.rope_parameters)

    @classmethod
    def from_hf_config(cls, config: Any, max_model_len: int | None = None) -> ModelArch:
        """Build from a transformers ``PretrainedConfig``.

        Args:
            config: the loaded HF config.
            max_model_len: the serving context length, used to decide whether a sliding
                window is effectively full attention (defaults to the model's).

        Raises:
            ValueError: unsupported architecture, activation or attention variant.
        """
        archs = list(getattr(config, "architectures", None) or [])
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs or config.model_type!r}; pagedserve "
                f"supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu' / SwiGLU)")
        if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
            raise ValueError("pretraining_tp != 1 is not supported")
        max_pos = int(config.max_position_embeddings)
        _check_sliding_window(config, arch, max_model_len or max_pos)
        rope = _rope_parameters(config)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_parameters=tuple(sorted(rope.items())),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            eos_token_ids=_as_ids(getattr(config, "eos_token_id", None)),
            bos_token_id=getattr(config, "bos_token_id", None),
        )

    @classmethod
    def from_pretrained(
        cls, model_dir: str | os.PathLike[str], max_model_len: int | None = None
    ) -> ModelArch:
        """Read ``model_dir/config.json`` (and ``generation_config.json`` for EOS ids).

        Raises:
            ValueError: unsupported model (see :meth:`from_hf_config`).
            OSError: the folder has no readable config.json.
        """
        from transformers import AutoConfig, GenerationConfig

        arch = cls.from_hf_config(AutoConfig.from_pretrained(model_dir), max_model_len)
        if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
            gen = GenerationConfig.from_pretrained(model_dir)
            extra = [i for i in _as_ids(gen.eos_token_id) if i not in arch.eos_token_ids]
            if extra:
                from dataclasses import replace

                arch = replace(arch, eos_token_ids=arch.eos_token_ids + tuple(extra))
        return arch


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings; transformers 5 keeps theta in ``rope_parameters``."""
    params = getattr(config, "rope_parameters", None)
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope = dict(params or {})
    if rope.get("rope_theta") is None:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise ValueError("config has no rope_theta (neither top level nor rope_parameters)")
        rope["rope_theta"] = theta
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return rope


def _check_sliding_window(config: Any, arch: str, max_model_len: int) -> None:
    """Refuse sliding-window attention unless the window covers every sequence."""
    window = getattr(config, "sliding_window", None)
    if arch == "Qwen2ForCausalLM":
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" not in layer_types and not getattr(
            config, "use_sliding_window", False
        ):
            return
    elif arch != "MistralForCausalLM":
        return
    if window is not None and window < max_model_len:
        raise ValueError(
            f"sliding-window attention (window {window} < max_model_len {max_model_len}) "
            "is not supported; serve with max_model_len <= the window"
        )
