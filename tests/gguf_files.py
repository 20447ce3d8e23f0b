"""Tiny GGUF files written by our own code as llama.cpp's converter (``convert_hf_to_gguf.py``)
writes them, for every architecture served from GGUF (:data:`GGUF_ARCH`).

:func:`write_gguf`: a ``transformers`` config -> its model's parameter names and shapes (built on
the meta device) -> random values -> GGUF tensors under llama.cpp's names (gguf-py's
``TensorNameMap`` for the file's architecture) with the converter's changes (``llama``: q and k
rows permuted for its RoPE, biases too; ``gemma2`` / ``gemma3``: every norm stored as ``1 + w``;
``gpt2``: HF's ``Conv1D`` weights transposed; ``falcon``: ``query_key_value``'s rows per KV group
stored as q | k | v; MoE experts stacked ``[E, rows, K]``, gate and up apart; ``[1, K]`` squeezed),
each matrix quantized in its format (:data:`MIXED`: Q4_0, Q8_0, Q4_K and Q6_K, merged layers'
shards in different formats in some layers; MoE routers F32; or formats not kept: F16, F32,
:data:`Q5_0`), norms and biases F32; plus the metadata transformers reads for the config
(``<arch>.context_length``, ..., ``general.name`` "mistral" for a Mistral model: transformers'
rule) and the tokenizer (SmolLM2's byte-level BPE cut to the first ``vocab`` tokens and the
merges among them; token 1 BOS, 2 EOS, 0 padding).

:func:`write_tiny_gguf`: the tiny Llama file of the K-quant tests (Q5_K / Q4_K / Q6_K).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf_fixtures import pack_k

from services.executor.layers.quantization import gguf as G

#: Hugging Face ``model_type`` -> the ``general.architecture`` llama.cpp writes for it
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "gpt2": "gpt2", "falcon": "falcon"}
#: unquantized matrices (llama.cpp keeps MoE routers, ``ffn_gate_inp``, in F32)
F32 = G.BlockFormat("F32", 0, 1, 4)
F16 = G.BlockFormat("F16", 1, 1, 2)
#: a quantization the engine does not keep (dequantized at load); gguf-py quantizes it
Q5_0 = G.BlockFormat("Q5_0", 6, 32, 22)
#: each matrix's format by its GGUF kind (``attn_qkv``, ``ffn_up``: Phi-3's fused q|k|v and gate|up;
#: ``*_exps``: MoE experts stacked, the gate and up experts in two formats; ``*_shexp``: Qwen2-MoE's
#: shared expert)
MIXED = {"token_embd": G.Q8_0, "output": G.Q6_K, "attn_q": G.Q4_K, "attn_k": G.Q4_K, "attn_v": G.Q4_K,
         "attn_qkv": G.Q8_0, "attn_output": G.Q4_0, "ffn_gate": G.Q4_K, "ffn_up": G.Q4_K, "ffn_down": G.Q6_K,
         "position_embd": F32, "ffn_gate_inp": F32, "ffn_gate_exps": G.Q4_K, "ffn_up_exps": G.Q8_0,
         "ffn_down_exps": G.Q8_0, "ffn_gate_shexp": G.Q4_K, "ffn_up_shexp": G.Q4_K, "ffn_down_shexp": G.Q6_K}
#: single tensors in another format: layer 0's q | k | v and layer 1's gate | up mix formats; layer
#: 1's down experts Q4_0
MIXED_OVERRIDES = {"blk.0.attn_v": G.Q6_K, "blk.1.ffn_up": G.Q8_0, "blk.1.ffn_down_exps": G.Q4_0}
#: GPT-2's matrices held by HF's ``Conv1D`` (``[in, out]``), which llama.cpp's converter transposes
GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


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
    """The ``<arch>.*`` keys llama.cpp's converter writes for ``config`` (those transformers reads among them)."""
    from gguf import RopeScalingType

    c = config
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_head_count(c.num_attention_heads)
    if arch in ("gpt2", "falcon"):  # GPT2Model / FalconModel's keys: LayerNorm, an MLP of 4 hidden
        writer.add_context_length(c.max_position_embeddings)
        writer.add_feed_forward_length(4 * c.hidden_size)
        writer.add_layer_norm_eps(c.layer_norm_epsilon)
        if arch == "falcon":
            writer.add_head_count_kv(_falcon_kv_heads(c))
        return
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer type
    writer.add_context_length(c.max_position_embeddings)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3" and rope.get("rope_type") == "linear":  # the full-attention layers' scaling
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # the factors are tensors (write_gguf)
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def llama3_rope_freqs(config) -> np.ndarray:  # [head_dim / 2] float32
    """llama.cpp's converter's ``rope_freqs`` for a ``llama3`` RoPE scaling (Llama 3.1): each
    frequency's divisor, 1 for wavelengths below ``original / high_freq_factor``, ``factor`` above
    ``original / low_freq_factor``, ``1 / ((1 - smooth) / factor + smooth)`` between."""
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _quantize(w: np.ndarray, fmt: G.BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., N, K]`` float32 -> the stored rows (``[..., N, K / bs * bb]`` uint8 blocks, or
    F16 / F32 values) and the values they hold (``[..., N, K]`` float32, by ``gguf.quants``)."""
    from gguf import GGMLQuantizationType, quants

    if fmt.block_size == 1:  # F32 / F16: values
        raw = w.astype(np.float16 if fmt.ggml_type == 1 else np.float32)
        return raw, raw.astype(np.float32)
    rows = w.reshape(-1, w.shape[-1])
    raw = pack_k(rows, fmt) if fmt.block_size == 256 else quants.quantize(rows, GGMLQuantizationType(fmt.ggml_type))
    raw = raw.reshape(*w.shape[:-1], -1)
    return raw, np.array(quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type)), dtype=np.float32)


def falcon_qkv_rows(rows: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:  # [(H + 2 Hkv) D, ...]
    """llama.cpp's converter's Falcon ``attn_qkv``: Hugging Face's rows per KV group ``[Hkv, H / Hkv
    + 2, D]`` (the group's queries, its key, its value) stored as q | k | v (whole rows)."""
    d = rows.shape[0] // (heads + 2 * kv_heads)
    g = rows.reshape(kv_heads, heads // kv_heads + 2, d, *rows.shape[1:])
    return np.concatenate((g[:, :-2].reshape(-1, *rows.shape[1:]), g[:, -2].reshape(-1, *rows.shape[1:]),
                           g[:, -1].reshape(-1, *rows.shape[1:])))


def _falcon_kv_heads(config) -> int:  # Hugging Face's: 1 in the old multi-query architecture
    return config.num_kv_heads if config.new_decoder_architecture else 1


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
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
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

    def matrix(name: str, w: np.ndarray) -> torch.Tensor:  # w [..., rows, K] f32 in HF's order -> its values
        fmt = overrides.get(name, formats[name.split(".")[-1]])
        raw, values = _quantize(w, fmt)  # Hugging Face's row order
        heads = 0  # llama.cpp permutes llama's q and k rows (weights and biases) for its RoPE
        if arch == "llama" and name.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads if name.endswith(".attn_q") else config.num_key_value_heads
        stored = llama_cpp_permute(raw, heads) if heads else raw
        if arch == "falcon" and name.endswith(".attn_qkv"):
            stored = falcon_qkv_rows(stored, config.num_attention_heads, _falcon_kv_heads(config))
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(stored),
                          raw_dtype=None if fmt.block_size == 1 else GGMLQuantizationType(fmt.ggml_type))
        return torch.from_numpy(values)

    for hf, shape in shapes.items():
        if tied and hf == "lm_head.weight":
            continue
        if hf.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [E, rows, K]: stacked per kind
            layer = int(hf.split(".")[2])
            w = rng.standard_normal(shape).astype(np.float32) * std
            if hf.endswith("down_proj"):
                state[hf] = matrix(f"blk.{layer}.ffn_down_exps", w)
            else:  # gate rows | up rows of each expert
                half = shape[1] // 2
                state[hf] = torch.cat((matrix(f"blk.{layer}.ffn_gate_exps", w[:, :half]),
                                       matrix(f"blk.{layer}.ffn_up_exps", w[:, half:])), dim=1)
            continue
        module, suffix = hf.rsplit(".", 1)
        name = names.get_name(module)
        assert name is not None, f"gguf-py names no tensor for {hf}"
        if len(shape) == 2 and shape[0] > 1:  # a matrix
            w = rng.standard_normal(shape).astype(np.float32) * (embed_std if name == "token_embd" else std)
            if arch == "gpt2" and name.split(".")[-1] in GPT2_CONV1D:  # HF's Conv1D [in, out]: stored transposed
                state[hf] = matrix(name, np.ascontiguousarray(w.T)).T.contiguous()
            else:
                state[hf] = matrix(name, w)
            continue
        # norms, biases and [1, K] (squeezed by the converter): F32 values
        norm = "norm" in name and suffix == "weight"
        w = (rng.standard_normal(shape) * (0.2 if norm else bias_std) + (1.0 if norm and not gemma else 0.0))
        stored = w.astype(np.float32) + np.float32(1.0 if norm and gemma else 0.0)  # Gemma's as 1 + w
        state[hf] = torch.from_numpy(stored - np.float32(1.0) if norm and gemma else stored.copy())
        stored = stored.reshape(-1)
        if arch == "llama" and name.endswith((".attn_q", ".attn_k")):
            stored = llama_cpp_permute(stored, config.num_attention_heads if name.endswith(".attn_q")
                                       else config.num_key_value_heads)
        writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(stored))
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type")
    if rope_type == "llama3":
        extra = {"rope_freqs.weight": llama3_rope_freqs(config), **(extra or {})}
    if rope_type == "longrope" and arch == "phi3":
        extra = {f"rope_factors_{k}.weight": np.array(config.rope_parameters[f"{k}_factor"], dtype=np.float32)
                 for k in ("long", "short")} | (extra or {})
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    if tied:
        state["lm_head.weight"] = state[next(k for k in shapes if names.get_name(k.rsplit(".", 1)[0]) == "token_embd")]
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
