"""GGUF weights kept quantized: the raw blocks of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K tensors
in memory, dequantized inside the matmul (:class:`GGUFLinearMethod`).

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

A merged layer whose shards come in different formats (llama.cpp's Q4_K_M files keep some
layers' ``attn_v`` in Q6_K beside Q4_K ``attn_q`` / ``attn_k``) is served by
:class:`GGUFShardedLinearMethod`: each shard's blocks kept apart, one matmul per shard (in the
all-layers C call too: ``layers/cpu/native_layers.py``, one GGUF GEMM per shard).

The layer's ``weight`` is a uint8 parameter ``[N, K / block_size * block_bytes]``: whole rows, so
merged layers (q | k | v, gate | up) concatenate their shards' rows and rows can be permuted
without dequantizing (the loader does so before :meth:`GGUFLinearMethod.install`, which, with
the native kernels and AVX512-VNNI, may then interleave the rows by 16: ``gguf_r16``). :meth:`GGUFLinearMethod.apply`
runs the native kernel (``kernels/cpu/csrc/cpu_gguf_gemm.c``: each block dequantized in
registers, float32 sums) for up to ``NATIVE_MAX_ROWS`` rows, or any row count of bf16
activations on interleaved rows, on CPU where the native kernels are allowed (numerics: float32
activations are multiplied as they are; where the library has int8 dot products (AVX512-VNNI:
``quant_ops.gguf_int8_dot``; elsewhere they are widened to float32), bf16 activations with Q4_0 /
Q4_1 / Q8_0 weights, or weights of any type in ``gguf_r16``'s interleaved layout, are quantized to int8 per 32-element
block, ``d_a = max|x| / 127``, ``q = round-half-even(x * (127 / max|x|))``, as llama.cpp's Q8_0 /
Q8_1, and each block's (Q6_K: half-block's) integer dot product is exact, scaled in float32:
``cpu_gguf_q8.c``, ``cpu_gguf_r16.c``, ``cpu_gguf_r16k.c``; the error against the unquantized
activations is at most ``d_a / 2`` per element times ``|w|``; K-quants in the file's layout keep
float32 sums), the Triton kernel
(``kernels/triton/gemm_gguf.py``, the same contract) on CUDA, else dequantizes the whole weight
into the activation dtype and calls ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import quant_ops
from services.executor.layers import gguf_r16
from services.executor.layers.linear import LinearMethodBase


@dataclass(frozen=True)
class BlockFormat:
    """A GGML quantization type: its id in the GGUF file, elements and bytes per block."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType
    block_size: int
    block_bytes: int


Q4_0 = BlockFormat("Q4_0", 2, 32, 18)
Q4_1 = BlockFormat("Q4_1", 3, 32, 20)
Q8_0 = BlockFormat("Q8_0", 8, 32, 34)
Q4_K = BlockFormat("Q4_K", 12, 256, 144)
Q5_K = BlockFormat("Q5_K", 13, 256, 176)
Q6_K = BlockFormat("Q6_K", 14, 256, 210)
FORMATS = {f.ggml_type: f for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)}
# above (float32 activations, or K-quants in the file's layout): dequantize once per call, torch's GEMM
NATIVE_MAX_ROWS = 16


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
    if fmt is Q6_K:
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
    qs = b[..., 48:176] if fmt is Q5_K else b[..., 16:144]
    qs = qs.reshape(*shape, 4, 1, 32)
    q = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(*shape, 8, 32)  # sub-block 2 i + h
    if fmt is Q5_K:
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
    if fmt.block_size == 256:
        return _dequantize_k(b, fmt).reshape(rows, -1).to(dtype)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    if fmt is Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [N, K / 32, 32]
        w = d * q
    else:
        qs = b[..., 4:] if fmt is Q4_1 else b[..., 2:]  # [N, K / 32, 16]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [N, K / 32, 32]: elements 0-15, 16-31
        if fmt is Q4_1:
            w = d * q.float() + b[..., 2:4].contiguous().view(torch.float16).float()
        else:
            w = d * (q.to(torch.int8) - 8).float()
    return w.reshape(rows, -1).to(dtype)


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer (or an embedding / LM head) whose ``weight`` holds GGUF blocks.

    ``fmt``: the blocks' format; ``dtype``: the model's activation dtype (an embedding lookup's
    output); ``native``: the C kernel may serve small row counts on CPU (the native kernels are
    allowed and the library loads). With ``native`` and int8 dot products in the library
    (``quant_ops.gguf_int8_dot``: AVX512-VNNI), blocks of any type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
    Q6_K) of a multiple of 16 rows are kept in ``gguf_r16``'s interleaved layout (``r16``, the
    file's size), whose int8 kernels serve bf16 activations of any row count; without VNNI the
    file's layout is kept (its float32 path is faster there). One method per installed layer (the tied LM head shares its
    embedding's). The model keeps this method when the kernels are chosen (``quantized``:
    ``layers/selection.py`` leaves it in place).
    """

    quantized = True

    def __init__(self, fmt: BlockFormat, dtype: torch.dtype, native: bool = False) -> None:
        self.fmt, self.dtype, self.native = fmt, dtype, native
        self.r16 = False

    @property
    def kernel_type(self) -> int:
        """The type code of ``quant_ops.gemm_gguf`` for the blocks as held (``| GGUF_R16`` when interleaved)."""
        return self.fmt.ggml_type | (quant_ops.GGUF_R16 if self.r16 else 0)

    def install(self, layer: nn.Module, blocks: torch.Tensor, input_size: int) -> None:
        """Make ``blocks`` ``[N, K / block_size * block_bytes]`` uint8 ``layer``'s weight, served by this method.

        Raises:
            ValueError: ``blocks`` is not whole rows of ``input_size`` elements in this format.
        """
        if input_size % self.fmt.block_size or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != input_size // self.fmt.block_size * self.fmt.block_bytes:
            raise ValueError(f"{self.fmt.name} blocks {tuple(blocks.shape)} {blocks.dtype} are not rows of "
                             f"{input_size} elements")
        self.r16 = self.native and gguf_r16.supports(self.fmt.ggml_type, blocks.shape[0]) and quant_ops.gguf_int8_dot()
        if self.r16:
            blocks = gguf_r16.pack(blocks, self.fmt.ggml_type)
        layer.weight = nn.Parameter(blocks.contiguous(), requires_grad=False)
        layer.gguf_input_size = input_size
        layer.quant_method = self

    def file_blocks(self, layer: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's blocks of ``rows`` (``[R]`` int64; all when ``None``) in the file's row layout."""
        if self.r16:
            return gguf_r16.unpack_rows(layer.weight, self.fmt.ggml_type, rows)
        return layer.weight if rows is None else layer.weight[rows]

    def weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [N, K] dtype
        """The layer's weight, dequantized."""
        return dequantize(self.file_blocks(layer), self.fmt, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        return self._matmul(layer, x, bias, x.dtype)

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, vocab] float32 (nothing for ParallelLMHead to refine)
        return self._matmul(layer, x, None, torch.float32)

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, K]
        """The rows of ``input_ids``, dequantized into the model's dtype."""
        return dequantize(self.file_blocks(layer, input_ids), self.fmt, self.dtype).reshape(*input_ids.shape, -1)

    def _matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        if (self.native and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and x.stride(-1) == 1 and (x.shape[0] <= NATIVE_MAX_ROWS or (self.r16 and x.dtype == torch.bfloat16))):
            out = quant_ops.gemm_gguf(x, layer.weight, self.kernel_type, layer.gguf_input_size, out_dtype, validate=False)
            return out if bias is None else out.add_(bias)
        if x.is_cuda and x.dim() == 2 and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from kernels.triton.gemm_gguf import gemm_gguf  # imports triton: only where it runs

            out = gemm_gguf(x, layer.weight, self.fmt.ggml_type, out_dtype)
            return out if bias is None else out.add_(bias)
        compute = torch.float32 if out_dtype == torch.float32 else x.dtype
        return F.linear(x.to(compute), self.weight(layer, compute), None if bias is None else bias.to(compute))


class GGUFShardedLinearMethod(LinearMethodBase):
    """A merged linear layer (q | k | v, gate | up) whose shards are GGUF blocks of different
    formats: shard ``i``'s rows ``[N_i, K / block_size_i * block_bytes_i]`` are held by the
    sub-module ``layer.gguf_shards[i]`` and multiplied by its :class:`GGUFLinearMethod`; the
    outputs are concatenated in shard order (``[T, sum N_i]``). The layer's own ``weight`` is
    left empty. The all-layers C call (``NativeLayers``) reads the parts' blocks in place and
    multiplies each into its columns of the output, as :meth:`apply` does."""

    quantized = True

    def __init__(self, fmts: list[BlockFormat], dtype: torch.dtype, native: bool = False) -> None:
        self.parts = [GGUFLinearMethod(fmt, dtype, native) for fmt in fmts]

    def install(self, layer: nn.Module, shards: list[torch.Tensor], input_size: int) -> None:
        """Make each of ``shards`` (uint8 block rows, in this method's formats) one part of ``layer``.

        Raises:
            ValueError: a shard that is not whole rows of ``input_size`` elements in its format.
        """
        layer.gguf_shards = nn.ModuleList()
        for method, blocks in zip(self.parts, shards, strict=True):
            part = nn.Module()
            method.install(part, blocks, input_size)
            layer.gguf_shards.append(part)
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.gguf_input_size = input_size
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, sum N_i] in x's dtype
        out = torch.cat([m.apply(part, x) for m, part in zip(self.parts, layer.gguf_shards, strict=True)], dim=-1)
        return out if bias is None else out.add_(bias)
