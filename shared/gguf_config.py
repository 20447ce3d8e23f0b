"""The served ``config.json`` of a GGUF file: transformers' reading of its metadata, completed
with what the file states and that reading leaves to the config class's defaults.

transformers' GGUF support (``integrations/ggml.py``'s ``GGUF_CONFIG_MAPPING``) maps each
architecture's metadata keys onto config attributes; what it does not map falls back to the
config class's defaults, which for several architectures are not the file's model:

==========  ===========================================================================================
file        completed from the file
==========  ===========================================================================================
any         ``head_dim`` from ``<arch>.attention.key_length`` (Qwen3Config's default is 128)
llama       Llama 3.1's RoPE scaling from ``rope_freqs.weight`` (``[head_dim / 2]`` float32: each
            frequency's divisor, as llama.cpp's converter computes it from the ``llama3`` scaling
            and llama.cpp applies it), served as a ``longrope`` scaling with those divisors as both
            factor lists and ``attention_factor`` 1 (LongRoPE's frequencies are ``1 / (factor_i
            theta ** (2i / d))``: llama.cpp's; transformers' reading drops the tensor, and with it
            the scaling of the low frequencies at every position)
phi3        the share of each head rotated, ``partial_rotary_factor``, from ``phi3.rope.dimension_count``
            (Phi-4-mini rotates 96 of 128 dimensions; transformers' mapping drops the key)
phi3        LongRoPE (Phi-3 128k) from ``rope_factors_long`` / ``rope_factors_short`` (``[head_dim / 2]``
            float32 tensors), ``phi3.rope.scaling.original_context_length`` and
            ``phi3.rope.scaling.attn_factor``: a ``longrope`` scaling (transformers' reading drops it)
gemma2,     ``query_pre_attn_scalar`` (the softmax scale's square), which no key states: ``head_dim``,
gemma3      and ``hidden_size / num_attention_heads`` for the 27B models (46 layers for Gemma 2, 62 for
            Gemma 3), as llama.cpp decides it (transformers keeps the config class's 256: right for
            Gemma 2 2B / 9B and Gemma 3 up to 12B, not for the 27B ones, 144 and 168)
gemma3      the full-attention layers' linear RoPE scaling (``gemma3.rope.scaling.type`` / ``.factor``)
qwen2moe    ``moe_intermediate_size`` from ``expert_feed_forward_length`` and
            ``shared_expert_intermediate_size`` from ``expert_shared_feed_forward_length`` (unmapped:
            Qwen2MoeConfig's defaults, 1408 and 5632, are Qwen1.5-MoE-A2.7B's)
qwen3moe    ``moe_intermediate_size`` from ``expert_feed_forward_length`` (default 768)
gpt2        ``n_positions`` from ``position_embd``'s rows (transformers maps ``context_length`` to
            ``n_ctx``, which GPT-2 no longer reads) and ``n_inner`` from ``ffn_up``'s rows (the
            converter writes ``feed_forward_length`` as ``4 n_embd`` whatever the model's)
falcon      the new decoder architecture (Falcon-40B/180B, Falcon 2) when the file has several KV
            heads or a second norm (``attn_norm_2``): ``new_decoder_architecture``,
            ``num_kv_heads`` (transformers writes ``num_key_value_heads``, which FalconConfig does
            not read), ``num_ln_in_parallel_attn``; ``layer_norm_epsilon`` from
            ``falcon.attention.layer_norm_epsilon``; ``ffn_hidden_size`` from ``ffn_up``'s rows;
            ``tie_word_embeddings`` from whether the file has ``output.weight`` (transformers
            always ties Falcon's)
==========  ===========================================================================================

Without this, transformers' reading of a Falcon-40B file is Falcon-7B's architecture, and a
Qwen2-MoE / Qwen3-MoE file with other expert sizes than those defaults does not fit its config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class GGUFConfigError(ValueError):
    """The file is of a form that is not served from GGUF (the message says why)."""


def gguf_value(reader: Any, key: str) -> Any:
    """A GGUF metadata value (a string, a number, or a list of them), or None."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _rows(reader: Any, name: str) -> int | None:  # a file matrix's rows (GGUF lists dims innermost first)
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return None if tensor is None else int(tensor.shape[-1])


def complete_gguf_config(config: dict, reader: Any, gguf: Path) -> None:
    """Complete transformers' reading ``config`` (a dict, changed in place) of the file ``gguf``
    (read by ``reader``, a ``GGUFReader``) with what the file states (the module docstring's table).

    Raises:
        GGUFConfigError: RoPE factors (``rope_freqs``, ``rope_factors_*``) that are not one
            positive value per rotated pair, LongRoPE factors in a file other than phi3's or
            without their original context length.
    """
    arch = gguf_value(reader, "general.architecture")
    head_dim = gguf_value(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    scaling, factor = gguf_value(reader, f"{arch}.rope.scaling.type"), gguf_value(reader, f"{arch}.rope.scaling.factor")
    if arch in ("gemma2", "gemma3"):
        big = config.get("num_hidden_layers") == {"gemma2": 46, "gemma3": 62}[arch]
        config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if big
                                           else config.get("head_dim", 256))
    if arch == "gemma3" and scaling == "linear" and factor is not None:
        full = config["rope_parameters"]["full_attention"]
        config["rope_parameters"]["full_attention"] = {**full, "rope_type": "linear", "factor": float(factor)}
    if arch in ("qwen2moe", "qwen3moe"):
        for key, attr in (("expert_feed_forward_length", "moe_intermediate_size"),
                          ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
            value = gguf_value(reader, f"{arch}.{key}")
            if value is not None:
                config[attr] = int(value)
    if arch == "gpt2":
        config["n_positions"] = _rows(reader, "position_embd.weight") or config.get("n_positions")
        config["n_inner"] = _rows(reader, "blk.0.ffn_up.weight") or config.get("n_inner")
    if arch == "falcon":
        _complete_falcon(config, reader)
    if arch == "phi3":
        _partial_rotary(config, reader)
    if arch == "llama" and any(t.name == "rope_freqs.weight" for t in reader.tensors):
        _rope_freqs(config, reader, gguf)
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        _longrope(config, reader, gguf, arch)


def _partial_rotary(config: dict, reader: Any) -> None:
    """Phi-3's share of each head rotated from ``phi3.rope.dimension_count`` (Phi-4-mini: 96 of 128)."""
    rotated = gguf_value(reader, "phi3.rope.dimension_count")
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if rotated is not None and 0 < int(rotated) < head:
        share = int(rotated) / head
        config["partial_rotary_factor"] = share
        config["rope_parameters"] = {**(config.get("rope_parameters") or {}), "partial_rotary_factor": share}


def _factors(config: dict, reader: Any, gguf: Path, name: str) -> list[float]:
    """The float32 tensor ``name``: one positive RoPE factor per rotated pair of a head's dimensions.

    Raises:
        GGUFConfigError: it is missing, or not one positive value per pair.
    """
    tensor = next((t for t in reader.tensors if t.name == name), None)
    factors = [] if tensor is None else [float(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    pairs = int(head_dim * partial) // 2
    if len(factors) != pairs or min(factors) <= 0:
        raise GGUFConfigError(f"{gguf}: {name} holds {len(factors)} values (smallest {min(factors, default=0):g}); "
                              f"a head rotating {2 * pairs} dimensions needs {pairs}, each positive")
    return factors


def _rope_freqs(config: dict, reader: Any, gguf: Path) -> None:
    """Llama 3.1's frequency divisors (``rope_freqs.weight``) as a ``longrope`` scaling (the module
    docstring's table).

    Raises:
        GGUFConfigError: not one positive divisor per rotated pair of dimensions.
    """
    factors = _factors(config, reader, gguf, "rope_freqs.weight")
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_parameters"] = {
        **rope, "rope_type": "longrope", "rope_theta": theta, "short_factor": factors, "long_factor": factors,
        "factor": 1.0, "attention_factor": 1.0,  # one list for every length: no long-context switch
    }


def _longrope(config: dict, reader: Any, gguf: Path, arch: str) -> None:
    """Phi-3's LongRoPE as llama.cpp's converter stores it (the module docstring's table).

    Raises:
        GGUFConfigError: another architecture than phi3, factors that do not fit the heads, or no
            ``<arch>.rope.scaling.original_context_length``.
    """
    if arch != "phi3":
        raise GGUFConfigError(f"{gguf}: LongRoPE factors (rope_factors_long / short) are served from phi3 GGUF "
                              f"files only, not {arch}")
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise GGUFConfigError(f"{gguf}: LongRoPE factors without {arch}.rope.scaling.original_context_length")
    rope = config.get("rope_parameters") or {}
    config["rope_parameters"] = {
        **rope, "rope_type": "longrope", "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        "short_factor": _factors(config, reader, gguf, "rope_factors_short.weight"),
        "long_factor": _factors(config, reader, gguf, "rope_factors_long.weight"),
        "original_max_position_embeddings": int(original),
    }
    config["original_max_position_embeddings"] = int(original)
    attention_factor = gguf_value(reader, f"{arch}.rope.scaling.attn_factor")
    if attention_factor is not None:
        config["rope_parameters"]["attention_factor"] = float(attention_factor)


def _complete_falcon(config: dict, reader: Any) -> None:
    """Falcon's architecture as the file states it (llama.cpp's converter writes ``head_count_kv``
    and, for the new architecture's two norms, ``attn_norm_2``)."""
    names = {t.name for t in reader.tensors}
    kv_heads = int(gguf_value(reader, "falcon.attention.head_count_kv") or 1)
    two_norms = "blk.0.attn_norm_2.weight" in names
    if kv_heads > 1 or two_norms:
        config.update(new_decoder_architecture=True, num_kv_heads=kv_heads, num_ln_in_parallel_attn=2 if two_norms else 1)
    eps = gguf_value(reader, "falcon.attention.layer_norm_epsilon")
    if eps is not None:
        config["layer_norm_epsilon"] = float(eps)
    config["ffn_hidden_size"] = _rows(reader, "blk.0.ffn_up.weight") or config.get("ffn_hidden_size")
    config["tie_word_embeddings"] = "output.weight" not in names
