"""Reading a Hugging Face ``config.json`` (a ``transformers`` config object or its dict): the
sizes the executor needs, what this engine refuses, and the RoPE parameters."""

from __future__ import annotations

from typing import Any

import torch


def config_value(cfg: Any, name: str, default: Any = None) -> Any:
    """``cfg.name`` for a transformers config or ``cfg[name]`` for a dict."""
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


# model_type -> the class AutoModelForCausalLM builds for it, for configs without ``architectures``
_CAUSAL_LM_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architectures_of(hf_config: Any) -> list[str]:
    """The config's ``architectures``; without that entry, the causal-LM class of its
    ``model_type`` (as ``AutoModelForCausalLM`` picks it), or ``[]``."""
    archs = config_value(hf_config, "architectures") or []
    if not archs and config_value(hf_config, "model_type") in _CAUSAL_LM_OF_MODEL_TYPE:
        archs = [_CAUSAL_LM_OF_MODEL_TYPE[config_value(hf_config, "model_type")]]
    return list(archs)


def head_dim_of(hf_config: Any) -> int:
    """Per-head size: ``head_dim`` when the config has it, else ``hidden_size // num_attention_heads``."""
    return config_value(hf_config, "head_dim") or config_value(hf_config, "hidden_size") // config_value(hf_config, "num_attention_heads")


def num_kv_heads_of(hf_config: Any) -> int:
    """``num_key_value_heads`` (GQA), defaulting to ``num_attention_heads`` (MHA)."""
    return config_value(hf_config, "num_key_value_heads") or config_value(hf_config, "num_attention_heads")


def kv_cache_shape(hf_config: Any, num_blocks: int, block_size: int,
                   num_kv_heads: int | None = None) -> tuple[int, int, int, int]:
    """Shape of one layer's K (and of its V) cache: ``[num_blocks, block_size, Hkv, head_dim]``;
    ``num_kv_heads``: a tensor-parallel rank's (default: the model's)."""
    return (num_blocks, block_size, num_kv_heads or num_kv_heads_of(hf_config), head_dim_of(hf_config))


def kv_cache_bytes_per_block(hf_config: Any, block_size: int, dtype: torch.dtype,
                             num_kv_heads: int | None = None) -> int:
    """Bytes of one block of K and V across all layers (to size the block pool);
    ``num_kv_heads``: a tensor-parallel rank's (default: the model's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * (num_kv_heads or num_kv_heads_of(hf_config)) * head_dim_of(hf_config) * elem
    return per_layer * config_value(hf_config, "num_hidden_layers")


def check_supported(hf_config: Any) -> None:
    """Refuse what this implementation would compute wrongly.

    Raises:
        ValueError: sliding-window attention (Mistral ``sliding_window`` below
            ``max_position_embeddings``, Qwen2 ``use_sliding_window`` layers), an activation
            other than SiLU, or an unsupported RoPE type.
    """
    max_pos = config_value(hf_config, "max_position_embeddings", 0)
    window = config_value(hf_config, "sliding_window")
    archs = architectures_of(hf_config)
    if "MistralForCausalLM" in archs and window is not None and window < max_pos:
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window attention "
            "is not supported by this Mistral implementation"
        )
    if "sliding_attention" in (config_value(hf_config, "layer_types") or []) or (
        config_value(hf_config, "use_sliding_window", False) and window is not None and window < max_pos
    ):
        raise ValueError(f"sliding-window attention layers (sliding_window={window}) are not supported")
    act = config_value(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    rope_parameters(hf_config)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings as one flat dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs use ``rope_theta``
    plus an optional ``rope_scaling`` dict (``type`` or ``rope_type``). Both are read.

    Raises:
        ValueError: a rope type other than ``default`` / ``llama3``, or per-layer-type RoPE.
    """
    params = config_value(hf_config, "rope_parameters") or config_value(hf_config, "rope_scaling") or {}
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {sorted(params)}")
    params.setdefault("rope_theta", config_value(hf_config, "rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", config_value(hf_config, "max_position_embeddings"))
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"llama3 RoPE needs {key!r} in rope parameters")
    return params
