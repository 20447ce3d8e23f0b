"""GPT-2 (Radford et al. 2019) on a paged KV cache.

Hugging Face's ``modeling_gpt2`` (``GPT2Attention``, ``GPT2MLP``, ``GPT2Block``, ``GPT2Model``,
``GPT2LMHeadModel``) on our layers and flat token layout (the step's new tokens of every
sequence concatenated into T rows). What sets it apart from Llama:

- learned absolute positions (``wpe``, added to the token embedding; no RoPE);
- pre-norm blocks with LayerNorm (weight and bias), a ``gelu_new`` MLP without gate;
- q | k | v in one ``c_attn``, every projection with a bias;
- the weights are ``Conv1D``'s, stored ``[in, out]`` (transposed against ``nn.Linear``): the
  layers here read them transposed (:class:`Conv1DWeight`), so tensor parallelism takes a
  rank's heads from the columns of ``c_attn`` and its input rows of ``c_proj``;
- the LM head tied to ``wte`` (``tie_word_embeddings``, True by default).

Checkpoint quantization is refused (``PagedCausalLM.takes_quantization``); a GGUF file's
``quant_config`` gives each layer its method by its name (``transformer.h.0.attn.c_attn``).

Checkpoints name tensors ``transformer.h.0.attn.c_attn.weight`` (``GPT2LMHeadModel``) or, the
original OpenAI conversions, ``h.0.attn.c_attn.weight``: both load. The causal-mask buffers
``attn.bias`` / ``attn.masked_bias`` of old checkpoints are skipped.
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
from services.executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from services.executor.layers.quantization import QuantizationConfig, layer_method_for, linear_method_for
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import config_value

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V [num_blocks, block_size, H, D]


class Conv1DWeight:
    """A checkpoint ``Conv1D`` weight ``[in, out]`` seen as the ``nn.Linear`` weight ``[out, in]``
    the linear layers load: ``shape`` reversed, ``narrow(dim, ...)`` reads the source's other
    dimension (only that slice of a lazy ``CheckpointTensor``), ``load()`` the whole transpose."""

    def __init__(self, source: Any) -> None:  # torch.Tensor or model_loader/loader.py's CheckpointTensor
        self.source = source
        self.shape = tuple(source.shape)[::-1]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.source.narrow(1 - dim, start, length).t()

    def load(self) -> torch.Tensor:
        source = self.source
        return (source if isinstance(source, torch.Tensor) else source.load()).t()


class Conv1DLoading:
    """Mixed into a linear layer: its 2-D weight is read from a ``Conv1D`` checkpoint tensor
    (transposed); biases load as they are."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, loaded_shard_id: str | int | None = None) -> None:
        if param.dim() == 2:
            loaded_weight = Conv1DWeight(loaded_weight)
        super().weight_loader(param, loaded_weight, loaded_shard_id)


class Conv1DQKVParallelLinear(Conv1DLoading, QKVParallelLinear):
    """``c_attn``: q | k | v columns of one ``[hidden, 3 hidden]`` Conv1D, each split by heads."""


class Conv1DColumnParallelLinear(Conv1DLoading, ColumnParallelLinear):
    """``c_fc``: output columns of a Conv1D split over the ranks."""


class Conv1DRowParallelLinear(Conv1DLoading, RowParallelLinear):
    """``c_proj``: input rows of a Conv1D split over the ranks, outputs all-reduced."""


class GPT2Attention(FastModule):
    """Multi-head attention: ``c_attn`` (q | k | v with biases), paged attention, ``c_proj``.
    Scale ``head_dim ** -0.5`` (1 without ``scale_attn_weights``), divided by ``layer_idx + 1``
    with ``scale_attn_by_inverse_layer_idx``. Under tensor parallelism: this rank's heads."""

    def __init__(self, hf_config: Any, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None, prefix: str = "transformer.h.0.attn") -> None:
        super().__init__()
        hidden, total_heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.c_attn = Conv1DQKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=True,
                                              params_dtype=dtype,
                                              quant_method=linear_method_for(quant_config, f"{prefix}.c_attn"))
        self.num_heads = self.c_attn.num_heads  # this rank's
        self.c_proj = Conv1DRowParallelLinear(hidden, hidden, bias=True, params_dtype=dtype,
                                              quant_method=linear_method_for(quant_config, f"{prefix}.c_proj"),
                                              input_range=self.c_attn.row_ranges[0])
        scale = self.head_dim**-0.5 if config_value(hf_config, "scale_attn_weights", True) else 1.0
        if config_value(hf_config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads, backend)

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        t, h, d = hidden_states.shape[0], self.num_heads, self.head_dim
        qkv = self.c_attn(hidden_states).view(t, 3 * h, d)  # [T, 3 H, D]: q | k | v heads
        attn_output = self.attn(qkv[:, :h], qkv[:, h : 2 * h], qkv[:, 2 * h :], kv_cache, attn_metadata)  # [T, H, D]
        return self.c_proj(attn_output.reshape(t, h * d))


class GPT2MLP(FastModule):
    """``c_proj(act(c_fc(x)))``, ``act`` = ``activation_function`` (``gelu_new``: GELU's tanh form)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant_config: QuantizationConfig | None = None,
                 prefix: str = "transformer.h.0.mlp") -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        inner = config_value(hf_config, "n_inner") or 4 * hidden
        self.c_fc = Conv1DColumnParallelLinear(hidden, inner, bias=True, params_dtype=dtype,
                                               quant_method=linear_method_for(quant_config, f"{prefix}.c_fc"))
        self.c_proj = Conv1DRowParallelLinear(inner, hidden, bias=True, params_dtype=dtype,
                                              quant_method=linear_method_for(quant_config, f"{prefix}.c_proj"),
                                              input_range=self.c_fc.row_ranges[0])
        self.act = Activation(config_value(hf_config, "activation_function", "gelu_new"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.c_proj(self.act(self.c_fc(hidden_states)))  # [T, inner] in between


class GPT2Block(FastModule):
    """Pre-norm block: ``h += attn(ln_1(h)); h += mlp(ln_2(h))``."""

    def __init__(self, hf_config: Any, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, config_value(hf_config, "layer_norm_epsilon", 1e-5)
        prefix = f"transformer.h.{layer_idx}"
        self.ln_1 = LayerNorm(hidden, eps, dtype)
        self.attn = GPT2Attention(hf_config, layer_idx, dtype, backend, quant_config, f"{prefix}.attn")
        self.ln_2 = LayerNorm(hidden, eps, dtype)
        self.mlp = GPT2MLP(hf_config, dtype, quant_config, f"{prefix}.mlp")

    def forward(self, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden], the residual stream
        hidden_states = self.attn(self.ln_1(hidden_states), kv_cache, attn_metadata).add_(hidden_states)
        return self.mlp(self.ln_2(hidden_states)).add_(hidden_states)


class GPT2Model(FastModule):
    """``wte(ids) + wpe(positions)``, the blocks, ``ln_f``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.wte = VocabParallelEmbedding(hf_config.vocab_size, hidden, dtype,
                                          layer_method_for(quant_config, "transformer.wte"))
        self.wpe = LearnedPositionEmbedding(hf_config.max_position_embeddings, hidden, dtype)
        self.h = nn.ModuleList(GPT2Block(hf_config, i, dtype, backend, quant_config)
                               for i in range(hf_config.num_hidden_layers))
        self.ln_f = LayerNorm(hidden, config_value(hf_config, "layer_norm_epsilon", 1e-5), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T] int64, [T] int64 -> [T, hidden]
        hidden_states = self.wte(input_ids).add_(self.wpe(positions))  # [T, hidden]
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden_states = block(hidden_states, kv_cache, attn_metadata)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(PagedCausalLM):
    """GPT-2 causal LM over a paged KV cache (arguments: :class:`PagedCausalLM`).

    Raises:
        ValueError: ``add_cross_attention`` (an encoder-decoder GPT-2), or an
            ``activation_function`` that :class:`Activation` does not know.
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        if config_value(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True (cross-attention to an encoder) is not supported")
        # reorder_and_upcast_attn only changes HF's eager attention to float32 scores and softmax,
        # which our attention backends compute in float32 anyway: nothing to do
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", True))
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.transformer = GPT2Model(hf_config, dtype, self.attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype,
                                          layer_method_for(self.quant_config, "lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.transformer.wte)
        attn = self.transformer.h[0].attn
        self.num_kv_heads_per_rank, self.head_dim = attn.num_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the blocks over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def checkpoint_name(self, name: str) -> str:
        """``h.0.attn...`` (OpenAI's conversions, a bare ``GPT2Model``) -> ``transformer.h.0.attn...``."""
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Also the causal masks old checkpoints hold (``attn.bias``, ``attn.masked_bias``)."""
        return super().skip_checkpoint_tensor(name) or ".attn.bias" in name or ".attn.masked_bias" in name
