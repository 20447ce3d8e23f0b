"""GPT-NeoX decoder (GPT-NeoX-20B, Pythia, StableLM-alpha, ...) on a paged KV cache.

Hugging Face's ``modeling_gpt_neox`` (``GPTNeoXAttention``, ``GPTNeoXMLP``, ``GPTNeoXLayer``,
``GPTNeoXModel``, ``GPTNeoXForCausalLM``) on our layers and flat token layout (the new tokens
of every sequence of a step concatenated into T rows). What sets it apart from Llama:

- ``query_key_value`` is one fused projection laid out per head, ``[heads, 3, head_dim]``
  (q, k, v of head 0, then of head 1, ...): :class:`GroupedQKVParallelLinear` de-interleaves it
  at load time into q | k | v of this rank's heads;
- partial rotary: RoPE over the first ``partial_rotary_factor * head_dim`` dimensions of each
  head (``rotary_pct``, 0.25 by default), the rest passed through (:func:`apply_rope`);
- ``use_parallel_residual``: ``h + attn(ln1(h)) + mlp(ln2(h))`` (GPT-J's parallel block) or the
  sequential ``h' = h + attn(ln1(h)); h' + mlp(ln2(h'))``;
- LayerNorm with biases, a plain (not gated) MLP with GELU, biases on every projection
  (``attention_bias``), an output embedding ``embed_out`` separate from ``embed_in``.
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
from services.executor.layers.rotary_embedding import apply_rope, get_rope
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import config_value, rope_parameters

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V [num_blocks, block_size, H_rank, D]


class GPTNeoXAttention(FastModule):
    """Multi-head attention: fused q/k/v (one matmul), partial RoPE on q and k, paged
    attention, ``dense``. Under tensor parallelism: this rank's heads, ``dense`` summing over
    the ranks."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        hidden, heads = config_value(hf_config, "hidden_size"), config_value(hf_config, "num_attention_heads")
        self.head_size = hidden // heads
        bias = bool(config_value(hf_config, "attention_bias", True))
        self.query_key_value = GroupedQKVParallelLinear(hidden, self.head_size, heads, heads, bias=bias,
                                                        params_dtype=dtype)
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.dense = RowParallelLinear(hidden, hidden, bias=bias, params_dtype=dtype,
                                       input_range=self.query_key_value.row_ranges[0])
        self.attn = Attention(self.num_heads, self.head_size, self.head_size**-0.5, self.num_heads, backend)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], normed
        cos: torch.Tensor,  # [T, 1, R], R = rotary dims <= D
        sin: torch.Tensor,  # [T, 1, R], sign-folded
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t, h, d = hidden_states.shape[0], self.num_heads, self.head_size
        qkv = self.query_key_value(hidden_states)  # [T, 3 H D]: q | k | v (de-interleaved at load)
        qk = apply_rope(qkv[:, : 2 * h * d].view(t, 2 * h, d), cos, sin)  # [T, 2 H, D]
        v = qkv[:, 2 * h * d :].view(t, h, d)
        attn_output = self.attn(qk[:, :h], qk[:, h:], v, kv_cache, attn_metadata)  # [T, H, D]
        return self.dense(attn_output.reshape(t, h * d))


class GPTNeoXMLP(FastModule):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))`` (GELU by default)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config_value(hf_config, "hidden_size"), config_value(hf_config, "intermediate_size")
        self.dense_h_to_4h = ColumnParallelLinear(hidden, inner, bias=True, params_dtype=dtype)
        self.act = Activation(config_value(hf_config, "hidden_act", "gelu"))
        self.dense_4h_to_h = RowParallelLinear(inner, hidden, bias=True, params_dtype=dtype,
                                               input_range=self.dense_h_to_4h.row_ranges[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))  # [T, I_rank] in between


class GPTNeoXLayer(FastModule):
    """One block, parallel (``h + attn(ln1(h)) + mlp(ln2(h))``) or sequential residual."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        hidden, eps = config_value(hf_config, "hidden_size"), config_value(hf_config, "layer_norm_eps", 1e-5)
        self.use_parallel_residual = bool(config_value(hf_config, "use_parallel_residual", True))
        self.input_layernorm = LayerNorm(hidden, eps, dtype)
        self.post_attention_layernorm = LayerNorm(hidden, eps, dtype)
        self.attention = GPTNeoXAttention(hf_config, dtype, backend)
        self.mlp = GPTNeoXMLP(hf_config, dtype)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        attn_output = self.attention(self.input_layernorm(hidden_states), cos, sin, kv_cache, attn_metadata)
        if self.use_parallel_residual:
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            return mlp_output.add_(attn_output).add_(hidden_states)  # HF's order: (mlp + attn) + h
        attn_output = attn_output.add_(hidden_states)
        return self.mlp(self.post_attention_layernorm(attn_output)).add_(attn_output)


class GPTNeoXModel(FastModule):
    """``embed_in``, the layers, ``final_layer_norm``; RoPE's cos/sin computed once per step."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = config_value(hf_config, "hidden_size")
        self.embed_in = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), hidden, dtype)
        self.layers = nn.ModuleList(GPTNeoXLayer(hf_config, dtype, backend)
                                    for _ in range(config_value(hf_config, "num_hidden_layers")))
        self.final_layer_norm = LayerNorm(hidden, config_value(hf_config, "layer_norm_eps", 1e-5), dtype)
        head_size = hidden // config_value(hf_config, "num_attention_heads")
        self.rotary_emb = get_rope(head_size, rope_parameters(hf_config), dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T] int64 x2 -> [T, hidden]
        hidden_states = self.embed_in(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, 1, R] each, shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.final_layer_norm(hidden_states)


class GPTNeoXForCausalLM(PagedCausalLM):
    """GPT-NeoX causal LM over a paged KV cache (``PagedCausalLM``'s arguments).

    Parameters are named as the checkpoint's (``gpt_neox.layers.N.attention.query_key_value``
    ...); the head is ``embed_out`` in checkpoints (``lm_head`` as transformers 5 names it
    in memory: both load), or ``embed_in`` itself with ``tie_word_embeddings``. Built under
    ``use_tp_group``, it is one rank's part: its heads, MLP columns and vocabulary rows.

    Raises:
        ValueError: an unsupported RoPE type or activation; heads that cannot be split over
            the ranks (``parallel/partition.py``).
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels)
        hidden, vocab = config_value(hf_config, "hidden_size"), config_value(hf_config, "vocab_size")
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", False))
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.gpt_neox = GPTNeoXModel(hf_config, dtype, self.device, self.attn_backend)
            self.lm_head = ParallelLMHead(vocab, hidden, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.gpt_neox.embed_in)
        attention = self.gpt_neox.layers[0].attention
        self.num_kv_heads_per_rank, self.head_dim = attention.num_heads, attention.head_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.gpt_neox(input_ids, positions, kv_caches, attn_metadata)

    def checkpoint_name(self, name: str) -> str:
        return "lm_head.weight" if name == "embed_out.weight" else name

    def skip_checkpoint_tensor(self, name: str) -> bool:
        # old checkpoints keep the causal mask and rotary caches as buffers
        return super().skip_checkpoint_tensor(name) or name.endswith((".attention.bias", ".attention.masked_bias"))
