"""The attention layer: a layer's heads over the step's attention backend and its own KV cache."""

from __future__ import annotations

import torch

from services.executor.attention import AttentionBackend, AttentionMetadata
from services.executor.layers.utils import FastModule


class Attention(FastModule):
    """Paged causal attention of one decoder layer (vLLM's ``Attention``).

    Holds the layer's head counts, head size, softmax scale, sliding window (tokens, itself
    included; None: the whole context) and logit soft cap (None: none), and calls the backend,
    which writes the new tokens' K/V into this layer's cache and attends. ``backend`` is shared
    by every layer of a model (the model replaces it on all of them at once).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 backend: AttentionBackend, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.backend = backend
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        if self.sliding_window is None and self.logits_soft_cap is None:
            return self.backend.forward(query, key, value, kv_cache[0], kv_cache[1], attn_metadata, self.scale)
        return self.backend.forward(query, key, value, kv_cache[0], kv_cache[1], attn_metadata, self.scale,
                                    self.sliding_window, self.logits_soft_cap)
