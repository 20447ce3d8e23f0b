"""GGUF blocks -> their values in torch: the reference that the C and Triton kernels are tested
against, and the dequantize-then-``F.linear`` path of the methods (long prefills on CPU, a device
without a kernel). The layouts are ``formats.py``'s table; the arithmetic is gguf-py's
``quants.py`` (the same products in the same order, so float32 results are equal).
"""

from __future__ import annotations

import torch

from services.executor.layers.quantization.gguf.formats import Q4_1, Q5_K, Q6_K, Q8_0, BlockFormat


def _fp16(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [..., 1] float32
    return b.contiguous().view(torch.float16).float()


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 scale bytes ``[..., 12]`` -> 6-bit scales and mins ``[..., 8]`` (int64)."""
    s = s.long()
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc, mn


def _dequantize_k(b: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """K-quant super-blocks ``[N, K / 256, block_bytes]`` -> ``[N, K / 256, 256]`` float32 (gguf-py's
    ``Q4_K`` / ``Q5_K`` / ``Q6_K.dequantize_blocks``: the same products in the same order)."""
    shape = b.shape[:-1]
    if fmt == Q6_K:
        ql = b[..., 0:128].reshape(*shape, 2, 1, 64)
        ql = torch.cat((ql & 15, ql >> 4), dim=-2).reshape(*shape, 8, 32)  # [.., 8, 32]: sub-block 4 g + s
        qh = b[..., 128:192].reshape(*shape, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(*shape, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(*shape, 16, 16).float()
        scale = _fp16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()  # [.., 16]
        return (scale[..., None] * q).reshape(*shape, 256)
    sc, mn = _k_scale_min(b[..., 4:16])
    d = (_fp16(b[..., 0:2]) * sc.float())[..., None]  # [.., 8, 1]
    dm = (_fp16(b[..., 2:4]) * mn.float())[..., None]
    qs = b[..., 48:176] if fmt == Q5_K else b[..., 16:144]
    qs = qs.reshape(*shape, 4, 1, 32)
    q = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(*shape, 8, 32)  # sub-block 2 i + h
    if fmt == Q5_K:
        qh = b[..., 16:48].reshape(*shape, 1, 32)
        q = q | torch.cat([((qh >> j) & 1) << 4 for j in range(8)], dim=-2)
    return (d * q.float() - dm).reshape(*shape, 256)


def dequantize(
    blocks: torch.Tensor,  # [N, K / block_size * block_bytes] uint8, whole rows of blocks
    fmt: BlockFormat,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K] dtype
    """The weight of GGUF blocks, computed in float32 as ``gguf.quants.dequantize`` does (the
    same products and sums, so float32 results are equal), then cast to ``dtype``."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, fmt.block_bytes)  # [N, K / block_size, block_bytes]
    if fmt.k_quant:
        return _dequantize_k(b, fmt).reshape(rows, -1).to(dtype)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    if fmt == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [N, K / 32, 32]
        w = d * q
    else:
        qs = b[..., 4:] if fmt == Q4_1 else b[..., 2:]  # [N, K / 32, 16]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [N, K / 32, 32]: elements 0-15, 16-31
        if fmt == Q4_1:
            w = d * q.float() + b[..., 2:4].contiguous().view(torch.float16).float()
        else:
            w = d * (q.to(torch.int8) - 8).float()
    return w.reshape(rows, -1).to(dtype)
