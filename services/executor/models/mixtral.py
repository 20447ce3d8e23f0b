"""Mixtral (Jiang et al. 2024, "Mixtral of Experts") on a paged KV cache.

Hugging Face's ``modeling_mixtral`` on our layers: Llama's attention (GQA, RoPE, Mistral's
optional sliding window; ``LlamaAttention`` from ``llama.py``) and, in place of the MLP, a
sparse mixture of experts (``block_sparse_moe``): a router ``gate`` ``[E, hidden]`` picks
``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts per token, softmax weights
renormalised over the chosen ones (``layers/fused_moe.py``).

The decoder layer and model here take their MLP from a factory, so ``qwen_moe.py``
(Qwen2-MoE / Qwen3-MoE: a shared expert, dense layers, q/k norms) builds on them. Tensor
parallelism: attention heads as Llama's, each expert's intermediate size split over the ranks
(``FusedMoE``), the router replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.fused_moe import FusedMoE, topk_softmax
from services.executor.layers.layernorm import RMSNorm
from services.executor.layers.linear import ReplicatedLinear
from services.executor.layers.quantization import QuantizationConfig, layer_method_for
from services.executor.layers.rotary_embedding import get_rope
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import (
    check_supported,
    config_value,
    head_dim_of,
    layer_sliding_windows,
    num_kv_heads_of,
    rope_parameters,
)
from services.executor.models.llama import LlamaArgs, LlamaAttention

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V [num_blocks, block_size, Hkv, D]


def attention_args(hf_config: Any, intermediate_size: int, qkv_bias: bool = False, qk_norm: bool = False) -> LlamaArgs:
    """The sizes :class:`LlamaAttention` (and ``LlamaMLP``) read, from a MoE config."""
    return LlamaArgs(
        hidden_size=config_value(hf_config, "hidden_size"), intermediate_size=intermediate_size,
        num_heads=config_value(hf_config, "num_attention_heads"), num_kv_heads=num_kv_heads_of(hf_config),
        head_dim=head_dim_of(hf_config), rms_norm_eps=config_value(hf_config, "rms_norm_eps", 1e-6),
        qkv_bias=qkv_bias, o_bias=False, mlp_bias=False, qk_norm=qk_norm)


class MixtralSparseMoeBlock(FastModule):
    """``experts(x, topk_softmax(gate(x)))``: router ``gate`` ``[E, hidden]`` (replicated),
    top-k weights always renormalised (HF's ``MixtralTopKRouter``), the experts'
    weighted sum in float32 before the cast back (HF's ``MixtralExperts``)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, num_experts = config_value(hf_config, "hidden_size"), config_value(hf_config, "num_local_experts")
        self.top_k = config_value(hf_config, "num_experts_per_tok")
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, params_dtype=dtype)
        self.experts = FusedMoE(num_experts, hidden, config_value(hf_config, "intermediate_size"), dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        topk_weights, topk_ids = topk_softmax(self.gate(hidden_states), self.top_k, renormalize=True)  # [T, K]
        return self.experts(hidden_states, topk_weights, topk_ids)


class MoeDecoderLayer(FastModule):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``, ``mlp`` a sparse MoE block or
    a dense MLP."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, backend: AttentionBackend, sliding_window: int | None,
                 mlp: nn.Module, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, dtype, backend, sliding_window, quant_config, f"{prefix}.self_attn")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], the residual stream
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)  # residual += attn; norm
        return self.mlp(hidden_states).add_(residual)


class MoeModel(FastModule):
    """Embedding, decoder layers (layer ``i``'s MLP from ``make_mlp(i)``), final norm; RoPE's
    cos/sin computed once per step."""

    def __init__(self, hf_config: Any, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, make_mlp: Callable[[int], nn.Module],
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                                   layer_method_for(quant_config, "model.embed_tokens"))
        self.layers = nn.ModuleList(MoeDecoderLayer(args, dtype, backend, window, make_mlp(i), quant_config,
                                                    f"model.layers.{i}")
                                    for i, window in enumerate(layer_sliding_windows(hf_config)))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary_emb = get_rope(args.head_dim, rope_parameters(hf_config), dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T] int64, [T] int64 -> [T, hidden]
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, 1, D] each
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class MoeForCausalLM(PagedCausalLM):
    """A MoE decoder (:class:`MoeModel`) and its LM head; subclasses give the attention's
    :class:`LlamaArgs`, each layer's MLP and the checkpoint's expert tensor names.

    A quantized checkpoint (``quant_config``) quantizes the attention (and dense / shared-expert
    MLPs); its experts must be unquantized (listed in the quantization's ``ignore``), else
    ``build`` raises ValueError naming the first expert."""

    takes_quantization = True
    expert_module = "mlp"  # the checkpoint's name of a layer's sparse MoE block

    def build(self, args: LlamaArgs, make_mlp: Callable[[int], nn.Module], num_experts: int,
              expert_names: tuple[str, str, str]) -> None:
        """Build the layers (uninitialised) and the loader's mapping of the experts' tensors.

        Raises:
            ValueError: the checkpoint's quantization covers the experts (``FusedMoE`` holds
                unquantized weights only)."""
        hf_config = self.hf_config
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", False))
        with torch.device(self.device):
            self.model = MoeModel(hf_config, args, self.dtype, self.device, self.attn_backend, make_mlp,
                                  self.quant_config)
            self.lm_head = ParallelLMHead(config_value(hf_config, "vocab_size"), args.hidden_size, self.dtype,
                                          layer_method_for(self.quant_config, "lm_head"))
        for i, layer in enumerate(self.model.layers):
            expert = f"model.layers.{i}.{self.expert_module}.experts.0.{expert_names[0]}"
            if hasattr(layer.mlp, "experts") and self.quant_config is not None \
                    and self.quant_config.linear_method(expert, []) is not None:
                raise ValueError(f"{self.quant_config.name} quantization of MoE experts ({expert}) is not supported: "
                                 "only the attention and dense MLPs of a MoE model may be quantized")
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.num_kv_heads_per_rank = self.model.layers[0].self_attn.num_kv_heads  # this rank's KV heads
        self.head_dim = args.head_dim
        self.stacked_params_mapping = [
            (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
            *FusedMoE.expert_params_mapping(num_experts, *expert_names),
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral causal LM (see the module docstring; constructor as :class:`PagedCausalLM`).

    Raises:
        ValueError: an activation other than SiLU, an unsupported RoPE type, heads that cannot
            be split over the ranks.
    """

    expert_module = "block_sparse_moe"

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        check_supported(hf_config)
        args = attention_args(hf_config, config_value(hf_config, "intermediate_size"))
        self.build(args, lambda _: MixtralSparseMoeBlock(hf_config, dtype),
                   config_value(hf_config, "num_local_experts"), ("w1", "w3", "w2"))

    def checkpoint_name(self, name: str) -> str:
        """``block_sparse_moe`` is this class's ``mlp``."""
        return name.replace(".block_sparse_moe.", ".mlp.")
