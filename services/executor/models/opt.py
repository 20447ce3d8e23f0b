"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models") on a paged KV cache.

Hugging Face's ``modeling_opt`` (``OPTAttention``, ``OPTDecoderLayer``, ``OPTDecoder``,
``OPTForCausalLM``) on our layers and flat token layout (the step's new tokens of every
sequence concatenated into T rows). What sets it apart:

- learned absolute positions with an offset of 2 (``OPTLearnedPositionalEmbedding``: position
  ``p`` reads row ``p + 2``, fairseq's padding rows before it);
- ``do_layer_norm_before``: pre-norm blocks (125m, 1.3b and up), or post-norm ones
  (350m: ``h = norm(h + attn(h))``, and no final LayerNorm);
- ``word_embed_proj_dim`` != ``hidden_size`` (350m): embeddings and LM head in the smaller
  width, ``project_in`` / ``project_out`` to and from the decoder's;
- a ReLU MLP (``fc1``, ``fc2``); every projection with a bias unless ``enable_bias`` is false;
  LayerNorms without weight and bias when ``layer_norm_elementwise_affine`` is false;
- the LM head tied to ``embed_tokens`` (``tie_word_embeddings``, True by default).

q, k and v (separate in the checkpoint) are loaded into one ``qkv_proj``. HF scales q before
its matmul; the attention here scales the scores: the same up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.activation import Activation
from services.executor.layers.attention import Attention
from services.executor.layers.embedding import (
    LearnedPositionEmbedding,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from services.executor.layers.layernorm import LayerNorm
from services.executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from services.executor.layers.quantization import QuantizationConfig, linear_method_for
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import config_value

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V [num_blocks, block_size, H, D]

#: rows of OPT's position table before position 0 (``OPTLearnedPositionalEmbedding.offset``)
OPT_POSITION_OFFSET = 2


def opt_layer_norm(hf_config: Any, dtype: torch.dtype) -> LayerNorm:
    """``nn.LayerNorm(hidden_size, elementwise_affine=layer_norm_elementwise_affine)`` (eps 1e-5)."""
    return LayerNorm(hf_config.hidden_size, 1e-5, dtype,
                     elementwise_affine=config_value(hf_config, "layer_norm_elementwise_affine", True))


class OPTAttention(FastModule):
    """Multi-head attention (no GQA, no RoPE): ``qkv_proj``, paged attention with scale
    ``head_dim ** -0.5``, ``out_proj``. Under tensor parallelism: this rank's heads."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, total_heads = hf_config.hidden_size, hf_config.num_attention_heads
        bias = config_value(hf_config, "enable_bias", True)
        self.head_dim = hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=bias, params_dtype=dtype,
                                          quant_method=linear_method_for(quant_config, f"{prefix}.qkv_proj",
                                                                         ["q_proj", "k_proj", "v_proj"]))
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, params_dtype=dtype,
                                          input_range=self.qkv_proj.row_ranges[0],
                                          quant_method=linear_method_for(quant_config, f"{prefix}.out_proj"))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, backend)

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        t, h, d = hidden_states.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states).view(t, 3 * h, d)  # [T, 3 H, D]: q | k | v heads
        attn_output = self.attn(qkv[:, :h], qkv[:, h : 2 * h], qkv[:, 2 * h :], kv_cache, attn_metadata)  # [T, H, D]
        return self.out_proj(attn_output.reshape(t, h * d))


class OPTDecoderLayer(FastModule):
    """Pre-norm (``do_layer_norm_before``): ``h += attn(norm1(h)); h += fc2(relu(fc1(norm2(h))))``;
    post-norm: ``h = norm1(h + attn(h)); h = norm2(h + fc2(relu(fc1(h))))``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, bias = hf_config.hidden_size, config_value(hf_config, "enable_bias", True)
        self.do_layer_norm_before = config_value(hf_config, "do_layer_norm_before", True)
        self.self_attn = OPTAttention(hf_config, dtype, backend, quant_config, f"{prefix}.self_attn")
        self.self_attn_layer_norm = opt_layer_norm(hf_config, dtype)
        self.fc1 = ColumnParallelLinear(hidden, hf_config.ffn_dim, bias=bias, params_dtype=dtype,
                                        quant_method=linear_method_for(quant_config, f"{prefix}.fc1"))
        self.fc2 = RowParallelLinear(hf_config.ffn_dim, hidden, bias=bias, params_dtype=dtype,
                                     input_range=self.fc1.row_ranges[0],
                                     quant_method=linear_method_for(quant_config, f"{prefix}.fc2"))
        self.activation_fn = Activation(config_value(hf_config, "activation_function", "relu"))
        self.final_layer_norm = opt_layer_norm(hf_config, dtype)

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden], the residual stream
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states, kv_cache, attn_metadata).add_(residual)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states))).add_(residual)  # [T, ffn_dim] inside
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(FastModule):
    """``project_in(embed_tokens(ids)) + embed_positions(positions)``, the layers, the final
    LayerNorm (pre-norm models only), ``project_out``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        hidden, proj_dim = hf_config.hidden_size, config_value(hf_config, "word_embed_proj_dim") or hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, proj_dim, dtype)
        self.embed_positions = LearnedPositionEmbedding(hf_config.max_position_embeddings, hidden, dtype,
                                                        offset=OPT_POSITION_OFFSET)
        # the decoder's width differs from the embeddings' (OPT-350m): projections, replicated (small)
        self.project_in = ReplicatedLinear(proj_dim, hidden, params_dtype=dtype) if proj_dim != hidden else None
        self.project_out = ReplicatedLinear(hidden, proj_dim, params_dtype=dtype) if proj_dim != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(hf_config, dtype, backend, quant_config, f"model.decoder.layers.{i}")
                                    for i in range(hf_config.num_hidden_layers))
        final_norm = (config_value(hf_config, "do_layer_norm_before", True)
                      and not config_value(hf_config, "_remove_final_layer_norm", False))
        self.final_layer_norm = opt_layer_norm(hf_config, dtype) if final_norm else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T] int64, [T] int64 -> [T, proj_dim]
        inputs_embeds = self.embed_tokens(input_ids)  # [T, proj_dim]
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)  # [T, hidden]
        hidden_states = inputs_embeds.add_(self.embed_positions(positions))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)  # [T, proj_dim]
        return hidden_states


class OPTModel(FastModule):
    """HF's ``OPTModel``: the decoder under ``model.decoder`` (the checkpoint's names)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.decoder = OPTDecoder(hf_config, dtype, backend, quant_config)


class OPTForCausalLM(PagedCausalLM):
    """OPT causal LM over a paged KV cache (arguments: :class:`PagedCausalLM`). ``forward``
    returns the LM head's input, ``[T, word_embed_proj_dim]``.

    Raises:
        ValueError: an ``activation_function`` that :class:`Activation` does not know; heads
            that cannot be split over the ranks.
    """

    # checkpoint shards stacked into our merged parameter: (param_name, shard_name, shard_id)
    stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                              (".qkv_proj", ".v_proj", "v")]
    takes_quantization = True  # the decoder layers' linears (the projections in / out stay unquantized)

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", True))
        proj_dim = config_value(hf_config, "word_embed_proj_dim") or hf_config.hidden_size
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.model = OPTModel(hf_config, dtype, self.attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, proj_dim, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.decoder.embed_tokens)
        attn = self.model.decoder.layers[0].self_attn
        self.num_kv_heads_per_rank, self.head_dim = attn.num_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, word_embed_proj_dim]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.model.decoder(input_ids, positions, kv_caches, attn_metadata)
