"""Torch reference of the paged-attention kernels: simple, obviously correct, the oracle.

Cache layout (per layer, one tensor for K and one for V):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

Flat batch layout (vLLM V1): the new tokens of B sequences are concatenated into T rows.
    query_start_loc: [B+1] int32, sequence b's new tokens are rows qsl[b]:qsl[b+1]
    seq_lens:        [B] int32, context (already cached) + new tokens of each sequence
    block_tables:    [B, max_blocks] int32, logical -> physical block ids (padding ignored)
Sequence b's new token j sits at absolute position ``seq_lens[b] - q_len_b + j`` and attends
causally to every position <= its own (PagedAttention, Kwon et al., SOSP 2023).
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot means skip the token
) -> None:
    """Write the new tokens' K and V into the paged cache at ``slot_mapping`` (in place)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(value_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,  # tokens
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first ``seq_len`` cached tokens of one sequence, in logical order."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of query
    """Causal attention of each sequence's new tokens over its whole cached sequence.

    The new tokens' K/V must already be in the cache (``reshape_and_cache`` first).
    Computed in float32, one sequence at a time. GQA: query head h reads KV head
    ``h // (num_heads // num_kv_heads)``. ``sliding_window`` w: a token attends to the last
    w positions including itself (Mistral). ``soft_cap`` c: scores become c * tanh(s / c)
    (Gemma 2).
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[b], seq_len).float()  # [S, Hkv, D]
        v = gather_kv(value_cache, block_tables[b], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Q, S]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [Q, 1]
        k_pos = torch.arange(seq_len).unsqueeze(0)  # [1, S]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
