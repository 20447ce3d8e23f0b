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
``F.rms_norm``, its LayerNorm form or the C kernel. On CPU in bf16 with the panels, a step whose
every attention row the backend's C kernel serves (``AttentionBackend.native_rows``) runs all
decoder layers in one C call (``layers/cpu/native_layers.py``).

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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.cpu.attention_plan import NativeRows
from services.executor.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from services.executor.layers.activation import SiluAndMul
from services.executor.layers.attention import Attention
from services.executor.layers.cpu.native_layers import KVCaches, NativeLayers
from services.executor.layers.cpu.onednn import reduced_precision_gemv
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.layernorm import RMSNorm
from services.executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from services.executor.layers.quantization import (
    QuantizationConfig,
    get_quantization_config,
    layer_method_for,
    linear_method_for,
)
from services.executor.layers.rotary_embedding import apply_rope, get_rope
from services.executor.layers.selection import (
    KernelChoice,
    KernelSwitches,
    restore_weights,
    select_kernels,
    use_linear_methods,
)
from services.executor.layers.utils import FastModule
from services.executor.model_loader import gguf_loader, loader
from services.executor.models.hf_config import (
    architectures_of,
    check_supported,
    config_value,
    head_dim_of,
    layer_sliding_windows,
    num_kv_heads_of,
    rope_parameters,
)
from services.executor.parallel.group import current_tp_group


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
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                                   layer_method_for(quant_config, "model.embed_tokens"))
        self.sliding_windows = layer_sliding_windows(hf_config)  # Mistral's, Qwen2's sliding layers
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, dtype, backend, window, quant_config, f"model.layers.{i}")
                                    for i, window in enumerate(self.sliding_windows))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary_emb = get_rope(args.head_dim, rope_parameters(hf_config), dtype, device)
        self.attn_backend = backend
        self.single_row_gemv = False  # the kernels' choice (LlamaForCausalLM.use_kernels)
        self.native_layers_enabled = False  # likewise: the panels serve every matmul
        self.native_layers: NativeLayers | None = None  # pointer arrays for the caches of the last step

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: KVCaches,  # per layer K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, 1, D] each, shared by every layer
        rows = self.native_rows(kv_caches, attn_metadata)
        if rows is not None:  # every decoder layer in one C call
            self.native_layers.run(hidden_states, cos, sin, attn_metadata.slot_mapping.long(), rows)
            return self.norm(hidden_states)
        with reduced_precision_gemv(self.single_row_gemv and hidden_states.shape[0] == 1):
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)

    def native_rows(self, kv_caches: KVCaches, attn_metadata: AttentionMetadata) -> NativeRows | None:
        """The step's attention rows when :class:`NativeLayers` runs it (the panels and the C
        norms serve every layer, the caches suit it, and the backend's C kernel serves every
        row of the step), else ``None`` (the per-layer path)."""
        if not self.native_layers_enabled:
            return None
        if self.native_layers is None or self.native_layers.key != NativeLayers.cache_key(kv_caches):
            applies = NativeLayers.applies(self.layers, kv_caches)
            self.native_layers = NativeLayers(self.layers, kv_caches) if applies else None
            if self.native_layers is None:
                return None
        if self.native_layers.max_rows is not None and attn_metadata.slot_mapping.shape[0] > self.native_layers.max_rows:
            return None
        attn = self.layers[0].self_attn
        return self.attn_backend.native_rows(attn_metadata, kv_caches[0][0], attn.num_heads, attn.head_dim, self.dtype)


class LlamaForCausalLM(KernelSwitches, FastModule):
    """Llama-family causal LM over a paged KV cache.

    Args:
        hf_config: a ``transformers`` config (or its dict) of a supported architecture.
        dtype: parameter / activation / KV cache dtype.
        device: where parameters live (allocated uninitialised; call :meth:`load_weights`).
        attn_backend: an :class:`AttentionBackend` or a name for :func:`get_attention_backend`.
        native_cpu_kernels: allow the C norms and the native GEMM where they apply
            (``layers/selection.py``; ``Settings.native_cpu_kernels``).
        quant_config: the checkpoint's quantization (``layers/quantization/``); default: read
            from ``hf_config``'s ``quantization_config``. Its linear methods serve the decoder's
            matmuls (the LM head and embedding stay unquantized but in a GGUF file).

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

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        check_supported(hf_config)
        # the checkpoint's quantization (config.json), unless the caller has read and checked it
        self.quant_config = quant_config if quant_config is not None else get_quantization_config(hf_config)
        device = torch.device(device)
        if isinstance(attn_backend, str):
            attn_backend = get_attention_backend(attn_backend, device)
        args = LlamaArgs.from_hf_config(hf_config)
        self.hf_config, self.dtype, self.device = hf_config, dtype, device
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", False))
        self.tp_size = current_tp_group().world_size  # layers built under use_tp_group take their rank's part
        with torch.device(device):  # uninitialised: load_weights fills every parameter
            self.model = LlamaModel(hf_config, args, dtype, device, attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                          layer_method_for(self.quant_config, "lm_head"))
        self.num_kv_heads_per_rank = self.model.layers[0].self_attn.num_kv_heads  # this rank's KV cache heads
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.kernel_request = {"native_norms": native_cpu_kernels, "native_matmuls": native_cpu_kernels}
        self.kernels = select_kernels(dtype, device, **self.kernel_request)

    @property
    def attn_backend(self) -> AttentionBackend:
        return self.model.attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        self.model.attn_backend = backend
        for layer in self.model.layers:
            layer.self_attn.attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab] f32
        """Logits in float32 (``layers/embedding.py``: ``ParallelLMHead.compute_logits``); ``None``
        on the ranks other than 0 of a tensor-parallel group."""
        return self.lm_head.compute_logits(hidden_states)

    # ------------------------------------------------------------------ kernels and weights

    def use_kernels(self, kernels: KernelChoice) -> None:
        """Compute with ``kernels`` from now on (after loading: every weight form is derived again)."""
        use_linear_methods(self, kernels)
        for layer in self.model.layers:
            layer.input_layernorm.set_form(kernels.layer_norm_form)
            layer.post_attention_layernorm.set_form(kernels.layer_norm_form)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if norm is not None:  # per head: never the C kernel's fused residual form
                    norm.set_form("torch" if kernels.layer_norm_form == "native" else kernels.layer_norm_form)
        self.model.norm.set_form(kernels.final_norm_form)
        self.model.single_row_gemv = kernels.single_row_gemv
        # one C call for every layer has no all-reduce between them (a single rank only) and
        # no sliding window
        self.model.native_layers_enabled = (kernels.native_matmuls and self.tp_size == 1
                                            and (self.quant_config is None or not self.quant_config.from_checkpoint)
                                            and not any(self.model.sliding_windows)
                                            and self.model.layers[0].self_attn.q_norm is None)
        self.model.native_layers = None
        self.kernels = kernels

    @torch.no_grad()
    def load_weights(self, model_dir: Path | str) -> None:
        """Load HF safetensors (one file, or shards listed in ``model.safetensors.index.json``)
        through :func:`services.executor.model_loader.loader.load_weights`, or the GGUF file the
        directory is served from (``gguf_loader``: llama, qwen2 and qwen3 files, their Q4_0 /
        Q4_1 / Q8_0 / K-quant matrices kept quantized), then derive the kernels' weight forms.
        ``lm_head.weight`` is ignored when embeddings are tied.

        Raises:
            FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
            ValueError: a parameter is missing, has the wrong shape, the checkpoint holds
                tensors this architecture does not know, or a GGUF file's architecture is not
                served from GGUF.
        """
        restore_weights(self)  # the parameters must hold their shapes to be loaded into
        gguf = gguf_loader.gguf_file(model_dir)
        if gguf is not None:
            native = self.kernel_request["native_matmuls"] and self.device.type == "cpu"
            gguf_loader.load_gguf_weights(self, gguf, native=native)
        else:
            loader.load_weights(self, model_dir, self.stacked_params_mapping, skip=self._skip_checkpoint_tensor)
        self.use_kernels(self.kernels)

    def _skip_checkpoint_tensor(self, name: str) -> bool:
        return "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight")
