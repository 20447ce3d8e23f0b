"""Triton ``reshape_and_cache``: scatter the new tokens' K and V into the paged KV cache.

Same contract as :func:`kernels.reference.reshape_and_cache` (the oracle in the tests):
token ``t`` is written to slot ``slot_mapping[t] = block_id * block_size + offset_in_block``
of ``key_cache`` / ``value_cache`` (layout ``[num_blocks, block_size, num_kv_heads, head_dim]``);
a negative slot means the token is skipped (padding, vLLM convention). One program per token
copies its ``[num_kv_heads, head_dim]`` tile of K and of V (vLLM's ``reshape_and_cache_flash``).

Nothing here queries CUDA at import time; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.utils import KernelLaunch, is_interpreted

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T] int64 (or int32); < 0 means skip
    num_kv_heads,  # int
    head_dim,  # int
    block_size,  # int, tokens per cache block
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_k_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so accesses vectorise)
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_v_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so accesses vectorise)
    stride_kc_blk: tl.int64,
    stride_kc_tok: tl.int64,
    stride_kc_head: tl.int64,
    stride_kc_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so accesses vectorise)
    stride_vc_blk: tl.int64,
    stride_vc_tok: tl.int64,
    stride_vc_head: tl.int64,
    stride_vc_d: tl.constexpr,  # innermost stride, usually 1 (constexpr so accesses vectorise)
    BLOCK_H: tl.constexpr,  # power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # power of two >= head_dim
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :] * stride_k_d,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_d,
        mask=mask,
    )
    kc = key_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok
    vc = value_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok
    tl.store(
        kc + offs_h[:, None] * stride_kc_head + offs_d[None, :] * stride_kc_d,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + offs_h[:, None] * stride_vc_head + offs_d[None, :] * stride_vc_d,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def plan_reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); a negative slot means skip the token
) -> list[KernelLaunch]:
    """Check the arguments and plan the launch (none for T == 0); launch nothing."""
    assert key.dim() == 3 and value.shape == key.shape, (key.shape, value.shape)
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, (key_cache.shape, value_cache.shape)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (key_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert slot_mapping.dtype in (torch.int64, torch.int32), slot_mapping.dtype
    assert key.dtype in _DTYPES and value.dtype == key.dtype, (key.dtype, value.dtype)
    assert key_cache.dtype in _DTYPES and value_cache.dtype == key_cache.dtype, key_cache.dtype
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    assert len(devices) == 1, devices
    if num_tokens == 0:
        return []
    head_dim_pad = triton.next_power_of_2(head_dim)
    kwargs = dict(
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=key_cache.shape[1],
        stride_k_tok=key.stride(0),
        stride_k_head=key.stride(1),
        stride_k_d=key.stride(2),
        stride_v_tok=value.stride(0),
        stride_v_head=value.stride(1),
        stride_v_d=value.stride(2),
        stride_kc_blk=key_cache.stride(0),
        stride_kc_tok=key_cache.stride(1),
        stride_kc_head=key_cache.stride(2),
        stride_kc_d=key_cache.stride(3),
        stride_vc_blk=value_cache.stride(0),
        stride_vc_tok=value_cache.stride(1),
        stride_vc_head=value_cache.stride(2),
        stride_vc_d=value_cache.stride(3),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=head_dim_pad,
        num_warps=4 if num_kv_heads * head_dim_pad <= 2048 else 8,
    )
    return [KernelLaunch(_reshape_and_cache_kernel, (num_tokens,), kwargs)]


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); a negative slot means skip the token
) -> None:
    """Write ``key``/``value`` rows into the paged caches at ``slot_mapping`` (in place).

    Any strides are accepted (e.g. K/V as views of a fused QKV projection); values are cast to
    the cache dtype (fp32/fp16/bf16, round-to-nearest-even on the GPU; the CPU interpreter
    truncates fp32 -> bf16). Non-negative slots must be unique and ``< num_blocks * block_size``
    (not checked on the device: that would need a host sync).
    """
    if key.device.type == "cpu" and not is_interpreted(_reshape_and_cache_kernel):
        raise RuntimeError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing triton"
        )
    for launch in plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        launch()
