"""Triton paged attention for a mixed batch (decode, prefill, chunked prefill, prefix-cache hits).

Same contract as :func:`kernels.reference.paged_attention` (the oracle in the tests):
    query:           [T, num_heads, head_dim], the new tokens of B sequences concatenated
    key/value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:    [B, max_blocks] int32, logical -> physical block ids
    seq_lens:        [B] int32, cached context + new tokens
    query_start_loc: [B+1] int32, sequence b's new tokens are rows qsl[b]:qsl[b+1]
Sequence b's new token j sits at position ``seq_lens[b] - q_len_b + j`` and attends causally to
every position <= its own (optionally only the last ``sliding_window`` ones; scores optionally
soft-capped as ``c * tanh(s / c)``).

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

Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_utils import KernelLaunch, is_interpreted

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: rows whose keys are all masked so far get
# exp2(-inf - _NEG_BIG) == 0 and exp2(_NEG_BIG - _NEG_BIG) == 1, never inf - inf = NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64


class AttentionTiles(NamedTuple):
    """Tile shape and launch options of ``_paged_attn_kernel``; ``None`` keeps the heuristic's.

    For tuning on a GPU (``benchmarks/kernels.py --sweep``), not for the model runner.
    ``block_m``: rows per program (query tokens x the padded GQA group), a power of two
    >= 16 and >= the padded group; ``tile_n``: keys per loop iteration, a power of two >= 16;
    ``num_warps``: 1, 2, 4, 8 or 16; ``num_stages``: software-pipelining depth, >= 1.
    """

    block_m: int | None = None
    tile_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check_tiles(tiles: AttentionTiles, group_pad: int) -> None:
    """Raise ValueError naming the field of ``tiles`` that the kernel cannot take."""
    if tiles.block_m is not None and not (_is_pow2(tiles.block_m) and tiles.block_m >= max(16, group_pad)):
        raise ValueError(f"tiles.block_m must be a power of two >= max(16, padded group {group_pad}), "
                         f"got {tiles.block_m}")
    if tiles.tile_n is not None and not (_is_pow2(tiles.tile_n) and tiles.tile_n >= 16):
        raise ValueError(f"tiles.tile_n must be a power of two >= 16, got {tiles.tile_n}")
    if tiles.num_warps is not None and tiles.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"tiles.num_warps must be 1, 2, 4, 8 or 16, got {tiles.num_warps}")
    if tiles.num_stages is not None and tiles.num_stages < 1:
        raise ValueError(f"tiles.num_stages must be >= 1, got {tiles.num_stages}")


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


@functools.cache
def _num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (queried at the first launch, never at import)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # CPU / interpreter: pretend to be an H100-class GPU so the heuristics are exercised


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """Split-K factor: 1 (single pass) unless few short queries meet long contexts.

    Flash-decoding pays off when the ``num_seqs * num_kv_heads`` programs of the single pass
    cannot fill the GPU and each would walk many keys: aim for ~2 programs per SM, with at
    least 256 keys per split, as a power of two <= MAX_SPLITS.
    """
    if max_query_len > 16 or max_seq_len < 512:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), max_seq_len // 256, MAX_SPLITS)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)  # round down to a power of two


def plan_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    path: Literal["auto", "single", "split_k"] = "auto",
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], dtype of query
    tiles: AttentionTiles | None = None,
) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """Check the arguments, pick path and tiles, allocate ``out`` / scratch; launch nothing.

    Returns ``(out, launches)``; running the launches in order fills ``out``. Separate from
    :func:`paged_attention` so that the exact launches can be compiled for a GPU target on a
    machine without one (:func:`kernels.triton_utils.compile_launch`).
    """
    assert query.dim() == 3, query.shape
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, (key_cache.shape, value_cache.shape)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim, (cache_head_dim, head_dim)
    assert 0 < head_dim <= MAX_HEAD_DIM, head_dim
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.dtype in _DTYPES, query.dtype
    assert key_cache.dtype == query.dtype and value_cache.dtype == query.dtype, (query.dtype, key_cache.dtype)
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32, (
        block_tables.shape,
        block_tables.dtype,
    )
    num_seqs = block_tables.shape[0]
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32, (seq_lens.shape, seq_lens.dtype)
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    assert query_start_loc.dtype == torch.int32, query_start_loc.dtype
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1
    assert sliding_window is None or sliding_window > 0, sliding_window
    assert soft_cap is None or soft_cap > 0, soft_cap
    assert path in ("auto", "single", "split_k"), path
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)}
    assert len(devices) == 1, devices
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.device == query.device
    if num_tokens == 0 or num_seqs == 0:
        return out, []

    if path == "split_k":
        splits = 4 if num_splits is None else num_splits
        assert 2 <= splits <= MAX_SPLITS and splits & (splits - 1) == 0, splits
    elif path == "single":
        splits = 1
    else:
        if max_query_len is None:  # one device->host sync each; the model runner passes them
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        splits = choose_num_splits(
            num_seqs, num_kv_heads, max_query_len, max_seq_len, _device_sms(query.device)
        )

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Decode-like batches take the smallest tile tl.dot accepts (16 rows); the query length is
    # taken from T / B when the caller gave no max_query_len (no sync just for the tile shape).
    q_per_seq = max_query_len if max_query_len is not None else triton.cdiv(num_tokens, num_seqs)
    # Tiles shrink as a padded row grows so registers do not spill (checked with ptxas for sm_80 /
    # sm_90); fp32 counts double, its "ieee" dot runs on FMA units, not tensor cores.
    row_bytes = head_dim_pad * query.element_size() * (2 if query.dtype == torch.float32 else 1)
    tile_rows = 64 if row_bytes <= 256 else (32 if row_bytes <= 512 else 16)
    block_m = max(16 if q_per_seq * group_pad <= 16 else tile_rows, group_pad)
    tile_n = tile_rows
    num_warps, num_stages = (4 if row_bytes <= 256 else 8), 2
    if tiles is not None:
        _check_tiles(tiles, group_pad)
        block_m = tiles.block_m or block_m
        tile_n = tiles.tile_n or tile_n
        num_warps = tiles.num_warps or num_warps
        num_stages = tiles.num_stages or num_stages
    block_q = block_m // group_pad
    num_q_tiles = num_tokens // block_q + num_seqs  # upper bound; spare programs exit at once

    if splits > 1:
        dev = query.device
        part_acc = torch.empty((num_tokens, num_heads, splits, head_dim_pad), dtype=torch.float32, device=dev)
        part_ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused by the single pass

    attn = KernelLaunch(
        _paged_attn_kernel,
        (num_q_tiles, num_kv_heads, splits),
        dict(
            out_ptr=out,
            part_acc_ptr=part_acc,
            part_ml_ptr=part_ml,
            query_ptr=query,
            key_cache_ptr=key_cache,
            value_cache_ptr=value_cache,
            block_tables_ptr=block_tables,
            seq_lens_ptr=seq_lens,
            query_start_loc_ptr=query_start_loc,
            num_seqs=num_seqs,
            num_heads=num_heads,
            head_dim=head_dim,
            block_size=block_size,
            qk_scale_log2=scale * _LOG2E,
            scale=scale,
            soft_cap=soft_cap if soft_cap is not None else 1.0,
            sliding_window=sliding_window if sliding_window is not None else 1,
            stride_q_tok=query.stride(0),
            stride_q_head=query.stride(1),
            stride_q_d=query.stride(2),
            stride_o_tok=out.stride(0),
            stride_o_head=out.stride(1),
            stride_o_d=out.stride(2),
            stride_kc_blk=key_cache.stride(0),
            stride_kc_tok=key_cache.stride(1),
            stride_kc_head=key_cache.stride(2),
            stride_kc_d=key_cache.stride(3),
            stride_vc_blk=value_cache.stride(0),
            stride_vc_tok=value_cache.stride(1),
            stride_vc_head=value_cache.stride(2),
            stride_vc_d=value_cache.stride(3),
            stride_bt_seq=block_tables.stride(0),
            GROUP=group,
            GROUP_PAD=group_pad,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            TILE_N=tile_n,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=splits,
            SLIDING=sliding_window is not None,
            SOFT_CAP=soft_cap is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            F32_OPERANDS=query.dtype == torch.bfloat16 and is_interpreted(_paged_attn_kernel),
            num_warps=num_warps,
            num_stages=num_stages,
        ),
    )
    if splits == 1:
        return out, [attn]
    # heads per reduce program: a slab of <= 4096 fp32 partials (16 KiB)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // (splits * head_dim_pad)))
    reduce = KernelLaunch(
        _split_k_reduce_kernel,
        (num_tokens, triton.cdiv(num_heads, block_h)),
        dict(
            out_ptr=out,
            part_acc_ptr=part_acc,
            part_ml_ptr=part_ml,
            query_start_loc_ptr=query_start_loc,
            num_seqs=num_seqs,
            num_heads=num_heads,
            head_dim=head_dim,
            stride_o_tok=out.stride(0),
            stride_o_head=out.stride(1),
            stride_o_d=out.stride(2),
            BLOCK_H=block_h,
            NUM_SPLITS=splits,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4,
        ),
    )
    return out, [attn, reduce]


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
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    path: Literal["auto", "single", "split_k"] = "auto",
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], dtype of query
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of query
    """Causal paged attention of a mixed batch in one launch (plus a reduce launch for split-K).

    Arguments as :func:`kernels.reference.paged_attention`; the K/V of the new tokens must
    already be in the cache. ``query``, the caches and ``out`` share one dtype (fp32/fp16/bf16);
    head_dim <= 256 (padded to a power of two inside, e.g. 80 -> 128); any block size; GQA/MQA
    with ``num_heads % num_kv_heads == 0``. Rows of ``out`` past ``query_start_loc[B]`` are left
    untouched.

    ``max_query_len`` / ``max_seq_len``: host-side maxima over the batch (the model runner knows
    them). They only steer the path and tile shape; with ``path="auto"`` a missing one is read
    from the tensors (a device->host sync). ``path``: "auto" picks split-K for decode-like
    batches with long contexts and few sequences (:func:`choose_num_splits`), "single" forces
    the single-pass kernel, "split_k" forces split-K with ``num_splits`` (power of two in
    [2, MAX_SPLITS], default 4). ``tiles``: overrides of the tile shape and launch options
    (:class:`AttentionTiles`; ValueError for a value the kernel cannot take).
    """
    if query.device.type == "cpu" and not is_interpreted(_paged_attn_kernel):
        raise RuntimeError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing triton"
        )
    out, launches = plan_paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        soft_cap,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        path=path,
        num_splits=num_splits,
        out=out,
        tiles=tiles,
    )
    for launch in launches:
        launch()
    return out
