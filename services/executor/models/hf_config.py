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
_CAUSAL_LM_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM",
    "falcon": "FalconForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}


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
    """``num_key_value_heads`` (GQA), defaulting to ``num_attention_heads`` (MHA); Falcon's:
    ``num_kv_heads`` in its new decoder architecture, else 1 when ``multi_query``."""
    if config_value(hf_config, "model_type") == "falcon":
        if config_value(hf_config, "new_decoder_architecture", False):
            return config_value(hf_config, "num_kv_heads") or config_value(hf_config, "num_attention_heads")
        if config_value(hf_config, "multi_query", True):
            return 1
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
    """Refuse what the Llama-family implementation would compute wrongly.

    Raises:
        ValueError: an activation other than SiLU, or an unsupported RoPE type.
    """
    act = config_value(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    rope_parameters(hf_config)


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (tokens, itself included; None: the whole context),
    as Hugging Face applies them: ``layer_types`` (``"sliding_attention"`` layers, e.g. Qwen2's
    ``use_sliding_window`` from ``max_window_layers`` on, Gemma 2/3's alternation) when the
    config has it, else ``sliding_window`` on every layer (Mistral) when set. A window of at
    least ``max_position_embeddings`` tokens changes nothing and is None here (the fast
    kernels serve such layers)."""
    window = config_value(hf_config, "sliding_window")
    if window is not None and window >= (config_value(hf_config, "max_position_embeddings") or window + 1):
        window = None
    num_layers = config_value(hf_config, "num_hidden_layers")
    layer_types = config_value(hf_config, "layer_types")
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * num_layers


#: the RoPE types :func:`rope_parameters` accepts (``services/executor/layers/rotary_embedding.py``)
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE settings as one flat dict with ``rope_type``, ``rope_theta`` and
    ``partial_rotary_factor`` (the share of each head rotated).

    transformers 5 keeps them in ``config.rope_parameters`` (per layer type for Gemma 3:
    ``{"sliding_attention": {...}, "full_attention": {...}}``, read for ``layer_type``); older
    configs use ``rope_theta`` plus an optional ``rope_scaling`` dict (``type`` or
    ``rope_type``) and ``partial_rotary_factor`` / ``rotary_pct``. All are read.

    Raises:
        ValueError: a rope type not in ``ROPE_TYPES``, per-layer-type RoPE without a
            ``layer_type`` (or without that type), or a scaling without its keys.
    """
    params = config_value(hf_config, "rope_parameters") or config_value(hf_config, "rope_scaling") or {}
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        if layer_type is None or not isinstance(params.get(layer_type), dict):
            raise ValueError(f"per-layer-type RoPE parameters {sorted(params)} need a layer type (got {layer_type!r})")
        params = dict(params[layer_type])
    params.setdefault("rope_theta", config_value(hf_config, "rope_theta") or 10000.0)
    params.setdefault("partial_rotary_factor", config_value(hf_config, "partial_rotary_factor")
                      or config_value(hf_config, "rotary_pct") or 1.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported (only {', '.join(map(repr, ROPE_TYPES))})")
    params["rope_type"] = rope_type
    max_position = config_value(hf_config, "max_position_embeddings")
    if rope_type in ("llama3", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          config_value(hf_config, "original_max_position_embeddings") or max_position)
    needs = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "linear": ("factor",),
             "longrope": ("short_factor", "long_factor")}.get(rope_type, ())
    for key in needs:
        if key not in params:
            raise ValueError(f"{rope_type} RoPE needs {key!r} in rope parameters")
    if rope_type == "longrope":
        params["max_position_embeddings"] = max_position
    return params
