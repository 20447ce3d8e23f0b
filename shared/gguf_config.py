"""The served ``config.json`` of a GGUF file: transformers' reading of its metadata, completed
with what the file states and that reading leaves to the config class's defaults.

transformers' GGUF support (``integrations/ggml.py``'s ``GGUF_CONFIG_MAPPING``) maps each
architecture's metadata keys onto config attributes; what it does not map falls back to the
config class's defaults, which for several architectures are not the file's model:

==========  ===========================================================================================
file        completed from the file
==========  ===========================================================================================
any         ``head_dim`` from ``<arch>.attention.key_length`` (Qwen3Config's default is 128)
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
        GGUFConfigError: a Phi-3 file with LongRoPE factors (``rope_factors_long`` /
            ``rope_factors_short``: tensors transformers does not read into the config, so the
            served model would rotate otherwise than its checkpoint).
    """
    arch = gguf_value(reader, "general.architecture")
    head_dim = gguf_value(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    scaling, factor = gguf_value(reader, f"{arch}.rope.scaling.type"), gguf_value(reader, f"{arch}.rope.scaling.factor")
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
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise GGUFConfigError(f"{gguf}: {arch} GGUF files with LongRoPE factors (rope_factors_long / short) are "
                              "not served from GGUF (transformers reads no LongRoPE from them); convert it to a "
                              "Hugging Face directory")


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
