"""Where each GGUF architecture's tensors go in our model classes, and what llama.cpp's converter
(``convert_hf_to_gguf.py``) did to them that loading undoes.

Keyed by the file's ``general.architecture``; the names are llama.cpp's (gguf-py's
``TENSOR_NAMES``), those of decoder layer ``N`` under ``blk.N.``. Our module (under
``model.layers.N``) takes its GGUF tensors' ``.weight`` rows in the order listed (a merged layer:
q | k | v, gate | up) and, where the module has a bias, their ``.bias`` likewise.

=======  =========================  ========================================================================
file     served as (``config``)     differences from ``llama``'s map
=======  =========================  ========================================================================
llama    Llama, Mistral             (the base) q and k rows, biases too, stored permuted for llama.cpp's RoPE
                                    (pairs of a head's rows interleaved); ``rope_freqs`` (Llama 3's RoPE
                                    factors) not read, as transformers does not read them
qwen2    Qwen2                      no permutation; ``attn_q`` / ``attn_k`` / ``attn_v.bias`` ->
                                    ``qkv_proj.bias``
qwen3    Qwen3                      no permutation; ``attn_q_norm`` / ``attn_k_norm`` -> per-head q / k norms
phi3     Phi-3                      no permutation; ``attn_qkv`` (rows q | k | v) -> ``qkv_proj`` and
                                    ``ffn_up`` (rows gate | up) -> ``gate_up_proj``, whole
gemma2   Gemma 2                    no permutation; ``post_attention_norm``, ``ffn_norm`` (before the MLP),
                                    ``post_ffw_norm``; every norm stored as ``1 + w`` (the factor Gemma's
                                    RMSNorm applies), loaded as the stored value minus 1 in float32, as
                                    transformers' ``Gemma2TensorProcessor`` does
gemma3   Gemma 3 text               gemma2's, plus ``attn_q_norm`` / ``attn_k_norm`` (also ``1 + w``)
=======  =========================  ========================================================================

Phi-3 files with ``rope_factors_long`` / ``rope_factors_short`` (LongRoPE) are not served: the
factors are tensors transformers does not read into the config, so the model would rotate
differently from its checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GGUFTensorMap:
    """One GGUF architecture's tensors -> our modules.

    ``layer``: our module under ``model.layers.N`` -> its GGUF tensors under ``blk.N`` in row
    order; ``permuted``: the tensor kinds whose rows llama.cpp permuted for its RoPE, with the
    attention's head count that permutes them (``"q"`` or ``"kv"``); ``norm_offset``: what the
    file adds to every norm weight; ``ignored``: tensors that are read by nothing.
    """

    layer: dict[str, tuple[str, ...]]
    permuted: dict[str, str] = field(default_factory=dict)
    norm_offset: float = 0.0
    ignored: tuple[str, ...] = ()


#: our module (from the model's root) -> its GGUF tensor, the same for every architecture
MODEL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

_LLAMA_LAYER = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
    "input_layernorm": ("attn_norm",),
    "post_attention_layernorm": ("ffn_norm",),
}
_QK_NORMS = {"self_attn.q_norm": ("attn_q_norm",), "self_attn.k_norm": ("attn_k_norm",)}
_GEMMA2_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "post_attention_layernorm"},
    "post_attention_layernorm": ("post_attention_norm",),  # Gemma 2/3: the attention output's norm
    "pre_feedforward_layernorm": ("ffn_norm",),
    "post_feedforward_layernorm": ("post_ffw_norm",),
}

GGUF_TENSOR_MAPS: dict[str, GGUFTensorMap] = {
    "llama": GGUFTensorMap(_LLAMA_LAYER, permuted={"attn_q": "q", "attn_k": "kv"}, ignored=("rope_freqs.weight",)),
    "qwen2": GGUFTensorMap(_LLAMA_LAYER),
    "qwen3": GGUFTensorMap({**_LLAMA_LAYER, **_QK_NORMS}),
    "phi3": GGUFTensorMap({**_LLAMA_LAYER, "self_attn.qkv_proj": ("attn_qkv",), "mlp.gate_up_proj": ("ffn_up",)}),
    "gemma2": GGUFTensorMap(_GEMMA2_LAYER, norm_offset=1.0),
    "gemma3": GGUFTensorMap({**_GEMMA2_LAYER, **_QK_NORMS}, norm_offset=1.0),
}


def tensor_map(architecture: str) -> GGUFTensorMap:
    """The map of a file's ``general.architecture``.

    Raises:
        ValueError: an architecture not served from GGUF (the message lists those that are).
    """
    found = GGUF_TENSOR_MAPS.get(architecture)
    if found is None:
        raise ValueError(f"GGUF architecture {architecture!r} is not served from GGUF "
                         f"(served: {sorted(GGUF_TENSOR_MAPS)})")
    return found
