"""Fast torch paged attention for CPU: block gathers, batched decode, batched prefill.

Same contract as :func:`kernels.reference.paged_attention` (the oracle in the tests):
    query:           [T, num_heads, head_dim], the new tokens of B sequences concatenated
    key/value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot = block_id * block_size + offset; sequence b's new token j sits at position
    ``seq_lens[b] - q_len_b + j`` and attends causally to every position <= its own.

The work is split once per forward pass into a :class:`~kernels.cpu.attention_plan.TorchAttentionPlan`
(index tensors and masks shared by every layer, built from the host-side lengths by
:func:`kernels.cpu.attention_plan.build_plan`), then each layer runs:

* with ``native`` (float32 / bfloat16): every decode, and every prefill or chunk of at most
  ``NATIVE_MAX_QUERY_LEN`` new tokens, in one call of
  :func:`kernels.cpu.ops.paged_attention_rows`, a C kernel reading the paged cache in
  place (no gathered copy, no padding); longer prefills and chunks take the paths below.
* decodes (1 new token) without it: one ``index_select`` of whole cache blocks (``block_size * Hkv * D``
  contiguous elements each: ~50x fewer, larger copies than gathering 128-byte rows) into a
  buffer reused by every layer, giving each sequence's K/V as ``[Bd, S', Hkv, D]`` with
  ``S' = blocks * block_size``; positions past a sequence's length are masked. Then, for a
  few sequences, one SDPA call on strided views (no copy); for more, two batched matmuls
  with a float32 softmax, either "all pairs" (each sequence's K as one ``[S' Hkv, D]``
  matrix, every query head against every KV head, a mask keeping its own; few KV heads) or
  the exact GQA product on K/V transposed to ``[Bd, Hkv, S', D]`` (many KV heads).
* prefills without cached context: short sequences of similar length are right-padded into
  one ``[B, L, H, D]`` batch per length class and run through one causal SDPA call (right
  padding needs no mask: real queries never see padded keys under the causal mask); long
  ones run alone.
* prefill chunks with cached context: gather the sequence's blocks and SDPA with an offset
  causal mask (one call per such chunk; there are few per step).

Writing the new tokens' K/V uses ``index_copy_`` on the flattened cache (no boolean-mask
sync unless the slot mapping holds negative "skip" slots). Nothing queries CUDA at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import ops
from kernels.cpu.attention_plan import ChunkSeq, DecodeGroup, PrefillGroup, TorchAttentionPlan

# Decode groups of at most this many sequences use one SDPA call on strided views; larger
# ones use two batched matmuls with a float32 softmax (SDPA's flash kernel is slow for the few
# query rows per KV head of a decode).
SDPA_MAX_DECODE_SEQS = 4
# With at most this many KV heads, large decode groups score every query head against every
# KV head in one bmm (see _decode): faster than the exact product and SDPA for SmolLM2 (Hkv 3)
# at long contexts (benchmarks/RESULTS.md, "Figures moved out of the code"). With more KV heads the wasted work (Hkv x)
# outgrows the saved copies.
ALL_PAIRS_MAX_KV_HEADS = 4


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


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    block_index: torch.Tensor,  # [N * nblk] int64
    out: torch.Tensor | None,  # [N * nblk, block_size * Hkv * D] or None
) -> torch.Tensor:  # [N * nblk, block_size * Hkv * D]
    """Copy whole blocks (one contiguous run of ``block_size * Hkv * D`` elements each)."""
    flat = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * Hkv * D]
    if out is None:
        return flat.index_select(0, block_index)
    return torch.index_select(flat, 0, block_index, out=out)


def _decode_bias(
    group: DecodeGroup,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
) -> torch.Tensor:  # [Bd or 1, H, S' * Hkv] float32, 0 = attend, -inf = not
    """Additive mask of the all-pairs decode scores: query head ``i`` keeps only the columns
    ``(s, i // group)`` of its own KV head with ``s`` before the sequence's length."""
    same = (torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)).unsqueeze(1) == torch.arange(
        num_kv_heads, device=device
    )  # [H, Hkv]
    if group.valid is None:  # every sequence is exactly S' = max_len long
        allowed = same[None, :, None, :].expand(1, num_heads, group.max_len, num_kv_heads)  # [1, H, S', Hkv]
    else:
        s = group.valid.shape[-1]  # S'
        allowed = group.valid.view(-1, 1, s, 1) & same[None, :, None, :]  # [Bd, H, S', Hkv]
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill_(~allowed, float("-inf"))
    return bias.view(bias.shape[0], num_heads, -1)


def _decode(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    group: DecodeGroup,
    scale: float,
    plan: TorchAttentionPlan,
) -> torch.Tensor:  # [Bd, H, D]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    bd, s = group.num_seqs, group.num_blocks * block_size
    shape = (bd * group.num_blocks, block_size * hkv * head_dim)
    k = _gather_blocks(key_cache, group.block_index, plan.buffer("dk", shape, key_cache))
    v = _gather_blocks(value_cache, group.block_index, plan.buffer("dv", shape, value_cache))
    q = query[group.rows]  # [Bd, H, D]
    if bd <= SDPA_MAX_DECODE_SEQS:
        k = k.view(bd, s, hkv, head_dim).transpose(1, 2)  # [Bd, Hkv, S', D], strided (no copy)
        v = v.view(bd, s, hkv, head_dim).transpose(1, 2)
        mask = group.valid
        if bd == 1 and mask is not None:  # one sequence: cut the padding instead of masking it
            k, v, mask = k[:, :, : group.max_len], v[:, :, : group.max_len], None
        q = q.view(bd, hkv, num_heads // hkv, head_dim)  # [Bd, Hkv, G, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [Bd, Hkv, G, D]
        return out.reshape(bd, num_heads, head_dim)
    if hkv <= ALL_PAIRS_MAX_KV_HEADS:
        # All pairs: each sequence's gathered K is one contiguous [S' Hkv, D] matrix (rows
        # (s, kv_head)), so one plain bmm scores every query head against every KV head, and
        # an additive mask keeps each head's own KV head (GQA) and the positions before the
        # length. Hkv times the multiply-adds of the exact product, but no transposed copies.
        bias = plan.scratch.get("decode_bias")
        if bias is None:
            bias = plan.scratch["decode_bias"] = _decode_bias(group, num_heads, hkv, query.device)
        k = k.view(bd, s * hkv, head_dim)  # [Bd, S' Hkv, D]
        v = v.view(bd, s * hkv, head_dim)
        scores = torch.bmm(q.contiguous(), k.transpose(1, 2))  # [Bd, H, S' Hkv]
        probs = torch.add(bias, scores, alpha=scale).softmax(dim=-1)  # float32 softmax
        return torch.bmm(probs.to(query.dtype), v)  # [Bd, H, D]
    # Exact GQA product: K and V transposed to [Bd, Hkv, S', D], the query as [Bd, Hkv, G, D]
    # (the G query heads sharing a KV head play the role of SDPA's query length).
    kt = plan.buffer("dkt", (bd, hkv, s, head_dim), key_cache)
    vt = plan.buffer("dvt", (bd, hkv, s, head_dim), value_cache)
    kt.copy_(k.view(bd, s, hkv, head_dim).transpose(1, 2))
    vt.copy_(v.view(bd, s, hkv, head_dim).transpose(1, 2))
    q = q.reshape(bd, hkv, num_heads // hkv, head_dim)  # [Bd, Hkv, G, D]
    scores = torch.matmul(q, kt.transpose(-1, -2))  # [Bd, Hkv, G, S']
    if group.valid is not None:
        mask = plan.scratch.get("decode_mask")
        if mask is None:
            mask = plan.scratch["decode_mask"] = torch.zeros(group.valid.shape, device=query.device).masked_fill_(
                ~group.valid, float("-inf")
            )  # [Bd, 1, 1, S'] float32
        probs = torch.add(mask, scores, alpha=scale).softmax(dim=-1)  # float32 softmax
    else:
        probs = scores.float().mul_(scale).softmax(dim=-1)
    return torch.matmul(probs.to(query.dtype), vt).reshape(bd, num_heads, head_dim)  # [Bd, H, D]


def _prefill(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    group: PrefillGroup,
    scale: float,
) -> torch.Tensor:  # [Tg, H, D], rows in the order of ``group.rows`` (one sequence: its rows)
    num_heads, head_dim = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    gqa = num_heads != hkv
    if group.pad_index is None:  # one sequence: no padding
        start, end = group.starts[0], group.starts[0] + group.lens[0]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        k = key[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, Q, D]
        v = value[start:end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)  # [Q, H, D]
    bp, length = len(group.starts), group.max_len
    q = query.index_select(0, group.pad_index).view(bp, length, num_heads, head_dim).transpose(1, 2)
    k = key.index_select(0, group.pad_index).view(bp, length, hkv, head_dim).transpose(1, 2)
    v = value.index_select(0, group.pad_index).view(bp, length, hkv, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)  # [Bp, H, L, D]
    out = out.transpose(1, 2).reshape(bp * length, num_heads, head_dim)  # [Bp * L, H, D]
    return out.index_select(0, group.unpad_index)  # [Tg, H, D]


def _chunk(
    query: torch.Tensor,  # [Q, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    chunk: ChunkSeq,
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    head_dim, hkv = key_cache.shape[3], key_cache.shape[2]
    s = chunk.seq_len
    k = _gather_blocks(key_cache, chunk.block_index, None).view(1, -1, hkv, head_dim)[:, :s].transpose(1, 2)
    v = _gather_blocks(value_cache, chunk.block_index, None).view(1, -1, hkv, head_dim)[:, :s].transpose(1, 2)
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

    Precision: SDPA and the matmuls accumulate in float32 (bf16/fp16 inputs); the decode
    softmax runs in float32.
    """
    write_kv(key, value, key_cache, value_cache, plan)
    nat = plan.native
    if nat is not None and nat.rows is None:  # every row in the C kernel, straight into its output
        return ops.paged_attention_rows(
            query, key_cache, value_cache, nat.block_index, nat.num_blocks, nat.row_seq, nat.row_len, scale,
            validate=False,  # built by _native_rows from the step's lengths; supports() checked
        )
    dec = plan.decode
    if dec is not None and isinstance(dec.rows, slice) and dec.num_seqs == plan.num_tokens:
        return _decode(query, key_cache, value_cache, dec, scale, plan)  # pure decode step: no copy
    if (
        dec is None and not plan.chunks and len(plan.prefills) == 1
        and sum(plan.prefills[0].lens) == plan.num_tokens
    ):
        return _prefill(query, key, value, plan.prefills[0], scale)  # pure prefill step, token order
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if nat is not None:
        out.index_copy_(0, nat.rows, ops.paged_attention_rows(
            query.index_select(0, nat.rows), key_cache, value_cache, nat.block_index, nat.num_blocks, nat.row_seq,
            nat.row_len, scale, validate=False,
        ))
    if dec is not None:
        out[dec.rows] = _decode(query, key_cache, value_cache, dec, scale, plan)
    for group in plan.prefills:
        if group.rows is None:
            start = group.starts[0]
            out[start : start + group.lens[0]] = _prefill(query, key, value, group, scale)
        else:
            out.index_copy_(0, group.rows, _prefill(query, key, value, group, scale))
    for chunk in plan.chunks:
        out[chunk.start : chunk.end] = _chunk(query[chunk.start : chunk.end], key_cache, value_cache, chunk, scale)
    return out
