"""Llama-family decoder (Llama 2/3, SmolLM, Mistral with its sliding window, Qwen2) on a paged KV cache.

Hugging Face's ``modeling_llama`` (``LlamaAttention``, ``LlamaMLP``, ``LlamaDecoderLayer``,
``LlamaModel``, ``LlamaForCausalLM``) on vLLM's layers (``services/executor/layers/``) and flat
token layout: the new tokens of every sequence of a step are concatenated into T rows (no batch
dimension), and the attention backend maps them to the paged cache through
:class:`AttentionMetadata`. Numerics follow HF (RMSNorm in float32, RoPE by ``rotate_half``,
SiLU-gated MLP), so float32 outputs match ``transformers`` greedy generation token for token.
q/k/v and gate/up are merged into one matmul each (the checkpoint's shards are loaded into the
merged parameters); RoPE's cos/sin are computed once per step and q and k rotated in one go.
The layers are ``FastModule``s: calling one runs its ``forward`` with no hooks, and their
submodules and parameters are plain attributes (``layers/utils.py``).

How each matmul and norm is computed is decided once, at load time, by one strategy
(``layers/selection.py``): plain ``F.linear``, oneDNN-prepacked or native-GEMM panels;
``F.rms_norm``, its LayerNorm form or the C kernel. How a step runs is the model runner's
(``services/executor/forward_pass.py``): this model's forward, or, on CPU in bf16, all decoder
layers of :meth:`LlamaForCausalLM.llama_stack` in one C call.

Numerics change checklist. The bf16 CPU decoder's roundings are decided in four places, kept in
agreement by ``tests/executor/test_model_parity.py``; a change in one is made in all four:

1. the torch layer path: :meth:`LlamaDecoderLayer.forward` and what it calls (``layers/layernorm.py``,
   ``layers/activation.py``, ``layers/rotary_embedding.py``, the linear methods of ``layers/linear.py``
   and ``layers/cpu/onednn.py``);
2. the native panel GEMM: ``layers/cpu/panels.py`` over ``kernels/cpu/csrc/cpu_gemm_bf16.c``
   (float32 sums, one rounding per output);
3. the C norms: ``kernels/cpu/csrc/cpu_rms_norm.c`` (the ``"native"`` form of ``layers/layernorm.py``);
4. the C all-layers path: ``kernels/cpu/csrc/cpu_llama_layers.c`` (``layers/cpu/native_layers.py``),
   which repeats 1.'s sequence of roundings (RoPE, SiLU * up, the residual adds) in C.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.activation import SiluAndMul
from services.executor.layers.attention import Attention
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.layernorm import RMSNorm
from services.executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from services.executor.layers.quantization import QuantizationConfig, layer_method_for, linear_method_for
from services.executor.layers.rotary_embedding import apply_rope, get_rope
from services.executor.layers.selection import KernelChoice
from services.executor.layers.utils import FastModule
from services.executor.models.base import KVCaches, LlamaStack, PagedCausalLM
from services.executor.models.hf_config import (
    architectures_of,
    check_supported,
    config_value,
    head_dim_of,
    layer_sliding_windows,
    num_kv_heads_of,
    rope_parameters,
)


@dataclass(frozen=True)
class LlamaArgs:
    """The sizes and options of a decoder layer, read from the HF config."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2, or attention_bias
    o_bias: bool  # attention_bias (not Qwen2)
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm of each q and k head before RoPE

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> LlamaArgs:
        archs = architectures_of(hf_config)
        qwen2 = "Qwen2ForCausalLM" in archs
        attention_bias = bool(config_value(hf_config, "attention_bias", False))
        return cls(
            hidden_size=config_value(hf_config, "hidden_size"),
            intermediate_size=config_value(hf_config, "intermediate_size"),
            num_heads=config_value(hf_config, "num_attention_heads"),
            num_kv_heads=num_kv_heads_of(hf_config),
            head_dim=head_dim_of(hf_config),
            rms_norm_eps=config_value(hf_config, "rms_norm_eps", 1e-6),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(config_value(hf_config, "mlp_bias", False)),
            qk_norm="Qwen3ForCausalLM" in archs,
        )


class LlamaMLP(FastModule):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, gate | up in one matmul."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, quant_config: QuantizationConfig | None = None,
                 prefix: str = "model.layers.0.mlp") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [args.intermediate_size] * 2, bias=args.mlp_bias, params_dtype=dtype,
            quant_method=linear_method_for(quant_config, f"{prefix}.gate_up_proj", ["gate_proj", "up_proj"]))
        self.intermediate_size = self.gate_up_proj.output_partition_sizes[0]  # this rank's
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias,
                                           params_dtype=dtype, input_range=self.gate_up_proj.row_ranges[0],
                                           quant_method=linear_method_for(quant_config, f"{prefix}.down_proj"))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.gate_up_proj.forward_act(x, self.act_fn))  # [T, I] in between


class LlamaAttention(FastModule):
    """Multi-head attention with GQA: q/k/v in one matmul, RoPE on q and k, paged attention,
    o_proj. Under tensor parallelism: this rank's heads, o_proj summing over the ranks."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, backend: AttentionBackend,
                 sliding_window: int | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "model.layers.0.self_attn") -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads, bias=args.qkv_bias, params_dtype=dtype,
            quant_method=linear_method_for(quant_config, f"{prefix}.qkv_proj", ["q_proj", "k_proj", "v_proj"]))
        # this rank's heads (all of them on a single rank): parallel/partition.py
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, args.head_dim
        self.qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias,
                                        params_dtype=dtype, input_range=self.qkv_proj.row_ranges[0],
                                        quant_method=linear_method_for(quant_config, f"{prefix}.o_proj"))
        self.attn = Attention(self.num_heads, args.head_dim, args.head_dim**-0.5, self.num_kv_heads, backend,
                              sliding_window=sliding_window)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], normed
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], sign-folded
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # this layer's K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t, nh, nkv, d = hidden_states.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 Hkv) D]
        qk = qkv[:, : self.qk_size].view(t, nh + nkv, d)
        if self.q_norm is not None:  # Qwen3: each head normed over D
            q = self.q_norm(qk[:, :nh].reshape(t * nh, d)).view(t, nh, d)
            k = self.k_norm(qk[:, nh:].reshape(t * nkv, d)).view(t, nkv, d)
            qk = torch.cat((q, k), dim=1)
        qk = apply_rope(qk, cos, sin)  # [T, H + Hkv, D]
        v = qkv[:, self.qk_size :].view(t, nkv, d)  # [T, Hkv, D]
        attn_output = self.attn(qk[:, :nh], qk[:, nh:], v, kv_cache, attn_metadata)  # [T, H, D]
        return self.o_proj(attn_output.reshape(t, nh * d))


class LlamaDecoderLayer(FastModule):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, backend: AttentionBackend,
                 sliding_window: int | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "model.layers.0") -> None:
        super().__init__()
        self.hidden_size = args.hidden_size
        self.self_attn = LlamaAttention(args, dtype, backend, sliding_window, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(args, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden], the residual stream
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], sign-folded
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, attn_metadata)
        # residual + attention, summed into the attention output (a fresh tensor), then normed
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states).add_(residual)


class LlamaModel(FastModule):
    """Embedding, decoder layers, final norm; RoPE's cos/sin computed once per step."""

    def __init__(self, hf_config: Any, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                                   layer_method_for(quant_config, "model.embed_tokens"))
        windows = layer_sliding_windows(hf_config)  # Mistral's, Qwen2's sliding layers
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, dtype, backend, window, quant_config, f"model.layers.{i}")
                                    for i, window in enumerate(windows))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary_emb = get_rope(args.head_dim, rope_parameters(hf_config), dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: KVCaches,  # per layer K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, 1, D] each, shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class LlamaForCausalLM(PagedCausalLM):
    """Llama-family causal LM over a paged KV cache (arguments: :class:`PagedCausalLM`;
    ``native_cpu_kernels`` also allows the C norms, ``quant_config``'s linear methods serve the
    decoder's matmuls, the LM head and embedding staying unquantized but in a GGUF file).

    Built under ``use_tp_group`` (``services/executor/parallel/group.py``) it is one rank's part
    of the model: its heads, MLP columns and vocabulary rows; ``num_kv_heads_per_rank`` sizes
    its KV cache.

    Raises:
        ValueError: see :func:`services.executor.models.hf_config.check_supported`; heads that
            cannot be split over the ranks (``parallel/partition.py``); a quantization this
            engine does not implement (:func:`~services.executor.layers.quantization.get_quantization_config`).
    """

    # checkpoint shards stacked into our merged parameters: (param_name, shard_name, shard_id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
    ]
    takes_quantization = True
    takes_native_norms = True  # the decoder layers' norms with the attention residual add fused in
    takes_single_row_gemv = True  # measured: benchmarks/RESULTS.md, "Figures moved out of the code"

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        check_supported(hf_config)  # before the checkpoint's quantization is read
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        args = LlamaArgs.from_hf_config(hf_config)
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", False))
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.model = LlamaModel(hf_config, args, dtype, self.device, self.attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                          layer_method_for(self.quant_config, "lm_head"))
        self.num_kv_heads_per_rank = self.model.layers[0].self_attn.num_kv_heads  # this rank's KV cache heads
        self.head_dim = args.head_dim
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def llama_stack(self) -> LlamaStack:
        """:class:`LlamaModel` itself: its embedding, RoPE, decoder layers and final norm."""
        return self.model

    def set_norm_forms(self, kernels: KernelChoice) -> None:
        """The decoder layers' norms in ``kernels.layer_norm_form`` (the C kernel's, with the
        residual add fused, where it is ``"native"``), the final norm in ``final_norm_form``."""
        for layer in self.model.layers:
            layer.input_layernorm.set_form(kernels.layer_norm_form)
            layer.post_attention_layernorm.set_form(kernels.layer_norm_form)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if norm is not None:  # per head: never the C kernel's fused residual form
                    norm.set_form("torch" if kernels.layer_norm_form == "native" else kernels.layer_norm_form)
        self.model.norm.set_form(kernels.final_norm_form)
