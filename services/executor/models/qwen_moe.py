"""Qwen2-MoE and Qwen3-MoE on a paged KV cache.

Hugging Face's ``modeling_qwen2_moe`` / ``modeling_qwen3_moe`` on the MoE decoder of
``mixtral.py``. The sparse block (``mlp``): a router ``gate`` picks ``num_experts_per_tok`` of
``num_experts`` SwiGLU experts of size ``moe_intermediate_size``, their softmax weights
renormalised only when ``norm_topk_prob`` and rounded to the model's dtype before they scale
the experts' outputs (HF's ``Qwen2MoeTopKRouter``); Qwen2-MoE adds a ``shared_expert`` (a
SwiGLU MLP of ``shared_expert_intermediate_size``) every token goes through, scaled by
``sigmoid(shared_expert_gate(x))``. A layer is sparse when it is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``, else a dense MLP of ``intermediate_size``.

Attention: Qwen2-MoE's q/k/v have biases (``qkv_bias``); Qwen3-MoE's do not (unless
``attention_bias``) but RMSNorm each q and k head before RoPE, and has no shared expert.

Tensor parallelism: the routed experts and the shared expert each give this rank's partial
sum of the output, added and all-reduced once (the shared expert's gate is a per-token scalar,
replicated, so it scales the partial sums alike).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend
from services.executor.layers.fused_moe import FusedMoE, topk_softmax
from services.executor.layers.linear import ReplicatedLinear
from services.executor.layers.quantization import QuantizationConfig, layer_method_for, moe_method_for
from services.executor.layers.utils import FastModule
from services.executor.models.hf_config import check_supported, config_value
from services.executor.models.llama import LlamaArgs, LlamaMLP
from services.executor.models.mixtral import MoeForCausalLM, attention_args
from services.executor.parallel.group import current_tp_group


class Qwen2MoeSparseMoeBlock(FastModule):
    """Routed experts (+ Qwen2-MoE's gated shared expert when ``shared_expert_intermediate_size``
    is set): ``experts(x, topk_softmax(gate(x))) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, hf_config: Any, args: LlamaArgs, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, num_experts = args.hidden_size, config_value(hf_config, "num_experts")
        self.tp = current_tp_group()
        self.top_k = config_value(hf_config, "num_experts_per_tok")
        self.norm_topk_prob = bool(config_value(hf_config, "norm_topk_prob", False))
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, params_dtype=dtype,
                                     quant_method=layer_method_for(quant_config, f"{prefix}.gate"))
        self.experts = FusedMoE(num_experts, hidden, config_value(hf_config, "moe_intermediate_size"), dtype,
                                reduce_results=False, quant_method=moe_method_for(quant_config, f"{prefix}.experts"))
        shared_size = config_value(hf_config, "shared_expert_intermediate_size") or 0
        self.shared_expert = self.shared_expert_gate = None
        if shared_size:
            self.shared_expert = LlamaMLP(dataclasses.replace(args, intermediate_size=shared_size), dtype,
                                          quant_config, f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, params_dtype=dtype,
                                                       quant_method=layer_method_for(quant_config,
                                                                                     f"{prefix}.shared_expert_gate"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        router_logits = self.gate(hidden_states)  # [T, E]
        topk_weights, topk_ids = topk_softmax(router_logits, self.top_k, self.norm_topk_prob)  # [T, K] f32
        out = self.experts(hidden_states, topk_weights.to(router_logits.dtype), topk_ids)  # this rank's part
        if self.shared_expert is not None:
            mlp = self.shared_expert
            act = mlp.gate_up_proj.forward_act(hidden_states, mlp.act_fn)  # [T, I_shared_rank]
            shared = mlp.down_proj.quant_method.apply(mlp.down_proj, act, None)  # this rank's part, unreduced
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared  # [T, 1] * [T, hidden]
        return self.tp.all_reduce(out)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE causal LM (see the module docstring; constructor as :class:`PagedCausalLM`).

    Raises:
        ValueError: an activation other than SiLU, an unsupported RoPE type, heads that cannot
            be split over the ranks.
    """

    qk_norm = False

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        check_supported(hf_config)
        qkv_bias = bool(config_value(hf_config, "qkv_bias", False) or config_value(hf_config, "attention_bias", False))
        args = attention_args(hf_config, config_value(hf_config, "intermediate_size"), qkv_bias, self.qk_norm)
        num_experts = config_value(hf_config, "num_experts")
        mlp_only = set(config_value(hf_config, "mlp_only_layers", None) or ())
        sparse_step = config_value(hf_config, "decoder_sparse_step", 1)

        def make_mlp(i: int) -> nn.Module:
            if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0:
                return Qwen2MoeSparseMoeBlock(hf_config, args, dtype, self.quant_config, f"model.layers.{i}.mlp")
            return LlamaMLP(args, dtype, self.quant_config, f"model.layers.{i}.mlp")  # dense, of intermediate_size

        self.build(args, make_mlp, num_experts, ("gate_proj", "up_proj", "down_proj"))


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: Qwen2-MoE's decoder with q/k RMSNorm per head, no q/k/v biases (unless
    ``attention_bias``) and no shared expert."""

    qk_norm = True
