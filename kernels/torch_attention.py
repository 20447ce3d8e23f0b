"""Fast torch paged attention for CPU: batched decode, SDPA prefill, no per-decode Python loop.

Same contract as :func:`kernels.reference.paged_attention` (the oracle in the tests):
    query:           [T, num_heads, head_dim], the new tokens of B sequences concatenated
    key/value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot = block_id * block_size + offset; sequence b's new token j sits at position
    ``seq_lens[b] - q_len_b + j`` and attends causally to every position <= its own.

The work is split once per forward pass into a :class:`TorchAttentionPlan` (index tensors and
masks shared by every layer, built from the host-side lengths), then each layer runs:

* decodes (1 new token): one batched gather of every decode sequence's K/V straight into
  ``[Bd, Hkv, S_max, D]`` (an ``index_select`` of cache rows by precomputed
  ``slot * Hkv + kv_head`` indices), then one ``scaled_dot_product_attention`` with GQA done by
  a reshape of the query to ``[Bd, Hkv, group, D]`` (the group of query heads that share a KV
  head plays the role of SDPA's query length) and a key-padding mask when lengths differ.
* prefills without cached context: SDPA ``is_causal=True`` directly on the new tokens' K/V,
  nothing gathered from the cache.
* prefill chunks with cached context: gather the sequence's K/V and SDPA with an offset
  causal mask (one call per such chunk; there are few per step).

Writing the new tokens' K/V uses ``index_copy_`` on the flattened cache (no boolean-mask
sync unless the slot mapping holds negative "skip" slots). Nothing queries CUDA at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    """All single-token sequences of a step, attended in one batched SDPA call."""

    rows: slice | torch.Tensor  # token rows of the decode queries: a slice, or [Bd] int64
    gather_index: torch.Tensor  # [Bd * Hkv * S] int64, rows of cache.view(-1, head_dim)
    mask: torch.Tensor | None  # [Bd, 1, 1, S] bool (True = attend); None if all lengths == S
    num_seqs: int  # Bd
    max_len: int  # S, the longest decode sequence in tokens


@dataclass
class ChunkSeq:
    """One prefill chunk that attends over cached context plus its own new tokens."""

    start: int  # first token row of the chunk
    end: int  # one past the last token row
    gather_index: torch.Tensor  # [Hkv * S] int64, rows of cache.view(-1, head_dim)
    mask: torch.Tensor  # [Q, S] bool, offset causal mask (True = attend)


@dataclass
class TorchAttentionPlan:
    """Per-forward index tensors of the torch backend, built once and shared by all layers."""

    num_kv_heads: int
    block_size: int
    num_tokens: int  # T
    write_slots: torch.Tensor  # [T'] int64, cache slots of the tokens whose K/V are written
    write_rows: torch.Tensor | None  # [T'] int64 token rows of those slots; None = all rows
    decode: DecodeGroup | None = None
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (start, end) rows, no context
    chunks: list[ChunkSeq] = field(default_factory=list)


def _slot_rows(
    block_tables: torch.Tensor,  # [N, max_blocks] int32/int64, physical block ids
    lens: torch.Tensor,  # [N] int64, tokens per row (<= S)
    max_len: int,  # S
    block_size: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices ``[N * Hkv * S]`` into ``cache.view(-1, D)`` and the validity mask ``[N, S]``.

    Positions past a row's length point at row 0 of the cache (read but masked out), so
    padding entries of the block table are never dereferenced.
    """
    device = block_tables.device
    pos = torch.arange(max_len, device=device)  # [S]
    blocks = block_tables[:, pos // block_size].long()  # [N, S]
    slots = blocks * block_size + pos % block_size  # [N, S]
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [N, S]
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    heads = torch.arange(num_kv_heads, device=device)  # [Hkv]
    index = slots.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)  # [N, Hkv, S]
    return index.reshape(-1), valid


def build_plan(
    query_lens: list[int],  # [B] new tokens per sequence
    seq_lens: list[int],  # [B] cached context + new tokens per sequence
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    slot_mapping: torch.Tensor,  # [T] int64; negative = do not write this token
    block_size: int,
    num_kv_heads: int,
) -> TorchAttentionPlan:
    """Classify the sequences (decode / prefill / chunk) and precompute every index tensor."""
    device = block_tables.device
    num_tokens = int(slot_mapping.shape[0])
    if num_tokens and bool((slot_mapping < 0).any()):
        write_rows = torch.nonzero(slot_mapping >= 0).flatten()  # [T'] int64
        write_slots = slot_mapping.index_select(0, write_rows).long()
    else:
        write_rows, write_slots = None, slot_mapping.long()
    plan = TorchAttentionPlan(num_kv_heads, block_size, num_tokens, write_slots, write_rows)

    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        end = start + q_len
        if q_len == 1:
            decode_seqs.append(b)
            decode_rows.append(start)
        elif q_len > 1 and q_len == seq_len:
            plan.prefills.append((start, end))
        elif q_len > 1:
            index, _ = _slot_rows(
                block_tables[b : b + 1], torch.tensor([seq_len], device=device), seq_len,
                block_size, num_kv_heads,
            )
            k_pos = torch.arange(seq_len, device=device)  # [S]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # [Q]
            mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [Q, S]
            plan.chunks.append(ChunkSeq(start, end, index, mask))
        start = end

    if decode_seqs:
        lens_list = [seq_lens[b] for b in decode_seqs]
        max_len = max(lens_list)
        contiguous = decode_rows == list(range(decode_rows[0], decode_rows[0] + len(decode_rows)))
        rows: slice | torch.Tensor
        if contiguous:
            rows = slice(decode_rows[0], decode_rows[0] + len(decode_rows))
        else:
            rows = torch.tensor(decode_rows, dtype=torch.int64, device=device)
        seqs = torch.arange(len(decode_seqs), device=device)
        if len(decode_seqs) != block_tables.shape[0]:
            seqs = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
        lens = torch.tensor(lens_list, dtype=torch.int64, device=device)  # [Bd]
        index, valid = _slot_rows(block_tables[seqs], lens, max_len, block_size, num_kv_heads)
        mask = None if min(lens_list) == max_len else valid[:, None, None, :]  # [Bd, 1, 1, S]
        plan.decode = DecodeGroup(rows, index, mask, len(decode_seqs), max_len)
    return plan


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    plan: TorchAttentionPlan,
) -> None:
    """``reshape_and_cache`` with the plan's precomputed slots: two ``index_copy_`` calls."""
    hkv, d = key_cache.shape[2], key_cache.shape[3]
    if plan.write_rows is not None:
        key, value = key.index_select(0, plan.write_rows), value.index_select(0, plan.write_rows)
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    key_cache.view(-1, hkv, d).index_copy_(0, plan.write_slots, key)
    value_cache.view(-1, hkv, d).index_copy_(0, plan.write_slots, value)


def _decode(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:  # [Bd, H, D]
    num_heads, head_dim = query.shape[1], query.shape[2]
    hkv = key_cache.shape[2]
    bd, s = group.num_seqs, group.max_len
    q = query[group.rows].reshape(bd, hkv, num_heads // hkv, head_dim)  # [Bd, Hkv, G, D]
    k = key_cache.view(-1, head_dim).index_select(0, group.gather_index).view(bd, hkv, s, head_dim)
    v = value_cache.view(-1, head_dim).index_select(0, group.gather_index).view(bd, hkv, s, head_dim)
    if query.dtype == torch.float32 or bd < 8:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)  # [Bd, Hkv, G, D]
        return out.reshape(bd, num_heads, head_dim)
    # bf16/fp16 with 8+ sequences: two batched matmuls with the softmax in float32 are ~2.5x
    # faster on CPU than SDPA's flash kernel for these short decode queries (G rows per KV
    # head); below 8 sequences SDPA is faster.
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [Bd, Hkv, G, S] f32
    if group.mask is not None:
        scores = scores.masked_fill(~group.mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(query.dtype)
    return torch.matmul(probs, v).reshape(bd, num_heads, head_dim)  # [Bd, H, D]


def _prefill(
    query: torch.Tensor,  # [Q, H, D]
    key: torch.Tensor,  # [Q, Hkv, D]
    value: torch.Tensor,  # [Q, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    k = key.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Q, D]
    v = value.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1)


def _chunk(
    query: torch.Tensor,  # [Q, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    chunk: ChunkSeq,
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    head_dim, hkv = key_cache.shape[3], key_cache.shape[2]
    s = chunk.mask.shape[1]
    k = key_cache.view(-1, head_dim).index_select(0, chunk.gather_index).view(1, hkv, s, head_dim)
    v = value_cache.view(-1, head_dim).index_select(0, chunk.gather_index).view(1, hkv, s, head_dim)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=q.shape[1] != hkv
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D], the new tokens' keys (already rotated)
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, H, D], dtype of query
    """Write the new K/V into the cache, then attend every new token causally (see module doc).

    Precision: SDPA computes in the input dtype with float32 accumulation (bf16/fp16 inputs).
    """
    write_kv(key, value, key_cache, value_cache, plan)
    dec = plan.decode
    if dec is not None and isinstance(dec.rows, slice) and dec.num_seqs == plan.num_tokens:
        return _decode(query, key_cache, value_cache, dec, scale)  # pure decode step: no copy
    out = torch.empty_like(query)
    if dec is not None:
        out[dec.rows] = _decode(query, key_cache, value_cache, dec, scale)
    for start, end in plan.prefills:
        out[start:end] = _prefill(query[start:end], key[start:end], value[start:end], scale)
    for chunk in plan.chunks:
        out[chunk.start : chunk.end] = _chunk(query[chunk.start : chunk.end], key_cache, value_cache, chunk, scale)
    return out
