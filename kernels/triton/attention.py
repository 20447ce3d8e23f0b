"""Triton paged attention for a mixed batch: argument checks, path and tile choice, launches.

:func:`paged_attention` checks its arguments, picks the single-pass or split-K path
(:func:`choose_num_splits`) and the tile shape, and launches the kernels of
:mod:`kernels.triton.attention_kernels` (where the algorithm is described).
:func:`plan_paged_attention` does the same without launching, so that the exact launches can
be compiled for a GPU target on a machine without one
(:func:`kernels.triton.utils.compile_launch`). The ``sliding_window`` and ``soft_cap``
options are kernel-only until a model needs them (:func:`services.executor.models.hf_config.check_supported`
refuses sliding-window models; no supported model soft-caps its scores).

Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch
import triton

from kernels.triton.attention_kernels import LOG2E, _paged_attn_kernel, _split_k_reduce_kernel
from kernels.triton.utils import KernelLaunch, is_interpreted

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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
    machine without one (:func:`kernels.triton.utils.compile_launch`).
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
            qk_scale_log2=scale * LOG2E,
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
    untouched. ``sliding_window`` (attend only the last ones) and ``soft_cap`` (scores
    ``c * tanh(s / c)``) are kernel-only until a model needs them.

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
