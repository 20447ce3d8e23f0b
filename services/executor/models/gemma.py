"""Gemma (Gemma Team 2024), Gemma 2 and Gemma 3 (text only) decoders on a paged KV cache.

Hugging Face's ``modeling_gemma``, ``modeling_gemma2`` and ``modeling_gemma3`` (the text model,
``model_type`` ``gemma3_text``) on our layers and flat token layout (every sequence's new tokens
concatenated into T rows). The three differ from Llama in the same places, and from each other
in a few switches:

- all: RMSNorm scaling by ``1 + weight`` in float32 (:class:`GemmaRMSNorm`); the embedding
  multiplied by ``sqrt(hidden_size)`` rounded to the model dtype; a GeGLU MLP
  (``gelu_pytorch_tanh``); the LM head tied to the embedding;
- Gemma 2 and 3: softmax scale ``query_pre_attn_scalar ** -0.5``; sliding-window attention on
  the ``"sliding_attention"`` layers of ``layer_types`` (alternate layers in Gemma 2, five in six
  in Gemma 3); norms after attention and around the MLP ("sandwich" norms); the final logits
  soft-capped, ``cap * tanh(logits / cap)`` (``final_logit_softcapping``);
- Gemma 2 only: the attention logits soft-capped likewise (``attn_logit_softcapping``; HF's
  Gemma 3 attention does not pass it on, so neither do we);
- Gemma 3 only: an RMSNorm over ``head_dim`` of each q and k head before RoPE, and RoPE
  parameters per layer type (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``:
  a local base, a global base with optional linear scaling), so cos/sin are computed once per
  layer type per step.

Under tensor parallelism the parallel linear layers take this rank's heads and MLP columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.activation import gated_activation
from services.executor.layers.attention import Attention
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.layernorm import GemmaRMSNorm
from services.executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from services.executor.layers.quantization import QuantizationConfig, layer_method_for, linear_method_for
from services.executor.layers.rotary_embedding import apply_rope, get_rope
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import (
    config_value,
    head_dim_of,
    layer_sliding_windows,
    num_kv_heads_of,
    rope_parameters,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V [num_blocks, block_size, Hkv, D]


@dataclass(frozen=True)
class GemmaArgs:
    """The sizes and switches of a Gemma decoder layer, read from the HF config."""

    version: int  # 1, 2 or 3
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_activation: str
    attention_bias: bool
    scale: float  # softmax scale
    attn_logit_softcapping: float | None

    @classmethod
    def from_hf_config(cls, hf_config: Any, version: int) -> GemmaArgs:
        """Raises ValueError for bidirectional attention (an encoder's, not a causal LM's)."""
        if config_value(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported (causal attention only)")
        head_dim = head_dim_of(hf_config)
        # Gemma 1 reads hidden_act (its config maps a legacy "gelu" to the tanh form); 2 and 3 hidden_activation
        act = config_value(hf_config, "hidden_act" if version == 1 else "hidden_activation") or "gelu_pytorch_tanh"
        return cls(
            version=version,
            hidden_size=config_value(hf_config, "hidden_size"),
            intermediate_size=config_value(hf_config, "intermediate_size"),
            num_heads=config_value(hf_config, "num_attention_heads"),
            num_kv_heads=num_kv_heads_of(hf_config),
            head_dim=head_dim,
            rms_norm_eps=config_value(hf_config, "rms_norm_eps", 1e-6),
            hidden_activation=act,
            attention_bias=bool(config_value(hf_config, "attention_bias", False)),
            scale=(head_dim if version == 1 else config_value(hf_config, "query_pre_attn_scalar")) ** -0.5,
            attn_logit_softcapping=config_value(hf_config, "attn_logit_softcapping") if version == 2 else None,
        )


class GemmaMLP(FastModule):
    """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``, gate | up in one matmul."""

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [args.intermediate_size] * 2, params_dtype=dtype,
            quant_method=linear_method_for(quant_config, f"{prefix}.gate_up_proj", ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, params_dtype=dtype,
                                           input_range=self.gate_up_proj.row_ranges[0],
                                           quant_method=linear_method_for(quant_config, f"{prefix}.down_proj"))
        self.act_fn = gated_activation(args.hidden_activation)  # GeluAndMul("tanh") for Gemma's

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.gate_up_proj.forward_act(x, self.act_fn))  # [T, I] in between


class GemmaAttention(FastModule):
    """Multi-head attention with GQA: q/k/v in one matmul, (Gemma 3) q/k RMSNorm per head, RoPE,
    paged attention with the layer's sliding window and logit soft cap, o_proj."""

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, backend: AttentionBackend,
                 sliding_window: int | None, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
                                          bias=args.attention_bias, params_dtype=dtype,
                                          quant_method=linear_method_for(quant_config, f"{prefix}.qkv_proj",
                                                                         ["q_proj", "k_proj", "v_proj"]))
        # this rank's heads (all of them on a single rank)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size, bias=args.attention_bias,
                                        params_dtype=dtype, input_range=self.qkv_proj.row_ranges[0],
                                        quant_method=linear_method_for(quant_config, f"{prefix}.o_proj"))
        self.attn = Attention(self.num_heads, args.head_dim, args.scale, self.num_kv_heads, backend,
                              sliding_window=sliding_window, logits_soft_cap=args.attn_logit_softcapping)
        qk_norm = args.version == 3
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype) if qk_norm else None

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], normed
        cos: torch.Tensor,  # [T, 1, D] of this layer's type
        sin: torch.Tensor,  # [T, 1, D], sign-folded
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t, nh, nkv, d = hidden_states.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k, v = q.view(t, nh, d), k.view(t, nkv, d), v.view(t, nkv, d)
        if self.q_norm is not None:  # Gemma 3: each head normed over D
            q, k = self.q_norm(q), self.k_norm(k)
        qk = apply_rope(torch.cat((q, k), dim=1), cos, sin)  # [T, H + Hkv, D]
        attn_output = self.attn(qk[:, :nh], qk[:, nh:], v, kv_cache, attn_metadata)  # [T, H, D]
        return self.o_proj(attn_output.reshape(t, nh * d))


class GemmaDecoderLayer(FastModule):
    """Gemma: ``h += attn(norm(h)); h += mlp(norm(h))``. Gemma 2 and 3 also norm each block's
    output before adding it: ``h += post_attention_norm(attn(input_norm(h)));
    h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))``."""

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, backend: AttentionBackend,
                 sliding_window: int | None, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = GemmaAttention(args, dtype, backend, sliding_window, quant_config, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(args, dtype, quant_config, f"{prefix}.mlp")
        self.sandwich = args.version >= 2
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        # Gemma 1's post_attention_layernorm is the MLP's input norm; Gemma 2/3's norms the attention output
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
            self.post_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], the residual stream
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], sign-folded
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, attn_metadata)
        if not self.sandwich:
            residual = residual + hidden_states
            return residual + self.mlp(self.post_attention_layernorm(residual))
        residual = residual + self.post_attention_layernorm(hidden_states)
        return residual + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual)))


class GemmaModel(FastModule):
    """Scaled embedding, decoder layers, final norm; cos/sin once per step for each RoPE
    (one for Gemma 1/2; Gemma 3: one per layer type)."""

    def __init__(self, hf_config: Any, args: GemmaArgs, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                                   layer_method_for(quant_config, "model.embed_tokens"))
        # HF: a float32 scalar sqrt(hidden_size), cast to the weight's dtype before the product
        self.normalizer = torch.tensor(args.hidden_size**0.5).to(dtype=dtype, device=device)
        windows = layer_sliding_windows(hf_config) if args.version >= 2 else [None] * config_value(hf_config, "num_hidden_layers")
        self.layers = nn.ModuleList(GemmaDecoderLayer(args, dtype, backend, window, quant_config, f"model.layers.{i}")
                                    for i, window in enumerate(windows))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        if args.version == 3:  # per-layer-type RoPE: the sliding layers' local base, the full layers' global one
            self.layer_types = list(config_value(hf_config, "layer_types"))
            self.rotary_emb = nn.ModuleDict({kind: get_rope(args.head_dim, rope_parameters(hf_config, kind), dtype, device)
                                             for kind in sorted(set(self.layer_types))})
        else:
            self.layer_types = ["all"] * len(self.layers)
            self.rotary_emb = nn.ModuleDict({"all": get_rope(args.head_dim, rope_parameters(hf_config), dtype, device)})

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        hidden_states = self.embed_tokens(input_ids) * self.normalizer  # [T, hidden]
        cos_sin = {kind: rope(positions) for kind, rope in self.rotary_emb.items()}  # [T, 1, D] pairs
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches, strict=True):
            hidden_states = layer(hidden_states, *cos_sin[kind], kv_cache, attn_metadata)
        return self.norm(hidden_states)


class GemmaForCausalLM(PagedCausalLM):
    """Gemma causal LM over a paged KV cache (``GemmaForCausalLM``; the subclasses below set
    ``version`` for Gemma 2 and Gemma 3 text).

    Args: as :class:`PagedCausalLM`. Built under ``use_tp_group`` it is one rank's part: its
    heads, MLP columns and vocabulary rows.

    Raises:
        ValueError: unsupported RoPE or activation, bidirectional attention, or heads that
            cannot be split over the ranks.
    """

    version = 1
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
    ]
    takes_quantization = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        args = GemmaArgs.from_hf_config(hf_config, self.version)
        self.head_dim = args.head_dim
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", True))
        cap = config_value(hf_config, "final_logit_softcapping") if self.version >= 2 else None
        self.final_logit_softcapping: float | None = cap
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.model = GemmaModel(hf_config, args, dtype, self.device, self.attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                          layer_method_for(self.quant_config, "lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.num_kv_heads_per_rank = self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab] f32
        """Float32 logits, soft-capped as ``cap * tanh(logits / cap)`` when the config sets
        ``final_logit_softcapping`` (Gemma 2/3); None off rank 0."""
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: sandwich norms, ``query_pre_attn_scalar``, alternate sliding-window layers,
    attention and final logit soft caps."""

    version = 2


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 text (``gemma3_text``): Gemma 2's layout with q/k norms, RoPE per layer type and
    no attention soft cap."""

    version = 3
