"""Triton paged attention for a mixed batch (decode, prefill, chunked prefill, prefix-cache hits).

Same contract as :func:`kernels.reference.paged_attention` (the oracle in the tests):
    query:           [T, num_heads, head_dim], the new tokens of B sequences concatenated
    key/value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:    [B, max_blocks] int32, logical -> physical block ids
    seq_lens:        [B] int32, cached context + new tokens
    query_start_loc: [B+1] int32, sequence b's new tokens are rows qsl[b]:qsl[b+1]
Sequence b's new token j sits at position ``seq_lens[b] - q_len_b + j`` and attends causally to
every position <= its own (optionally only the last ``sliding_window`` ones; scores optionally
soft-capped as ``c * tanh(s / c)``: both kernel-only until a model needs them).

Algorithm: one kernel, ``_paged_attn_kernel``, tiled as
    program (q_tile, kv_head, split) -> BLOCK_M rows = BLOCK_Q query tokens x all GROUP query
    heads that share ``kv_head`` (GQA/MQA: every K/V tile is loaded once for the whole group),
looping over TILE_N-key tiles of the sequence read through the block table (each key row
looks up its own physical block, so TILE_N is independent of the cache block size), with the
online softmax of FlashAttention-2 (Dao, 2023) kept in base 2 (``exp2``, scores pre-multiplied
by log2(e)). Query tiles are mapped to sequences on the device by a binary search over
``query_start_loc`` (as vLLM's ``unified_attention``), so the launch needs no host sync.

* single pass (NUM_SPLITS == 1): each program owns all keys of its rows and writes the output.
* split-K (flash-decoding, Dao et al. 2023): the key range of each query tile is cut into
  NUM_SPLITS contiguous chunks run by separate programs, which write unnormalised partial
  outputs plus their running max / sum; ``_split_k_reduce_kernel`` merges them. Used when few
  query tiles (decode) meet long contexts, so that the GPU has enough programs to fill it.

The launches are planned by :mod:`kernels.triton.attention` (:func:`~kernels.triton.attention.paged_attention`).
Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: rows whose keys are all masked so far get
# exp2(-inf - _NEG_BIG) == 0 and exp2(_NEG_BIG - _NEG_BIG) == 1, never inf - inf = NaN.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [B+1] int32
    q_tile_idx,  # int32, program's query tile in the flat tile numbering
    num_seqs,  # int32, B
    BLOCK_Q: tl.constexpr,  # query tokens per tile, >= 1
):
    """Largest b with ``qsl[b] // BLOCK_Q + b <= q_tile_idx`` (sequence b's first tile)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attn_kernel(
    out_ptr,  # [T, num_heads, head_dim] query dtype (NUM_SPLITS == 1)
    part_acc_ptr,  # [T, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32, unnormalised (NUM_SPLITS > 1)
    part_ml_ptr,  # [T, num_heads, NUM_SPLITS, 2] fp32, (running max in log2 units, sum) (NUM_SPLITS > 1)
    query_ptr,  # [T, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    num_seqs,  # int, B
    num_heads,  # int
    head_dim,  # int, <= HEAD_DIM_PAD
    block_size,  # int, tokens per cache block
    qk_scale_log2,  # float, softmax scale * log2(e); unused when SOFT_CAP
    scale,  # float, softmax scale; used only when SOFT_CAP
    soft_cap,  # float, > 0; used only when SOFT_CAP
    sliding_window,  # int, > 0; used only when SLIDING
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_q_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so loads vectorise)
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_o_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so loads vectorise)
    stride_kc_blk: tl.int64,
    stride_kc_tok: tl.int64,
    stride_kc_head: tl.int64,
    stride_kc_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so loads vectorise)
    stride_vc_blk: tl.int64,
    stride_vc_tok: tl.int64,
    stride_vc_head: tl.int64,
    stride_vc_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so loads vectorise)
    stride_bt_seq: tl.int64,
    GROUP: tl.constexpr,  # query heads per KV head (num_heads // num_kv_heads), >= 1
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per tile; BLOCK_M == BLOCK_Q * GROUP_PAD
    BLOCK_M: tl.constexpr,  # rows per tile, power of two >= 16
    TILE_N: tl.constexpr,  # keys per inner-loop step, power of two >= 16
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim, >= 16
    NUM_SPLITS: tl.constexpr,  # 1: single pass; > 1: split-K partials (power of two)
    SLIDING: tl.constexpr,  # bool, apply sliding_window
    SOFT_CAP: tl.constexpr,  # bool, apply soft_cap
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (ignored for 16-bit)
    F32_OPERANDS: tl.constexpr,  # bool, True only for bf16 under the interpreter (see below)
):
    """Program (q_tile, kv_head, split): see the module docstring.

    F32_OPERANDS: the interpreter's tl.dot multiplies the raw uint16 bit patterns of bf16
    operands (triton-lang/triton#11584), so there they are upcast to fp32 first; the upcast is
    exact, i.e. the same products the GPU's bf16 MMA accumulates in fp32.
    """
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q0 = (q_tile_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query token of the tile, local
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before the new ones

    # Rows: r -> (query token q0 + r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD).
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q0 + offs_m // GROUP_PAD  # [BLOCK_M]
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M]
    row_ok = (q_local < q_len) & (offs_m % GROUP_PAD < GROUP)  # [BLOCK_M]
    q_pos = ctx_len + q_local  # [BLOCK_M] absolute position of the row's token
    tok = (q_start + q_local).to(tl.int64)  # [BLOCK_M] row in the flat batch
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < head_dim

    q = tl.load(
        query_ptr
        + tok[:, None] * stride_q_tok
        + head[:, None].to(tl.int64) * stride_q_head
        + offs_d[None, :].to(tl.int64) * stride_q_d,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if F32_OPERANDS:
        q = q.to(tl.float32)

    # Keys this tile needs: [kv_lo, kv_hi); the last row sees positions < kv_hi.
    kv_hi = ctx_len + tl.minimum(q0 + BLOCK_Q, q_len)
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(ctx_len + q0 - sliding_window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * tiles_per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + tiles_per_split)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kc_head = key_cache_ptr + kv_head.to(tl.int64) * stride_kc_head
    vc_head = value_cache_ptr + kv_head.to(tl.int64) * stride_vc_head

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    for t in range(tile_lo, tile_hi):
        offs_n = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] logical key positions
        n_ok = offs_n < kv_hi
        phys = tl.load(bt_row + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)  # [TILE_N]
        in_blk = (offs_n % block_size).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            kc_head
            + phys[:, None] * stride_kc_blk
            + in_blk[:, None] * stride_kc_tok
            + offs_d[None, :].to(tl.int64) * stride_kc_d,
            mask=kv_mask,
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        v = tl.load(
            vc_head
            + phys[:, None] * stride_vc_blk
            + in_blk[:, None] * stride_vc_tok
            + offs_d[None, :].to(tl.int64) * stride_vc_d,
            mask=kv_mask,
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]

        if F32_OPERANDS:  # exact upcast, see the docstring
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
        if SOFT_CAP:
            s = s * scale
            # c * tanh(s / c), tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates correctly at +-inf)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
            s = s * 1.4426950408889634
        else:
            s = s * qk_scale_log2
        ok = offs_n[None, :] <= q_pos[:, None]  # causal, also excludes keys >= kv_hi
        if SLIDING:
            ok = ok & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M], finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(value_cache_ptr.dtype.element_ty)  # P @ V runs in the cache dtype (tensor cores)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # fp32
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr
            + tok[:, None] * stride_o_tok
            + head[:, None].to(tl.int64) * stride_o_head
            + offs_d[None, :].to(tl.int64) * stride_o_d,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (tok * num_heads + head.to(tl.int64)) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _split_k_reduce_kernel(
    out_ptr,  # [T, num_heads, head_dim] query dtype
    part_acc_ptr,  # [T, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32, unnormalised
    part_ml_ptr,  # [T, num_heads, NUM_SPLITS, 2] fp32, (max in log2 units, sum)
    query_start_loc_ptr,  # [B+1] int32; rows >= qsl[B] are padding, left untouched
    num_seqs,  # int, B
    num_heads,  # int
    head_dim,  # int, <= HEAD_DIM_PAD
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_o_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so loads vectorise)
    BLOCK_H: tl.constexpr,  # heads per program, power of two
    NUM_SPLITS: tl.constexpr,  # power of two >= 2, as in the attention launch
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim
):
    """Merge split-K partials (flash-decoding): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

    Program (token, head block) reads the contiguous [BLOCK_H, NUM_SPLITS, HEAD_DIM_PAD] slab.
    """
    tok = tl.program_id(0).to(tl.int64)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < num_heads
    part = (tok * num_heads + offs_h[:, None].to(tl.int64)) * NUM_SPLITS + offs_s[None, :]  # [BLOCK_H, S]
    m = tl.load(part_ml_ptr + part * 2, mask=h_ok[:, None], other=0.0)  # [BLOCK_H, NUM_SPLITS]
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=h_ok[:, None], other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, :, None] * HEAD_DIM_PAD + offs_d[None, None, :],
        mask=h_ok[:, None, None],
        other=0.0,
    )  # [BLOCK_H, NUM_SPLITS, HEAD_DIM_PAD]
    w = tl.exp2(m - tl.max(m, axis=1)[:, None])  # [BLOCK_H, NUM_SPLITS]; empty split: m=-1e30 -> 0
    denom = tl.sum(w * l_s, axis=1)  # [BLOCK_H]
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = tl.sum(acc * w[:, :, None], axis=1) / denom[:, None]  # [BLOCK_H, HEAD_DIM_PAD]
    tl.store(
        out_ptr
        + tok * stride_o_tok
        + offs_h[:, None].to(tl.int64) * stride_o_head
        + offs_d[None, :].to(tl.int64) * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & (offs_d[None, :] < head_dim),
    )
