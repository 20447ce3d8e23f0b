"""Triton matmuls over GGUF weight rows kept as raw blocks (the 32-element formats and the
K-quants): the CUDA side of :func:`kernels.cpu.quant_ops.gemm_gguf`.

A format is handed in by the caller (``fmt``: a ``BlockFormat`` of
``services/executor/layers/quantization/gguf/formats.py``, the one registry, which this package
does not import): its ``kernel_type`` is the kernels' ``GGML_TYPE`` constexpr, its
``block_bytes`` their ``BLOCK_BYTES``, and its ``k_quant`` picks the kernel.

``out = x @ W.T`` where each row of ``W`` ``[N, K]`` is stored as ``K / 32`` ggml blocks of 32
consecutive input elements (layouts in ``formats.py``): an fp16 scale
``d`` (Q4_1: then an fp16 minimum ``m``), then the quants: Q4_0 / Q4_1 16 bytes, element ``j``
in the low nibble of byte ``j`` and ``j + 16`` in its high nibble (value ``d (q - 8)`` /
``d q + m``); Q8_0 32 int8 (value ``d q``).

A program computes a ``BLOCK_M x BLOCK_N`` tile of ``out``. Each step over ``K`` takes
``BLOCKS`` ggml blocks (``32 BLOCKS`` elements) of ``BLOCK_N`` weight rows: it reads their
scales from the bytes, splits each block into its elements 0-15 and 16-31, dequantizes both
halves in registers (float32, as ``gguf.py``'s ``dequantize``), and multiplies each with its
half of the ``x`` columns (two ``tl.dot``), accumulating in float32 (``formats.dequantize``'s arithmetic). The operands are x's dtype,
or float32 when the output is float32 (the logits: exact products, as the CPU paths compute).

The K-quants (``_gemm_gguf_k_kernel``; super-blocks of 256 elements) take
one 32-element sub-block per step: each weight row's sub-block scale and min (Q6_K: a scale per
16 elements) are read from its super-block's bytes, the 32 quants assembled from their bit
fields, and the ``[32, BLOCK_N]`` dequantized tile multiplied with 32 columns of ``x``.

Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton.utils import KernelLaunch, is_interpreted, round_bf16

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_fp16(ptrs, mask):
    """The fp16 value stored little-endian at byte pointers ``ptrs``, as float32."""
    lo = tl.load(ptrs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gemm_gguf_kernel(
    x_ptr,  # [M, K] float32 / float16 / bfloat16
    blocks_ptr,  # [N, K / 32 * BLOCK_BYTES] uint8, each weight row's ggml blocks
    out_ptr,  # [M, N] float32 / float16 / bfloat16
    M,  # int, rows of x
    N,  # int, output columns (weight rows)
    K,  # int, a multiple of 32 * BLOCKS
    stride_xm: tl.int64,
    stride_xk: tl.int64,
    stride_bn: tl.int64,
    stride_om: tl.int64,
    stride_on: tl.int64,
    GGML_TYPE: tl.constexpr,  # 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)
    BLOCK_BYTES: tl.constexpr,  # 18, 20 or 34: the format's block_bytes
    F32_OPERANDS: tl.constexpr,  # multiply in float32 (exact products): float32 x or output
    EMULATE_BF16: tl.constexpr,  # bf16 operands or output under the interpreter (see below)
    BLOCK_M: tl.constexpr,  # power of two >= 16
    BLOCK_N: tl.constexpr,  # power of two >= 16
    BLOCKS: tl.constexpr,  # 1 or 2 ggml blocks per step (16 BLOCKS >= 16 for tl.dot)
):
    """Program (tile of M, tile of N): see the module docstring.

    EMULATE_BF16: the interpreter's tl.dot multiplies the raw uint16 bit patterns of bf16
    operands (triton-lang/triton#11584, as in ``attention_kernels.py``) and its fp32 -> bf16
    casts truncate, so there bf16 operands stay float32, rounded to bf16 values as the GPU
    rounds them (:func:`round_bf16`), and so is a bf16 output before its store.
    """
    HALF: tl.constexpr = 16 * BLOCKS
    QS: tl.constexpr = 4 if GGML_TYPE == 3 else 2  # the quants' offset in a block
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_h = tl.arange(0, HALF).to(tl.int64)  # row i of a half tile: element i % 16 (+ 16) of block i // 16
    col_lo = offs_h // 16 * 32 + offs_h % 16  # [HALF]
    x_lo_ptrs = x_ptr + offs_m[:, None] * stride_xm + col_lo[None, :] * stride_xk  # [BLOCK_M, HALF]
    block_ptrs = blocks_ptr + offs_n[None, :] * stride_bn + (offs_h // 16 * BLOCK_BYTES)[:, None]  # [HALF, BLOCK_N]
    q_ptrs = block_ptrs + QS + (offs_h % 16)[:, None]  # the byte of element i % 16
    w_mask = n_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32 * BLOCKS):
        step = k0 // 32 * BLOCK_BYTES  # bytes to this step's first block
        x_lo = tl.load(x_lo_ptrs + k0 * stride_xk, mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_lo_ptrs + (k0 + 16) * stride_xk, mask=m_mask[:, None], other=0.0)
        d = _load_fp16(block_ptrs + step, w_mask)  # [HALF, BLOCK_N] float32, each block's d
        if GGML_TYPE == 8:
            q_lo = tl.load(q_ptrs + step, mask=w_mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            q_hi = tl.load(q_ptrs + step + 16, mask=w_mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w_lo = d * q_lo
            w_hi = d * q_hi
        else:
            b = tl.load(q_ptrs + step, mask=w_mask, other=0)  # [HALF, BLOCK_N] uint8
            q_lo = (b & 15).to(tl.float32)
            q_hi = (b >> 4).to(tl.float32)
            if GGML_TYPE == 3:
                m = _load_fp16(block_ptrs + step + 2, w_mask)
                w_lo = d * q_lo + m
                w_hi = d * q_hi + m
            else:
                w_lo = d * (q_lo - 8.0)
                w_hi = d * (q_hi - 8.0)
        if F32_OPERANDS:
            acc += tl.dot(x_lo.to(tl.float32), w_lo, input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), w_hi, input_precision="ieee")
        elif EMULATE_BF16:
            acc += tl.dot(x_lo.to(tl.float32), round_bf16(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), round_bf16(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo.to(x_ptr.dtype.element_ty))
            acc += tl.dot(x_hi, w_hi.to(x_ptr.dtype.element_ty))
    if EMULATE_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16(acc)  # then the store's truncation is exact
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])



@triton.jit
def _gemm_gguf_k_kernel(
    x_ptr,  # [M, K] float32 / float16 / bfloat16
    blocks_ptr,  # [N, K / 256 * BLOCK_BYTES] uint8, each weight row's super-blocks
    out_ptr,  # [M, N] float32 / float16 / bfloat16
    M,  # int, rows of x
    N,  # int, output columns (weight rows)
    K,  # int, a multiple of 256
    stride_xm: tl.int64,
    stride_xk: tl.int64,
    stride_bn: tl.int64,
    stride_om: tl.int64,
    stride_on: tl.int64,
    GGML_TYPE: tl.constexpr,  # 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)
    BLOCK_BYTES: tl.constexpr,  # 144, 176 or 210: the format's block_bytes
    F32_OPERANDS: tl.constexpr,  # as _gemm_gguf_kernel
    EMULATE_BF16: tl.constexpr,  # as _gemm_gguf_kernel
    BLOCK_M: tl.constexpr,  # power of two >= 16
    BLOCK_N: tl.constexpr,  # power of two >= 16
):
    """Program (tile of M, tile of N): see the module docstring; one sub-block of 32 per step."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_e = tl.arange(0, 32).to(tl.int64)  # element of the sub-block
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_mask = n_mask[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_e[None, :] * stride_xk  # [BLOCK_M, 32]
    rows = blocks_ptr + offs_n * stride_bn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_ptrs + k0 * stride_xk, mask=m_mask[:, None], other=0.0)  # [BLOCK_M, 32]
        sb = rows + k0 // 256 * BLOCK_BYTES  # [BLOCK_N] each row's super-block
        j = k0 // 32 % 8  # the sub-block
        e_ptrs = sb[None, :] + offs_e[:, None]  # [32, BLOCK_N]
        if GGML_TYPE == 14:
            d = _load_fp16(sb + 208, n_mask)  # [BLOCK_N]
            ql = tl.load(e_ptrs + (64 * (j // 4) + 32 * (j % 2)), mask=w_mask, other=0).to(tl.int32)
            qh = tl.load(e_ptrs + (128 + 32 * (j // 4)), mask=w_mask, other=0).to(tl.int32)
            q = ((ql >> (4 * (j % 4 // 2))) & 15) | (((qh >> (2 * (j % 4))) & 3) << 4)  # [32, BLOCK_N] 0..63
            sc = tl.load(sb[None, :] + 192 + 2 * j + offs_e[:, None] // 16, mask=w_mask, other=0)
            scale = d[None, :] * sc.to(tl.int8, bitcast=True).to(tl.float32)  # [32, BLOCK_N]
            w = scale * (q - 32).to(tl.float32)
        else:
            jl = j % 4
            a = tl.load(sb + 4 + jl, mask=n_mask, other=0).to(tl.int32)  # scale bytes jl, jl + 4, jl + 8
            b = tl.load(sb + 8 + jl, mask=n_mask, other=0).to(tl.int32)
            c = tl.load(sb + 12 + jl, mask=n_mask, other=0).to(tl.int32)
            sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 6) << 4))  # [BLOCK_N]
            mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
            d = _load_fp16(sb, n_mask) * sc.to(tl.float32)
            dm = _load_fp16(sb + 2, n_mask) * mn.to(tl.float32)
            QS: tl.constexpr = 48 if GGML_TYPE == 13 else 16  # the low nibbles' offset
            qs = tl.load(e_ptrs + (QS + 32 * (j // 2)), mask=w_mask, other=0).to(tl.int32)
            q = (qs >> (4 * (j % 2))) & 15  # [32, BLOCK_N]
            if GGML_TYPE == 13:
                qh = tl.load(e_ptrs + 16, mask=w_mask, other=0).to(tl.int32)
                q = q | (((qh >> j) & 1) << 4)
            w = d[None, :] * q.to(tl.float32) - dm[None, :]
        if F32_OPERANDS:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        elif EMULATE_BF16:
            acc += tl.dot(x.to(tl.float32), round_bf16(w), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    if EMULATE_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16(acc)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def plan_gemm_gguf(x: torch.Tensor, blocks: torch.Tensor, fmt: Any, out: torch.Tensor,
                   block_m: int | None = None, block_n: int = 64) -> KernelLaunch:
    """The launch of ``out = x @ dequantize(blocks).T`` (:func:`gemm_gguf`'s arguments, ``out``
    ``[M, N]``). ``block_m``: rows per program (default 16 up to 16 rows, else 64)."""
    m, k = x.shape
    n = blocks.shape[0]
    assert fmt.kernel_type is not None, fmt
    assert x.dtype in _DTYPES and out.dtype in _DTYPES, (x.dtype, out.dtype)
    assert k % fmt.block_size == 0, k
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.stride(1) == 1
    assert blocks.shape[1] == fmt.row_bytes(k), (tuple(blocks.shape), k)
    assert tuple(out.shape) == (m, n)
    if block_m is None:
        block_m = 16 if m <= 16 else 64
    f32 = torch.float32 in (x.dtype, out.dtype)
    kernel = _gemm_gguf_k_kernel if fmt.k_quant else _gemm_gguf_kernel
    emulate = torch.bfloat16 in (x.dtype, out.dtype) and is_interpreted(kernel)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    per_step = {} if fmt.k_quant else {"BLOCKS": 2 if k % 64 == 0 else 1}
    return KernelLaunch(kernel, grid, dict(
        x_ptr=x, blocks_ptr=blocks, out_ptr=out, M=m, N=n, K=k, stride_xm=x.stride(0), stride_xk=x.stride(1),
        stride_bn=blocks.stride(0), stride_om=out.stride(0), stride_on=out.stride(1), GGML_TYPE=fmt.kernel_type,
        BLOCK_BYTES=fmt.block_bytes, F32_OPERANDS=f32, EMULATE_BF16=emulate, BLOCK_M=block_m,
        BLOCK_N=block_n, **per_step, num_warps=4, num_stages=2,
    ))


def gemm_gguf(
    x: torch.Tensor,  # [M, K] float32 / float16 / bfloat16
    blocks: torch.Tensor,  # [N, K / block_size * block_bytes] uint8: each weight row's GGUF blocks
    fmt: Any,  # the blocks' BlockFormat (ggml_type, block_size, block_bytes, kernel_type, k_quant, row_bytes)
    out_dtype: torch.dtype | None = None,  # default x's dtype
) -> torch.Tensor:  # [M, N] out_dtype
    """``F.linear(x, dequantize(blocks))`` with the weight kept quantized (float32 sums, one
    rounding per output): :func:`kernels.cpu.quant_ops.gemm_gguf`'s contract on the GPU (or the interpreter)."""
    out = torch.empty((x.shape[0], blocks.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    plan_gemm_gguf(x, blocks, fmt, out)()
    return out
