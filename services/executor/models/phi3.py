"""Phi-3 (Phi-3 mini/small-context and long-context, Phi-3.5 mini) on a paged KV cache.

Hugging Face's ``modeling_phi3`` (``Phi3Attention``, ``Phi3MLP``, ``Phi3DecoderLayer``,
``Phi3Model``, ``Phi3ForCausalLM``) on our layers. A Phi-3 decoder layer computes what a Llama
layer computes (pre-norm RMSNorm blocks, GQA attention with RoPE, SiLU-gated MLP, no biases),
so the layers are ``llama.py``'s :class:`LlamaDecoderLayer`. What differs:

- the checkpoint stores q/k/v fused (``self_attn.qkv_proj.weight``: rows q | k | v,
  ``[(H + 2 Hkv) D, hidden]``) and gate/up fused (``mlp.gate_up_proj.weight``: rows gate | up,
  ``[2 I, hidden]``). They are our merged parameters' own layout, so each loads whole into
  :class:`QKVParallelLinear` / :class:`MergedColumnParallelLinear`, whose weight loader splits
  the fused tensor into its shards and takes this rank's rows of each (its heads, its MLP
  columns) under tensor parallelism (``ColumnParallelLinear.weight_loader`` with no shard id).
- RoPE may be ``longrope`` (Phi-3 128k, Phi-3.5): short or long per-frequency factors, chosen by
  the sequence's length (:class:`LongRopeRotaryEmbedding`); see :func:`rope_seq_lens` for how a
  step's tokens pick them. ``partial_rotary_factor`` rotates the first part of each head only.
- ``sliding_window`` (Phi-3 mini 4k: 2047) applies on every layer (``layer_sliding_windows``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.layernorm import RMSNorm
from services.executor.layers.quantization import QuantizationConfig, layer_method_for
from services.executor.layers.rotary_embedding import LongRopeRotaryEmbedding, get_rope
from services.executor.layers.utils import FastModule
from services.executor.models.base import PagedCausalLM
from services.executor.models.hf_config import (
    check_supported,
    config_value,
    layer_sliding_windows,
    rope_parameters,
)
from services.executor.models.llama import LlamaArgs, LlamaDecoderLayer

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V [num_blocks, block_size, Hkv, D]


def rope_seq_lens(attn_metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:  # [T] int64
    """The sequence length by which each of the step's tokens picks its LongRoPE factors.

    Hugging Face decides per forward pass with ``max(position_ids) + 1``: a prompt is prefilled
    in one pass, so its length picks the factors of all its tokens, and each decode step then
    uses the length the sequence has reached. Here a token's length is its sequence's length
    after this step (``seq_lens``), or its whole prompt's while a prompt longer than that is
    prefilled in chunks (``num_prompt_tokens``), so that a chunked prefill rotates as HF's one
    pass does. When no prompt lengths are given, the step's lengths alone decide.

    One difference remains, by design: HF's ``Phi3ForCausalLM.prepare_inputs_for_generation``
    drops its cache when a sequence that started short grows past
    ``original_max_position_embeddings`` and recomputes every earlier key with the long factors;
    a paged cache keeps those keys as they were rotated (short) and rotates only the new tokens
    with the long factors (as vLLM does), so such a sequence's later tokens can differ from HF's.
    """
    lens = attn_metadata.seq_lens_list
    if attn_metadata.num_prompt_tokens is not None:
        lens = [max(n, p) for n, p in zip(lens, attn_metadata.num_prompt_tokens, strict=True)]
    per_seq = torch.tensor(lens, dtype=torch.int64)  # [B]
    repeats = torch.tensor(attn_metadata.query_lens, dtype=torch.int64)  # [B]
    return per_seq.repeat_interleave(repeats).to(device)  # [T]


class Phi3Model(FastModule):
    """Embedding, decoder layers, final norm; RoPE's cos/sin computed once per step (per token's
    sequence length for LongRoPE)."""

    def __init__(self, hf_config: Any, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                                   layer_method_for(quant_config, "model.embed_tokens"))
        self.sliding_windows = layer_sliding_windows(hf_config)  # one window on every layer, or None
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, dtype, backend, window, quant_config, f"model.layers.{i}")
                                    for i, window in enumerate(self.sliding_windows))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary_emb = get_rope(args.head_dim, rope_parameters(hf_config), dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: KVCaches,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        if isinstance(self.rotary_emb, LongRopeRotaryEmbedding):
            cos, sin = self.rotary_emb(positions, rope_seq_lens(attn_metadata, positions.device))
        else:
            cos, sin = self.rotary_emb(positions)  # [T, 1, R] each, shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class Phi3ForCausalLM(PagedCausalLM):
    """Phi-3 causal LM over a paged KV cache (arguments: :class:`PagedCausalLM`).

    Built under ``use_tp_group`` it is one rank's part of the model: its attention heads (the
    fused ``qkv_proj`` split by head), its MLP columns (the fused ``gate_up_proj`` split in its
    gate and up halves) and its vocabulary rows.

    Raises:
        ValueError: an activation other than SiLU, a RoPE type other than ``default`` and
            ``longrope`` (``hf_config.check_supported``), or heads that cannot be split over
            the ranks.
    """

    takes_quantization = True  # the fused qkv_proj / gate_up_proj tensors hold every shard's rows

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, dtype, device, attn_backend, native_cpu_kernels, quant_config)
        check_supported(hf_config)
        args = LlamaArgs.from_hf_config(hf_config)  # no biases: Phi3Config has no attention_bias
        self.tie_word_embeddings = bool(config_value(hf_config, "tie_word_embeddings", False))
        with torch.device(self.device):  # uninitialised: load_weights fills every parameter
            self.model = Phi3Model(hf_config, args, dtype, self.device, self.attn_backend, self.quant_config)
            self.lm_head = ParallelLMHead(config_value(hf_config, "vocab_size"), args.hidden_size, dtype,
                                          layer_method_for(self.quant_config, "lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.num_kv_heads_per_rank = self.model.layers[0].self_attn.num_kv_heads  # this rank's KV cache heads
        self.head_dim = args.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)
