"""The GGUF block formats this engine keeps quantized: one registry (:data:`FORMATS`, by ggml type
id) that every consumer reads instead of naming a ggml type itself — dequantization
(:func:`dequantize`), the 16-row interleave (``r16.py``), the linear and MoE methods, the GGUF loader
(``model_loader/``), the Triton kernels (``kernels/triton/gemm_gguf.py``) and the C bindings
(``kernels/cpu/quant_ops.py``). ``kernels/`` imports only ``shared/`` and ``kernels/``: the
kernels are handed a :class:`BlockFormat` by their caller and read its fields.

A GGUF quantized tensor ``[N, K]`` (rows = output features) is stored row by row, each row as
blocks of consecutive input elements: ``K / 32`` blocks of 32 (ggml's ``block_q4_0`` /
``block_q4_1`` / ``block_q8_0``) or ``K / 256`` super-blocks of 256 (the K-quants; their
arithmetic is that of gguf-py's ``quants.py``). The byte layouts are checked against
``gguf.quants.dequantize`` in ``tests/executor/test_gguf.py``:

========  =====  ===========================================================  ===============
type      bytes  layout                                                       value
========  =====  ===========================================================  ===============
Q4_0      18     fp16 ``d``, 16 bytes: element j in the low nibble of byte j,  ``d * (q - 8)``
                 element j + 16 in its high nibble
Q4_1      20     fp16 ``d``, fp16 ``m``, 16 bytes of nibbles as Q4_0           ``d * q + m``
Q8_0      34     fp16 ``d``, 32 int8                                           ``d * q``
Q4_K      144    fp16 ``d``, fp16 ``dmin``, 12 bytes: 6-bit ``sc[8]``, ``m[8]``  ``d sc[j] q - dmin m[j]``
                 (sub-block ``j`` of 32), 128 bytes: sub-block ``2 i`` in the
                 low nibbles of bytes ``32 i .. 32 i + 31``, ``2 i + 1`` high
Q5_K      176    as Q4_K with 32 bytes ``qh`` before the nibbles: bit ``j`` of  as Q4_K, q < 32
                 ``qh[e]`` is bit 4 of element ``e`` of sub-block ``j``
Q6_K      210    128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2),       ``d sc[i/16] (q - 32)``
                 16 int8 ``sc``, fp16 ``d``; element ``128 g + 32 s + e``:
                 ``ql[64 g + 32 (s%2) + e] >> 4 (s/2)``, ``qh[32 g + e] >> 2 s``
========  =====  ===========================================================  ===============

Any other type of a file (F32, F16, BF16, Q5_0, ...) is not kept: the loader dequantizes it
into the model's dtype with gguf-py (:func:`kept` gives ``None``).

:func:`dequantize` gives the blocks' values in torch: the reference the C and Triton kernels
are tested against, and the methods' dequantize-then-``F.linear`` path (long prefills on CPU, a
device without a kernel), computed as gguf-py's ``quants.py`` does (the same products in the
same order, so float32 results are equal). A new format is added here (its record and its
arithmetic) and in the kernels (``kernels/cpu/csrc/cpu_gguf_*.c`` with an ABI bump,
``kernels/triton/gemm_gguf.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    """A GGML quantization type: its name, its id in the GGUF file (``gguf.GGMLQuantizationType``),
    elements and bytes per block, and what the kernels need of it.

    ``kernel_type``: the type code of the C kernels (``GGUF_Q4_0`` ... in
    ``kernels/cpu/csrc/pagedllm_abi.h``) and the Triton kernels' ``GGML_TYPE`` constexpr (ggml's
    id); ``None``: no kernel reads it (a format only dequantized). ``fp16_fields``: the byte
    offsets of the block's fp16 fields (``d``; Q4_1's ``m``; the K-quants' ``dmin``; Q6_K's ``d``
    last), which the 16-row interleave gathers first. ``int8_quants``: the quants are int8 (Q8_0),
    stored XOR 0x80 in the interleaved layout. ``r16``: has the 16-row interleaved layout
    (``r16.py``; ``cpu_gguf_r16.c``, ``cpu_gguf_r16k.c``).
    """

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int
    kernel_type: int | None = None
    fp16_fields: tuple[int, ...] = ()
    int8_quants: bool = False
    r16: bool = False

    @property
    def k_quant(self) -> bool:
        """Super-blocks of 256 elements (Q4_K, Q5_K, Q6_K): the Triton K-quant kernel."""
        return self.block_size == 256

    def row_bytes(self, elements: int) -> int:
        """Bytes of ``elements`` consecutive elements of a row (a multiple of ``block_size``)."""
        return elements // self.block_size * self.block_bytes


Q4_0 = BlockFormat("Q4_0", 2, 32, 18, kernel_type=2, fp16_fields=(0,), r16=True)
Q4_1 = BlockFormat("Q4_1", 3, 32, 20, kernel_type=3, fp16_fields=(0, 2), r16=True)
Q8_0 = BlockFormat("Q8_0", 8, 32, 34, kernel_type=8, fp16_fields=(0,), int8_quants=True, r16=True)
Q4_K = BlockFormat("Q4_K", 12, 256, 144, kernel_type=12, fp16_fields=(0, 2), r16=True)
Q5_K = BlockFormat("Q5_K", 13, 256, 176, kernel_type=13, fp16_fields=(0, 2), r16=True)
Q6_K = BlockFormat("Q6_K", 14, 256, 210, kernel_type=14, fp16_fields=(208,), r16=True)
#: ggml type id -> the formats kept quantized (every one with a C, Triton and torch path)
FORMATS: dict[int, BlockFormat] = {f.ggml_type: f for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)}


def kept(ggml_type: int) -> BlockFormat | None:
    """The format of a file tensor of ``ggml_type`` when it is kept quantized, else ``None``."""
    return FORMATS.get(int(ggml_type))


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
