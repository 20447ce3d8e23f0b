"""Where each GGUF architecture's tensors go in our model classes, and what llama.cpp's converter
(``convert_hf_to_gguf.py``) did to them that loading undoes.

Keyed by the file's ``general.architecture``; the names are llama.cpp's (gguf-py's
``TENSOR_NAMES``), those of decoder layer ``N`` under ``blk.N.``. Our module (under
``model.layers.N``; GPT-2's and Falcon's under ``transformer.h.N``) takes its GGUF tensors'
``.weight`` rows in the order listed (a merged layer: q | k | v, gate | up) and, where the
module has a bias, their ``.bias`` likewise.

=======  =========================  ========================================================================
file     served as (``config``)     differences from ``llama``'s map
=======  =========================  ========================================================================
llama    Llama, Mistral             (the base) q and k rows, biases too, stored permuted for llama.cpp's RoPE
                                    (pairs of a head's rows interleaved); ``rope_freqs`` (Llama 3.1's RoPE
                                    divisors) is no weight: ``shared/gguf_config.py`` serves it as the
                                    config's RoPE scaling
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
qwen2moe Qwen2-MoE                  qwen2's attention; ``ffn_gate_inp`` (the router, F32) -> ``mlp.gate``; the
                                    experts stacked ``[E, I, hidden]`` (``ffn_gate_exps``, ``ffn_up_exps``) and
                                    ``[E, hidden, I]`` (``ffn_down_exps``) -> ``mlp.experts``; the shared
                                    expert's ``ffn_gate_shexp`` | ``ffn_up_shexp``, ``ffn_down_shexp``, and its
                                    gate ``ffn_gate_inp_shexp`` (``[hidden]``: the converter squeezes ``[1,
                                    hidden]``)
qwen3moe Qwen3-MoE                  qwen3's attention (q / k norms), qwen2moe's router and experts, no shared
                                    expert
gpt2     GPT-2                      under ``transformer``: ``position_embd`` -> ``wpe``; LayerNorms with
                                    biases; ``attn_qkv`` (rows q | k | v), ``attn_output``, ``ffn_up``,
                                    ``ffn_down`` with biases, stored as ``nn.Linear`` rows (the converter
                                    transposed HF's ``Conv1D`` ``[in, out]``): our layers' rows as they are
falcon   Falcon                     under ``transformer``: ``attn_qkv`` rows q | k | v (the converter
                                    de-interleaved HF's per-KV-group ``query_key_value``: our layer's own
                                    order); ``attn_norm`` is ``input_layernorm`` or (the new decoder
                                    architecture) ``ln_mlp``, ``attn_norm_2`` ``ln_attn``; no biases
=======  =========================  ========================================================================

Only llama.cpp's ``llama`` converter permutes q / k rows: qwen2moe, qwen3moe and falcon use
NeoX-style RoPE, stored in Hugging Face's order; gpt2 has no RoPE. A module of the map that
this model does not have (Falcon's ``ln_attn`` in the old architecture, Qwen3-MoE's shared
expert) is skipped; a file tensor nothing read is an error.

RoPE factors stored as tensors (Llama 3.1's ``rope_freqs``, Phi-3's LongRoPE ``rope_factors_long``
/ ``rope_factors_short``) are no weights: ``shared/gguf_config.py`` puts them in the served
config's RoPE scaling.

:func:`gguf_quant_config` reads, from the file's header alone, each of our modules' tensor types
through this map: the ``GGUFConfig`` the model is built with (``layers/quantization/gguf/``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from services.executor.layers.quantization.gguf import GGUFConfig
from services.executor.model_loader.gguf_header import read_header

#: our module (from the model's root) -> its GGUF tensor, for the ``model.layers`` architectures
MODEL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True)
class GGUFTensorMap:
    """One GGUF architecture's tensors -> our modules.

    ``layer``: our module under ``<layers>.N`` -> its GGUF tensors under ``blk.N`` in row
    order (a :class:`~services.executor.layers.fused_moe.FusedMoE`: gate, up, down experts);
    ``model``: our modules from the model's root -> their GGUF tensor (the embedding's is
    ``token_embd``, the LM head's ``output``); ``layers``: the decoder layers' list from the
    root; ``permuted``: the tensor kinds whose rows llama.cpp permuted for its RoPE, with the
    attention's head count that permutes them (``"q"`` or ``"kv"``); ``norm_offset``: what the
    file adds to every norm weight; ``ignored``: tensors that are read by nothing.
    """

    layer: dict[str, tuple[str, ...]]
    model: dict[str, str] = field(default_factory=lambda: dict(MODEL_TENSORS))
    layers: str = "model.layers"
    permuted: dict[str, str] = field(default_factory=dict)
    norm_offset: float = 0.0
    ignored: tuple[str, ...] = ()


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

_ATTENTION = {k: v for k, v in _LLAMA_LAYER.items() if not k.startswith("mlp.")}
_MOE = {"mlp.gate": ("ffn_gate_inp",), "mlp.experts": ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
_SHARED_EXPERT = {
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
    "mlp.shared_expert.down_proj": ("ffn_down_shexp",),
    "mlp.shared_expert_gate": ("ffn_gate_inp_shexp",),
}
_GPT2_LAYER = {"ln_1": ("attn_norm",), "attn.c_attn": ("attn_qkv",), "attn.c_proj": ("attn_output",),
               "ln_2": ("ffn_norm",), "mlp.c_fc": ("ffn_up",), "mlp.c_proj": ("ffn_down",)}
_FALCON_LAYER = {
    "self_attention.query_key_value": ("attn_qkv",), "self_attention.dense": ("attn_output",),
    "mlp.dense_h_to_4h": ("ffn_up",), "mlp.dense_4h_to_h": ("ffn_down",),
    "input_layernorm": ("attn_norm",),  # the old architecture, or the new one with one norm
    "ln_mlp": ("attn_norm",), "ln_attn": ("attn_norm_2",),  # the new architecture's two norms
}
_TRANSFORMER = {"transformer.ln_f": "output_norm", "lm_head": "output"}

GGUF_TENSOR_MAPS: dict[str, GGUFTensorMap] = {
    "llama": GGUFTensorMap(_LLAMA_LAYER, permuted={"attn_q": "q", "attn_k": "kv"}, ignored=("rope_freqs.weight",)),
    "qwen2": GGUFTensorMap(_LLAMA_LAYER),
    "qwen3": GGUFTensorMap({**_LLAMA_LAYER, **_QK_NORMS}),
    "phi3": GGUFTensorMap({**_LLAMA_LAYER, "self_attn.qkv_proj": ("attn_qkv",), "mlp.gate_up_proj": ("ffn_up",)},
                          ignored=("rope_factors_long.weight", "rope_factors_short.weight")),
    "gemma2": GGUFTensorMap(_GEMMA2_LAYER, norm_offset=1.0),
    "gemma3": GGUFTensorMap({**_GEMMA2_LAYER, **_QK_NORMS}, norm_offset=1.0),
    "qwen2moe": GGUFTensorMap({**_ATTENTION, **_MOE, **_SHARED_EXPERT}),
    "qwen3moe": GGUFTensorMap({**_ATTENTION, **_QK_NORMS, **_MOE}),
    "gpt2": GGUFTensorMap(_GPT2_LAYER, {"transformer.wte": "token_embd", "transformer.wpe": "position_embd",
                                        **_TRANSFORMER}, layers="transformer.h"),
    "falcon": GGUFTensorMap(_FALCON_LAYER, {"transformer.word_embeddings": "token_embd", **_TRANSFORMER},
                            layers="transformer.h"),
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


def gguf_quant_config(path: Path | str) -> GGUFConfig:
    """The ``GGUFConfig`` of the GGUF file at ``path``: each of our modules' tensor types (ggml ids)
    in row order, a MoE layer's gate, up and down experts apart (llama.cpp's ``*_exps`` tensors),
    from the header (``gguf_header.py``: no metadata value or tensor data is read). Modules whose
    tensors the file lacks are left out.

    Raises:
        ValueError: an architecture not served from GGUF, or no ``general.architecture``.
    """
    arch, types = read_header(path)
    tmap = tensor_map(arch)
    blocks = {int(m.group(1)) for name in types if (m := re.match(r"blk\.(\d+)\.", name))}
    linear: dict[str, list[int]] = {}
    experts: dict[str, list[int]] = {}
    modules = [(f"{tmap.layers}.{i}.{attr}", [f"blk.{i}.{p}.weight" for p in parts])
               for i in sorted(blocks) for attr, parts in tmap.layer.items()]
    modules += [(attr, [f"{name}.weight"]) for attr, name in tmap.model.items()]
    for module, names in modules:
        if all(n in types for n in names):
            (experts if names[-1].endswith("_exps.weight") else linear)[module] = [types[n] for n in names]
    return GGUFConfig.from_config({"quant_method": GGUFConfig.name, "linear": linear, "experts": experts})
