"""Triton fused mixture-of-experts: a grouped GEMM over the tokens sorted by expert.

Same contract as :func:`services.executor.layers.fused_moe.fused_moe_reference` (the oracle in
``tests/kernels/test_fused_moe.py``). The ``T * K`` (token, expert) pairs of a step are
grouped by expert and each expert's group padded to a multiple of ``BLOCK_M``
(:func:`moe_align_block_size`), so every ``BLOCK_M`` rows of the sorted order belong to one
expert; a program multiplies one such block of rows by one ``BLOCK_N`` tile of that expert's
weight, reading the token rows through the sorted pair ids (no gathered copy of the input)
and writing each result row to its pair's row of the output. This is the grouped-GEMM scheme
of MegaBlocks (Gale et al. 2022) and vLLM's ``fused_moe``:

1. ``inter [T K, 2 I] = x[pair // K] @ w13[e]^T`` (gate | up);
2. ``act = silu(gate) * up`` (torch);
3. ``out [T K, hidden] = weight[pair] * (act[pair] @ w2[e]^T)``;
4. ``y [T, hidden] = out.view(T, K, hidden).sum(1)``.

Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton.utils import KernelLaunch, is_interpreted


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [num_a_rows, K_dim] the input rows (a token's row is read by each of its pairs)
    b_ptr,  # [E, N, K_dim] the experts' weights
    c_ptr,  # [num_pairs, N] output, one row per (token, expert) pair
    topk_weights_ptr,  # [num_pairs] routing weight of each pair (read when MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [num_padded] int32, pair ids grouped by expert; num_pairs = padding
    block_expert_ids_ptr,  # [num_padded // BLOCK_M] int32, each block's expert; -1: unused block
    N,  # int, output columns
    K_dim,  # int, the reduction length
    num_pairs,  # int, T * top_k
    top_k,  # int, pairs per a-row (pair p reads a-row p // top_k)
    stride_am: tl.int64,
    stride_ak: tl.int64,
    stride_be: tl.int64,
    stride_bn: tl.int64,
    stride_bk: tl.int64,
    stride_cm: tl.int64,
    stride_cn: tl.int64,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each output row by its pair's weight
    IEEE_FP32: tl.constexpr,  # float32 inputs: exact fp32 products (no TF32)
    F32_OPERANDS: tl.constexpr,  # True only for bf16 under the interpreter (see below)
    BLOCK_M: tl.constexpr,  # power of two >= 16: rows of a block (the padding unit)
    BLOCK_N: tl.constexpr,  # power of two >= 16
    BLOCK_K: tl.constexpr,  # power of two >= 16
):
    """Program (block of sorted pairs, tile of N): see the module docstring.

    F32_OPERANDS: the interpreter's tl.dot multiplies the raw uint16 bit patterns of bf16
    operands (triton-lang/triton#11584, as in ``attention_kernels.py``), so there they are
    upcast to fp32 first: exact, the same products the GPU's bf16 MMA accumulates in fp32.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    row_mask = pair_ids < num_pairs
    a_rows = pair_ids // top_k
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_dim, BLOCK_K):
        k_mask = offs_k + k0 < K_dim
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if F32_OPERANDS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE_FP32 or F32_OPERANDS:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair_ids, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair_ids[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``p = t * K + k`` grouped by expert, each group padded to a multiple of
    ``block_m`` with the id ``T * K`` (skipped by the kernel).

    Sizes are bounded without reading the counts back (no host sync): ``T K + E (block_m - 1)``
    rows at most; blocks past the last group have expert ``-1``.

    Returns:
        ``sorted_pair_ids [num_padded]`` int32 and ``block_expert_ids [num_padded // block_m]`` int32.
    """
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    experts = flat[order]  # [P] sorted expert of each
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded  # [E] first row of each group
    start = torch.cumsum(counts, 0) - counts
    rows = padded_start[experts] + torch.arange(num_pairs, device=flat.device) - start[experts]  # [P]
    num_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pair_ids = torch.full((num_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pair_ids[rows] = order.to(torch.int32)
    block_expert_ids = torch.full((num_padded // block_m,), -1, dtype=torch.int32, device=flat.device)
    block_expert_ids[rows // block_m] = experts.to(torch.int32)
    return sorted_pair_ids, block_expert_ids


def plan_grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                      sorted_pair_ids: torch.Tensor, block_expert_ids: torch.Tensor, top_k: int,
                      mul_routed_weight: bool, block_m: int, block_n: int = 64, block_k: int = 32) -> KernelLaunch:
    """The launch of ``c[p] = (weight[p] *) a[p // top_k] @ b[e]^T`` for every sorted pair ``p``
    of expert ``e``: ``a [rows, K]``, ``b [E, N, K]``, ``c [num_pairs, N]``."""
    assert a.dim() == 2 and b.dim() == 3 and c.dim() == 2 and a.shape[1] == b.shape[2] and c.shape[1] == b.shape[1]
    assert a.dtype == b.dtype == c.dtype, (a.dtype, b.dtype, c.dtype)
    assert sorted_pair_ids.numel() == block_expert_ids.numel() * block_m
    n, k_dim = b.shape[1], b.shape[2]
    grid = (block_expert_ids.numel(), triton.cdiv(n, block_n))
    return KernelLaunch(_fused_moe_kernel, grid, dict(
        a_ptr=a, b_ptr=b, c_ptr=c, topk_weights_ptr=topk_weights, sorted_pair_ids_ptr=sorted_pair_ids,
        block_expert_ids_ptr=block_expert_ids, N=n, K_dim=k_dim, num_pairs=c.shape[0], top_k=top_k,
        stride_am=a.stride(0), stride_ak=a.stride(1), stride_be=b.stride(0), stride_bn=b.stride(1),
        stride_bk=b.stride(2), stride_cm=c.stride(0), stride_cn=c.stride(1),
        MUL_ROUTED_WEIGHT=mul_routed_weight, IEEE_FP32=a.dtype == torch.float32,
        F32_OPERANDS=a.dtype == torch.bfloat16 and is_interpreted(_fused_moe_kernel),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2,
    ))


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])`` (SwiGLU experts).

    Args:
        hidden_states: ``[T, hidden]`` float32 / float16 / bfloat16.
        w13: ``[E, 2 I, hidden]`` gate | up rows, same dtype.
        w2: ``[E, hidden, I]``, same dtype.
        topk_weights: ``[T, K]`` (any float dtype; applied in float32 to the fp32 accumulator).
        topk_ids: ``[T, K]`` integer expert ids.
        block_m: rows per block (default 16 for small steps, 64 for large).

    Returns:
        ``[T, hidden]`` in ``hidden_states``' dtype.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    num_pairs = num_tokens * top_k
    if block_m is None:
        block_m = 16 if num_pairs <= 16 * num_experts else 64
    x = hidden_states.contiguous()
    sorted_pair_ids, block_expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()  # [T K]
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)  # [T K, 2 I]
    plan_grouped_gemm(x, w13, gate_up, weights, sorted_pair_ids, block_expert_ids, top_k, False, block_m)()
    act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # [T K, I]
    out = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)  # [T K, hidden]
    plan_grouped_gemm(act, w2, out, weights, sorted_pair_ids, block_expert_ids, 1, True, block_m)()
    return out.view(num_tokens, top_k, -1).sum(dim=1)
