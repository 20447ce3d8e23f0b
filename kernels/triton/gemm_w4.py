"""Triton weight-only int4 group-quantized matmul: the CUDA side of :func:`kernels.cpu.quant_ops.gemm_w4`.

``y = x @ W.T`` for ``W[n, k] = q[n, k] * scales[n, k // G] - szeros[n, k // G]``, the weight in
the internal layout of ``services/executor/layers/quantization/int4.py`` (:class:`PackedInt4`):

- ``qweight`` uint8 ``[N, K/2]``: per 32 input columns 16 bytes, byte ``j`` holding column ``j``
  in its low nibble and column ``j + 16`` in its high one;
- ``scales`` and ``szeros`` float32 ``[N, K/G]``.

A program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``. Each step over ``K`` takes
``BLOCK_K`` columns (a divisor of ``G``, so one scale per output column and step): it loads the
``BLOCK_K / 2`` bytes of each weight row once, splits them into the low-nibble columns and the
high-nibble ones, dequantizes both in registers (float32, then the activation dtype, as the torch
path ``F.linear(x, dequantize(x.dtype))`` rounds them) and multiplies each with its half of the
``x`` columns (two ``tl.dot``), accumulating in float32.

Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.utils import KernelLaunch, is_interpreted, round_bf16


@triton.jit
def _gemm_w4_kernel(
    x_ptr,  # [M, K] float32 / float16 / bfloat16
    qweight_ptr,  # [N, K/2] uint8, per 32 columns: column j low nibble of byte j, j + 16 high
    scales_ptr,  # [N, K/G] float32
    szeros_ptr,  # [N, K/G] float32, zero point * scale
    out_ptr,  # [M, N] x's dtype
    M,  # int, rows of x
    N,  # int, output columns
    K,  # int, a multiple of BLOCK_K
    stride_xm: tl.int64,
    stride_xk: tl.int64,
    stride_qn: tl.int64,
    stride_sn: tl.int64,
    stride_om: tl.int64,
    stride_on: tl.int64,
    GROUP_SIZE: tl.constexpr,  # G, a multiple of BLOCK_K
    IEEE_FP32: tl.constexpr,  # float32 inputs: exact fp32 products (no TF32)
    EMULATE_BF16: tl.constexpr,  # True only for bf16 under the interpreter (see below)
    BLOCK_M: tl.constexpr,  # power of two >= 16
    BLOCK_N: tl.constexpr,  # power of two >= 16
    BLOCK_K: tl.constexpr,  # 32 or 64: a multiple of 32 dividing G (BLOCK_K / 2 >= 16 for tl.dot)
):
    """Program (tile of M, tile of N): see the module docstring.

    EMULATE_BF16: the interpreter's tl.dot multiplies the raw uint16 bit patterns of bf16
    operands (triton-lang/triton#11584, as in ``attention_kernels.py``) and its fp32 -> bf16
    casts truncate, so there the operands stay float32, rounded to bf16 values as the GPU
    rounds them (:func:`round_bf16`): the same products its bf16 MMA accumulates in fp32.
    """
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_b = tl.arange(0, HALF).to(tl.int64)  # byte i of a step: columns col_lo[i] and col_lo[i] + 16
    col_lo = offs_b // 16 * 32 + offs_b % 16  # [HALF]
    x_lo_ptrs = x_ptr + offs_m[:, None] * stride_xm + col_lo[None, :] * stride_xk  # [BLOCK_M, HALF]
    q_ptrs = qweight_ptr + offs_n[None, :] * stride_qn + offs_b[:, None]  # [HALF, BLOCK_N]
    s_row = offs_n * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_lo = tl.load(x_lo_ptrs + k0 * stride_xk, mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_lo_ptrs + (k0 + 16) * stride_xk, mask=m_mask[:, None], other=0.0)
        b = tl.load(q_ptrs + k0 // 2, mask=n_mask[None, :], other=0)  # [HALF, BLOCK_N] uint8
        g = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + s_row + g, mask=n_mask, other=0.0)[None, :]  # [1, BLOCK_N]
        sz = tl.load(szeros_ptr + s_row + g, mask=n_mask, other=0.0)[None, :]
        w_lo = (b & 15).to(tl.float32) * s - sz  # [HALF, BLOCK_N] float32
        w_hi = (b >> 4).to(tl.float32) * s - sz
        if EMULATE_BF16:
            acc += tl.dot(x_lo.to(tl.float32), round_bf16(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), round_bf16(w_hi), input_precision="ieee")
        elif IEEE_FP32:
            acc += tl.dot(x_lo, w_lo, input_precision="ieee")
            acc += tl.dot(x_hi, w_hi, input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo.to(x_ptr.dtype.element_ty))
            acc += tl.dot(x_hi, w_hi.to(x_ptr.dtype.element_ty))
    if EMULATE_BF16:
        acc = round_bf16(acc)  # then the store's truncation is exact
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def plan_gemm_w4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, szeros: torch.Tensor,
                 group_size: int, out: torch.Tensor, block_m: int | None = None, block_n: int = 64) -> KernelLaunch:
    """The launch of ``out = x @ W.T`` (:func:`gemm_w4`'s arguments; ``out`` ``[M, N]`` x's dtype).

    ``block_m``: rows per program (default 16 up to 16 rows, else 64)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert k % 32 == 0 and group_size % 32 == 0 and k % group_size == 0, (k, group_size)
    assert qweight.dtype == torch.uint8 and tuple(qweight.shape) == (n, k // 2) and qweight.stride(1) == 1
    for t in (scales, szeros):
        assert t.dtype == torch.float32 and tuple(t.shape) == (n, k // group_size) and t.stride(1) == 1
    assert scales.stride(0) == szeros.stride(0)
    assert out.dtype == x.dtype and tuple(out.shape) == (m, n)
    if block_m is None:
        block_m = 16 if m <= 16 else 64
    block_k = 64 if group_size % 64 == 0 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    return KernelLaunch(_gemm_w4_kernel, grid, dict(
        x_ptr=x, qweight_ptr=qweight, scales_ptr=scales, szeros_ptr=szeros, out_ptr=out, M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_qn=qweight.stride(0), stride_sn=scales.stride(0),
        stride_om=out.stride(0), stride_on=out.stride(1), GROUP_SIZE=group_size,
        IEEE_FP32=x.dtype == torch.float32,
        EMULATE_BF16=x.dtype == torch.bfloat16 and is_interpreted(_gemm_w4_kernel),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2,
    ))


def gemm_w4(
    x: torch.Tensor,  # [M, K] float32 / float16 / bfloat16
    qweight: torch.Tensor,  # [N, K/2] uint8: per 32 columns 16 bytes, column j low nibble, j + 16 high
    scales: torch.Tensor,  # [N, K/G] float32
    szeros: torch.Tensor,  # [N, K/G] float32, zero point * scale
    group_size: int,  # G, a multiple of 32 dividing K
) -> torch.Tensor:  # [M, N] x's dtype
    """``x @ W.T`` for ``W[n, k] = q[n, k] * scales[n, k // G] - szeros[n, k // G]`` (float32 sums),
    the same contract as :func:`kernels.cpu.quant_ops.gemm_w4` on the GPU (or the interpreter)."""
    out = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)
    plan_gemm_w4(x, qweight, scales, szeros, group_size, out)()
    return out
