"""Falcon decoder (Falcon-7B/40B/180B, Falcon 2) on a paged KV cache.

Hugging Face's ``modeling_falcon`` (``FalconAttention``, ``FalconMLP``, ``FalconDecoderLayer``,
``FalconModel``, ``FalconForCausalLM``) on our layers and flat token layout (the new tokens of
every sequence of a step concatenated into T rows). Its two forms:

- the new decoder architecture (``new_decoder_architecture``, Falcon-40B/180B): ``num_kv_heads``
  grouped KV heads, ``query_key_value`` laid out per KV group ``[num_kv_heads, q_per_kv + 2,
  head_dim]``; attention and MLP in parallel, each after its own LayerNorm (``ln_attn``,
  ``ln_mlp``) or both after ``input_layernorm`` (``num_ln_in_parallel_attn == 1``);
- the older one (Falcon-7B): ``multi_query`` (one KV head: ``[num_heads + 2, head_dim]``, q
  heads then k then v) or multi-head (``[num_heads, 3, head_dim]``); ``parallel_attn``:
  ``h + attn(ln(h)) + mlp(ln(h))`` with one ``input_layernorm``, else sequential with
  ``post_attention_layernorm`` before the MLP.

Each layout is the per-KV-group one of :class:`GroupedQKVParallelLinear` (multi-query: one
group; multi-head: ``q_per_kv = 1``), which loads this rank's heads as q | k | v. Under tensor
parallelism a single KV head is replicated on every rank (``parallel/partition.py``). RoPE on
every dimension, LayerNorm, a plain GELU MLP, optional biases (``bias``), and the LM head tied
to ``word_embeddings`` (``tie_word_embeddings``, the default). ALiBi (``alibi=True``) is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.activation import Activation
from services.executor.layers.attention import Attention
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.layernorm import LayerNorm
from services.executor.layers.linear import ColumnParallelLinear, GroupedQKVParallelLinear, RowParallelLinear
from services.executor.layers.quantization import QuantizationConfig, layer_method_for, linear_method_for
from services.executor.layers.rotary_embedding import apply_rope, get_rope
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import config_value, num_kv_heads_of, rope_parameters

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V [num_blocks, block_size, Hkv_rank, D]


class FalconAttention(FastModule):
    """Attention with 1 (multi-query), ``num_kv_heads`` (grouped) or ``num_heads`` KV heads:
    fused q/k/v (one matmul), RoPE on q and k, paged attention, ``dense``. Under tensor
    parallelism: this rank's heads, ``dense`` summing over the ranks."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None, prefix: str = "transformer.h.0.self_attention") -> None:
        super().__init__()
        hidden, heads = config_value(hf_config, "hidden_size"), config_value(hf_config, "num_attention_heads")
        self.head_dim = hidden // heads
        bias = bool(config_value(hf_config, "bias", False))
        self.query_key_value = GroupedQKVParallelLinear(
            hidden, self.head_dim, heads, num_kv_heads_of(hf_config), bias=bias, params_dtype=dtype,
            quant_method=linear_method_for(quant_config, f"{prefix}.query_key_value"))
        self.num_heads, self.num_kv_heads = self.query_key_value.num_heads, self.query_key_value.num_kv_heads
        self.dense = RowParallelLinear(hidden, hidden, bias=bias, params_dtype=dtype,
                                       quant_method=linear_method_for(quant_config, f"{prefix}.dense"),
                                       input_range=self.query_key_value.row_ranges[0])
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], normed
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], sign-folded
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t, h, hkv, d = hidden_states.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.query_key_value(hidden_states)  # [T, (H + 2 Hkv) D]: q | k | v (de-interleaved at load)
        qk = apply_rope(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), cos, sin)  # [T, H + Hkv, D]
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        attn_output = self.attn(qk[:, :h], qk[:, h:], v, kv_cache, attn_metadata)  # [T, H, D]
        return self.dense(attn_output.reshape(t, h * d))


class FalconMLP(FastModule):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))`` (``activation``, GELU by default)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant_config: QuantizationConfig | None = None,
                 prefix: str = "transformer.h.0.mlp") -> None:
        super().__init__()
        hidden = config_value(hf_config, "hidden_size")
        inner = config_value(hf_config, "ffn_hidden_size") or 4 * hidden
        bias = bool(config_value(hf_config, "bias", False))
        self.dense_h_to_4h = ColumnParallelLinear(hidden, inner, bias=bias, params_dtype=dtype,
                                                  quant_method=linear_method_for(quant_config, f"{prefix}.dense_h_to_4h"))
        self.act = Activation(config_value(hf_config, "activation", "gelu"))
        self.dense_4h_to_h = RowParallelLinear(inner, hidden, bias=bias, params_dtype=dtype,
                                               quant_method=linear_method_for(quant_config, f"{prefix}.dense_4h_to_h"),
                                               input_range=self.dense_h_to_4h.row_ranges[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))  # [T, I_rank] in between


class FalconDecoderLayer(FastModule):
    """One block: parallel (``h + attn(ln_attn(h)) + mlp(ln_mlp(h))``, one norm or two) or
    sequential (``h' = h + attn(ln(h)); h' + mlp(post_ln(h'))``), as HF's ``FalconDecoderLayer``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None, prefix: str = "transformer.h.0") -> None:
        super().__init__()
        hidden, eps = config_value(hf_config, "hidden_size"), config_value(hf_config, "layer_norm_epsilon", 1e-5)
        new_arch = bool(config_value(hf_config, "new_decoder_architecture", False))
        # the new architecture is always parallel (HF's forward adds attention to the MLP output)
        self.parallel = new_arch or bool(config_value(hf_config, "parallel_attn", True))
        num_ln = config_value(hf_config, "num_ln_in_parallel_attn") or (2 if new_arch else 1)
        self.self_attention = FalconAttention(hf_config, dtype, backend, quant_config, f"{prefix}.self_attention")
        self.mlp = FalconMLP(hf_config, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = self.post_attention_layernorm = self.ln_attn = self.ln_mlp = None
        if new_arch and num_ln == 2:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps, dtype), LayerNorm(hidden, eps, dtype)
        else:
            self.input_layernorm = LayerNorm(hidden, eps, dtype)
            if not self.parallel:
                self.post_attention_layernorm = LayerNorm(hidden, eps, dtype)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.ln_attn is not None:
            attn_in, mlp_in = self.ln_attn(hidden_states), self.ln_mlp(hidden_states)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden_states)
        attn_output = self.self_attention(attn_in, cos, sin, kv_cache, attn_metadata)
        if self.parallel:
            return self.mlp(mlp_in).add_(attn_output).add_(hidden_states)  # HF's order: (mlp + attn) + h
        residual = attn_output.add_(hidden_states)
        return self.mlp(self.post_attention_layernorm(residual)).add_(residual)


class FalconModel(FastModule):
    """``word_embeddings``, the layers ``h``, ``ln_f``; RoPE's cos/sin computed once per step."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        hidden = config_value(hf_config, "hidden_size")
        self.word_embeddings = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), hidden, dtype,
                                                      layer_method_for(quant_config, "transformer.word_embeddings"))
        self.h = nn.ModuleList(FalconDecoderLayer(hf_config, dtype, backend, quant_config, f"transformer.h.{i}")
                               for i in range(config_value(hf_config, "num_hidden_layers")))
        self.ln_f = LayerNorm(hidden, config_value(hf_config, "layer_norm_epsilon", 1e-5), dtype)
        head_dim = hidden // config_value(hf_config, "num_attention_heads")
        self.rotary_emb = get_rope(head_dim, rope_parameters(hf_config), dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T] int64 x2 -> [T, hidden]
        hidden_states = self.word_embeddings(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, 1, D] each, shared by every layer
        for layer, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.ln_f(hidden_states)


class FalconForCausalLM(PagedCausalLM):
    """Falcon causal LM over a paged KV cache (``PagedCausalLM``'s arguments).

    Parameters are named as the checkpoint's (``transformer.h.N.self_attention.query_key_value``
    ...). Built under ``use_tp_group``, it is one rank's part: its query heads, its KV heads (a
    single KV head on every rank), MLP columns and vocabulary rows.

    Raises:
        ValueError: ``alibi=True`` (ALiBi position biases are not implemented: only the rotary
            Falcons load); an unsupported RoPE type or activation; heads that cannot be split
            over the ranks (``parallel/partition.py``).
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        if config_value(hf_config, "alibi", False):
            raise ValueError("Falcon with alibi=True (ALiBi position biases, e.g. Falcon-RW) is not supported: "
                             "only rotary Falcon models load")
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        hidden, vocab = config_value(hf_config, "hidden_size"), config_value(hf_config, "vocab_size")
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", True))
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.transformer = FalconModel(hf_config, dtype, self.device, self.attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(vocab, hidden, dtype, layer_method_for(self.quant_config, "lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.transformer.word_embeddings)
        attention = self.transformer.h[0].self_attention
        self.num_kv_heads_per_rank, self.head_dim = attention.num_kv_heads, attention.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)
