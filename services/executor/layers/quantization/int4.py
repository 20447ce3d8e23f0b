"""The one int4 group-quantized weight that GPTQ, AWQ and compressed-tensors W4A16 become at load,
its internal layout, and the matmul over it (the C kernel on CPU, the Triton kernel
``kernels/triton/gemm_w4.py`` on CUDA, else dequantize + ``F.linear``).

Each format unpacks its checkpoint tensors into :class:`Int4Weights` (integers 0..15, a zero
point and a scale per group, the group of each input column), so that
``w[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]``. :func:`pack_int4` lays that
out once for the kernel (:class:`PackedInt4`):

- input columns sorted by group when ``g_idx`` is not already ``k // group_size`` (GPTQ's
  ``desc_act``): ``perm`` then gathers the activations' columns in that order;
- ``qweight`` uint8 ``[N, K/2]``: per 32 input columns 16 bytes, byte ``j`` holding column
  ``j`` in its low nibble and column ``j + 16`` in its high one (a 16-byte load widens to two
  16-lane vectors with one mask and one shift);
- ``scales`` and ``szeros = zeros * scales`` float32 ``[N, K/G]``, so that a group's sum is
  ``scale * dot(q, x) - szero * sum(x)``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import quant_ops
from services.executor.layers.quantization.base import QuantizedLinearMethod


@dataclass
class Int4Weights:
    """An unpacked int4 weight of ``N`` outputs and ``K`` inputs."""

    q: torch.Tensor  # [N, K] uint8, 0..15
    zeros: torch.Tensor  # [N, num_groups] float32, in q's units
    scales: torch.Tensor  # [N, num_groups] float32
    g_idx: torch.Tensor  # [K] int64, the group of each input column

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        g = self.g_idx
        return ((self.q.float() - self.zeros[:, g]) * self.scales[:, g]).to(dtype)


@dataclass
class PackedInt4:
    """:class:`Int4Weights` in the kernel's layout (module docstring)."""

    qweight: torch.Tensor  # [N, K/2] uint8
    scales: torch.Tensor  # [N, K/G] float32
    szeros: torch.Tensor  # [N, K/G] float32, zeros * scales
    group_size: int  # G
    perm: torch.Tensor | None  # [K] int64: the input columns in group order, or None (already)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K] in perm's order
        n, half = self.qweight.shape
        blocks = self.qweight.view(n, half // 16, 16)
        q = torch.cat((blocks & 15, blocks >> 4), dim=2).view(n, 2 * half).float()  # [N, K]
        s = self.scales.repeat_interleave(self.group_size, dim=1)
        sz = self.szeros.repeat_interleave(self.group_size, dim=1)
        return (q * s - sz).to(dtype)


def pack_int4(w: Int4Weights) -> PackedInt4 | None:
    """:class:`Int4Weights` in the kernel's layout, or None where it does not fit (K not a
    multiple of 32, groups of unequal sizes or not a multiple of 32 columns once sorted)."""
    n, k = w.q.shape
    counts = torch.bincount(w.g_idx, minlength=w.scales.shape[1])
    group = int(counts[0]) if counts.numel() else 0
    if k % 32 or group == 0 or group % 32 or bool((counts != group).any()):
        return None
    in_order = bool((w.g_idx == torch.arange(k, device=w.g_idx.device) // group).all())
    perm = None if in_order else torch.argsort(w.g_idx, stable=True)
    q = w.q if perm is None else w.q[:, perm]  # [N, K] in group order
    blocks = q.reshape(n, k // 32, 2, 16)  # [N, blocks, low | high, 16]
    qweight = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scales = w.scales.to(torch.float32, copy=True).contiguous()  # a copy: the parameters are freed next
    return PackedInt4(qweight, scales, (w.zeros * w.scales).float().contiguous(), group, perm)


def int4_matmul(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[T, K]`` -> ``[T, N]`` in ``x``'s dtype: the C kernel
    (:func:`kernels.cpu.quant_ops.gemm_w4`) where it applies, the Triton kernel on CUDA
    (:func:`kernels.triton.gemm_w4.gemm_w4`), else dequantize + ``F.linear``."""
    if packed.perm is not None:
        x = x.index_select(1, packed.perm)  # [T, K] in group order
    if quant_ops.gemm_w4_supports(x):
        out = quant_ops.gemm_w4(x, packed.qweight, packed.scales, packed.szeros, packed.group_size)
        return out if bias is None else out.add_(bias)
    if x.is_cuda and x.dim() == 2 and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        from kernels.triton.gemm_w4 import gemm_w4  # imports triton: only where it runs

        out = gemm_w4(x, packed.qweight, packed.scales, packed.szeros, packed.group_size)
        return out if bias is None else out.add_(bias)
    return F.linear(x, packed.dequantize(x.dtype), bias)


class Int4LinearMethod(QuantizedLinearMethod):
    """An int4 format's linear method: :meth:`unpack` its checkpoint tensors into
    :class:`Int4Weights`; after loading they are packed once into :class:`PackedInt4` (the
    checkpoint tensors freed), or, where the layout does not fit, dequantized at each call."""

    @abstractmethod
    def unpack(self, layer: nn.Module) -> Int4Weights:
        """The layer's loaded checkpoint tensors as :class:`Int4Weights` (this rank's part)."""

    def derive(self, layer: nn.Module) -> PackedInt4 | None:
        return pack_int4(self.unpack(layer))

    def apply_derived(self, layer: nn.Module, derived: PackedInt4, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return int4_matmul(x, derived, bias)

    def apply_checkpoint(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.unpack(layer).dequantize(x.dtype), bias)


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., P]`` int32 -> ``[..., P, 32/bits]`` int32: the values of each, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
