"""Tiny GGUF files written by our own code as llama.cpp's converter (``convert_hf_to_gguf.py``)
writes them, for every architecture served from GGUF (:data:`GGUF_ARCH`).

:func:`write_gguf`: a ``transformers`` config -> its model's parameter names and shapes (built on
the meta device) -> random values -> GGUF tensors under llama.cpp's names (gguf-py's
``TensorNameMap`` for the file's architecture) with the converter's changes (``llama``: q and k
rows permuted for its RoPE, biases too; ``gemma2`` / ``gemma3``: every norm stored as ``1 + w``),
each matrix quantized in its kept format (:data:`MIXED`: Q4_0, Q8_0, Q4_K and Q6_K, merged layers'
shards in different formats in some layers), norms and biases F32; plus the metadata transformers
reads for the config (``<arch>.context_length``, ..., ``general.name`` "mistral" for a Mistral
model: transformers' rule) and the tokenizer (SmolLM2's byte-level BPE cut to the first ``vocab``
tokens and the merges among them; token 1 BOS, 2 EOS, 0 padding).

:func:`write_tiny_gguf`: the tiny Llama file of the K-quant tests (Q5_K / Q4_K / Q6_K).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf_fixtures import pack_k

from services.executor.layers import gguf as G

#: Hugging Face ``model_type`` -> the ``general.architecture`` llama.cpp writes for it
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3_text": "gemma3"}
#: each matrix's format by its GGUF kind (``attn_qkv``, ``ffn_up``: Phi-3's fused q|k|v and gate|up)
MIXED = {"token_embd": G.Q8_0, "output": G.Q6_K, "attn_q": G.Q4_K, "attn_k": G.Q4_K, "attn_v": G.Q4_K,
         "attn_qkv": G.Q8_0, "attn_output": G.Q4_0, "ffn_gate": G.Q4_K, "ffn_up": G.Q4_K, "ffn_down": G.Q6_K}
#: single tensors in another format: layer 0's q | k | v and layer 1's gate | up mix formats
MIXED_OVERRIDES = {"blk.0.attn_v": G.Q6_K, "blk.1.ffn_up": G.Q8_0}


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:  # [H D, ...] -> [H D, ...]
    """llama.cpp's converter's q/k row order: Hugging Face row ``h D + j D/2 + i`` is stored at
    ``h D + 2 i + j`` (whole rows: blocks move with them)."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _write_tokenizer(writer, tokenizer_dir: Path, vocab: int) -> None:
    """SmolLM2's byte-level BPE cut to its first ``vocab`` tokens and the merges among them
    (49k token strings cost seconds at each parse of the file)."""
    from gguf import TokenType

    hf_tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = hf_tok["model"]["vocab"]  # token -> id
    tokens = sorted((t for t in ids if ids[t] < vocab), key=ids.get)
    assert len(tokens) == vocab and hf_tok["model"]["type"] == "BPE"
    special = {a["id"] for a in hf_tok["added_tokens"] if a["special"]}
    known = set(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(vocab)])
    writer.add_token_merges([" ".join(m) for m in hf_tok["model"]["merges"] if "".join(m) in known and set(m) <= known])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # else Phi3Config's default, 32000, lies outside the vocabulary
    writer.add_add_bos_token(False)
    template = tokenizer_dir / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())


def _write_hparams(writer, config, arch: str) -> None:
    """The ``<arch>.*`` keys llama.cpp writes for ``config`` (those transformers reads among them)."""
    from gguf import RopeScalingType

    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer type
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3" and rope.get("rope_type") == "linear":  # the full-attention layers' scaling
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


def _quantize(w: np.ndarray, fmt: G.BlockFormat) -> np.ndarray:  # [N, K] float32 -> [N, K / bs * bb] uint8
    from gguf import GGMLQuantizationType, quants

    return pack_k(w, fmt) if fmt.block_size == 256 else quants.quantize(w, GGMLQuantizationType(fmt.ggml_type))


def write_gguf(path: Path, config, tokenizer_dir: Path, formats: dict[str, G.BlockFormat] = MIXED,
               overrides: dict[str, G.BlockFormat] = MIXED_OVERRIDES, seed: int = 0, std: float = 0.15,
               bias_std: float = 0.5, extra: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Write ``config``'s model as llama.cpp's converter would, with random weights: matrices
    normal (``std``; the embedding 1.0, Gemma's ``0.2 hidden_size ** -0.5``), biases normal (``bias_std``), norm weights ``1 + 0.2 N``
    (Gemma's ``w`` of ``1 + w``: ``0.2 N``). A matrix is stored in ``overrides[<name>]``, else
    ``formats[<kind>]``; the token strings are ``tokenizer_dir``'s (``config.vocab_size`` of them).
    ``extra``: more tensors by GGUF name, stored as they are (F32).

    Returns the Hugging Face state dict the file holds (matrices dequantized by ``gguf.quants``,
    float32; a tied ``lm_head.weight`` is the embedding).
    """
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants
    from transformers import AutoModelForCausalLM

    arch = GGUF_ARCH[config.model_type]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    writer = GGUFWriter(path, arch)
    writer.add_name("mistral" if config.model_type == "mistral" else config.model_type)
    _write_tokenizer(writer, tokenizer_dir, config.vocab_size)
    _write_hparams(writer, config, arch)
    tied = bool(config.tie_word_embeddings)
    gemma = arch in ("gemma2", "gemma3")
    # Gemma multiplies the embedding by sqrt(hidden): scaled down, the layers' outputs weigh as much
    embed_std = 0.2 * config.hidden_size**-0.5 if gemma else 1.0
    rng = np.random.default_rng(seed)
    state: dict[str, torch.Tensor] = {}
    for hf, shape in shapes.items():
        if tied and hf == "lm_head.weight":
            continue
        module, suffix = hf.rsplit(".", 1)
        name = names.get_name(module)
        assert name is not None, f"gguf-py names no tensor for {hf}"
        heads = 0  # llama.cpp permutes llama's q and k rows (weights and biases) for its RoPE
        if arch == "llama" and name.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads if name.endswith(".attn_q") else config.num_key_value_heads
        if len(shape) == 1:  # norms and biases: F32
            norm = "norm" in name
            w = (rng.standard_normal(shape) * (0.2 if norm else bias_std) + (1.0 if norm and not gemma else 0.0))
            stored = w.astype(np.float32) + np.float32(1.0 if norm and gemma else 0.0)  # Gemma's as 1 + w
            state[hf] = torch.from_numpy(stored - np.float32(1.0) if norm and gemma else stored.copy())
            stored = llama_cpp_permute(stored, heads) if heads else stored
        else:
            fmt = overrides.get(name, formats[name.split(".")[-1]])
            w = rng.standard_normal(shape).astype(np.float32) * (embed_std if name == "token_embd" else std)
            raw = _quantize(w, fmt)  # Hugging Face's row order
            state[hf] = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type)))
            stored = llama_cpp_permute(raw, heads) if heads else raw
            writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(stored), raw_dtype=GGMLQuantizationType(fmt.ggml_type))
            continue
        writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(stored))
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


#: the format of each matrix of :func:`write_tiny_gguf` (merged layers' shards share one) but for
#: :data:`TINY_LAYER0_V`
TINY_FORMATS = {"token_embd": G.Q6_K, "attn_q": G.Q5_K, "attn_k": G.Q5_K, "attn_v": G.Q5_K,
                "attn_output": G.Q4_K, "ffn_gate": G.Q4_K, "ffn_up": G.Q4_K, "ffn_down": G.Q6_K}
#: layer 0's attn_v, in another format than its q and k (as llama.cpp's Q4_K_M does)
TINY_LAYER0_V = G.Q6_K


def tiny_hf_config(vocab: int):
    """The ``LlamaConfig`` of :func:`write_tiny_gguf`'s file: head_dim 64, every matrix's input a
    multiple of 256 (as the K-quants need), tied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def write_tiny_gguf(path: Path, tokenizer_dir: Path, vocab: int = 1024, seed: int = 0, std: float = 0.15,
                    mixed: bool = True) -> dict[str, torch.Tensor]:
    """A Llama GGUF at ``path`` (:func:`write_gguf` of :func:`tiny_hf_config`) in
    :data:`TINY_FORMATS`; ``mixed``: layer 0's attn_v in :data:`TINY_LAYER0_V`.

    Returns the Hugging Face state dict of the weights the file holds, for
    ``LlamaForCausalLM(tiny_hf_config(vocab))``.
    """
    return write_gguf(path, tiny_hf_config(vocab), tokenizer_dir, TINY_FORMATS,
                      {"blk.0.attn_v": TINY_LAYER0_V} if mixed else {}, seed=seed, std=std)
