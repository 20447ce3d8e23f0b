"""Python wrappers of the native kernels' quantized matmuls (the library of
:mod:`kernels.cpu.native`, as :mod:`kernels.cpu.ops`):

:func:`gemm_w4` runs ``cpu_gemm_w4.c``: weight-only int4 group-quantized matmuls (GPTQ, AWQ,
compressed-tensors W4A16 in the layout of ``services/executor/layers/quantization/int4.py``);
:func:`gemm_gguf` runs ``cpu_gguf_gemm.c``: GGUF blocks multiplied as they are, of a format the
caller hands in (a ``BlockFormat`` of ``services/executor/layers/quantization/gguf/formats.py``,
the one registry of the formats, which ``kernels/`` does not import: the C type code is its
``kernel_type``, the row's bytes its ``row_bytes``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kernels.cpu.native import load
from kernels.cpu.ops import _DTYPES


def gemm_w4_supports(x: torch.Tensor) -> bool:
    """Whether :func:`gemm_w4` takes ``x`` (a float32/bfloat16 CPU matrix, unit stride along K)
    and the library is available."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.stride(1) == 1
            and load() is not None)


def gemm_w4(
    x: torch.Tensor,  # [M, K] float32 or bfloat16, unit stride along K
    qweight: torch.Tensor,  # [N, K/2] uint8: per 32 columns 16 bytes, column j low nibble, j + 16 high
    scales: torch.Tensor,  # [N, K/G] float32
    szeros: torch.Tensor,  # [N, K/G] float32, zero point * scale
    group_size: int,  # G, a multiple of 32 dividing K
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [M, N] x's dtype
    """``x @ W.T`` for ``W[n, k] = q[n, k] * scales[n, k // G] - szeros[n, k // G]`` (``cpu_gemm_w4.c``:
    float32 sums, AVX-512 where compiled for it, OpenMP over output columns on
    ``torch.get_num_threads()`` threads).

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the parameter), or no library.
    """
    lib = lib or load()
    if lib is None:
        raise ValueError("the native CPU kernels are not available (see the cpu_kernels_unavailable log)")
    if x.dim() != 2 or x.dtype not in _DTYPES or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError("x must be a float32/bfloat16 [M, K] CPU tensor with unit stride along K")
    m, k = x.shape
    n = qweight.shape[0]
    if k % 32 or group_size % 32 or group_size <= 0 or k % group_size:
        raise ValueError(f"K={k} and group_size={group_size} must be multiples of 32, the group dividing K")
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, k // 2) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a dense [N, {k // 2}] uint8 tensor, got {tuple(qweight.shape)} {qweight.dtype}")
    for name, t in (("scales", scales), ("szeros", szeros)):
        if t.dtype != torch.float32 or tuple(t.shape) != (n, k // group_size) or not t.is_contiguous():
            raise ValueError(f"{name} must be a dense [{n}, {k // group_size}] float32 tensor")
    out = torch.empty((m, n), dtype=x.dtype)
    status = lib.pagedllm_gemm_w4(_DTYPES[x.dtype], x.data_ptr(), x.stride(0) if m > 1 else k, qweight.data_ptr(),
                                  scales.data_ptr(), szeros.data_ptr(), out.data_ptr(), m, n, k, group_size,
                                  torch.get_num_threads())
    if status == 3:
        raise MemoryError("cpu int4 gemm: out of memory for the float32 copy of x")
    if status != 0:
        raise ValueError(f"cpu int4 gemm failed (status {status}) for x {tuple(x.shape)}, weight [{n}, {k}]")
    return out


#: flag on a GGUF type code: rows interleaved by 16 (GGUF_R16 of csrc/pagedllm_abi.h; the layout:
#: services/executor/layers/quantization/gguf/r16.py)
GGUF_R16 = 0x100


def gguf_int8_dot(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the native kernels (``lib``, or the loaded library) multiply bf16 activations with
    GGUF weights as int8 (AVX512-VNNI; ``GGUF_INT8_DOT`` in ``csrc/cpu_gguf_q8.h``), the kernels
    that the 16-row interleaved layout (``GGUF_R16``) is for. False without a library; without
    VNNI bf16 activations are widened to float32 instead."""
    lib = lib or load()
    return lib is not None and bool(lib.pagedllm_gguf_int8_dot())


def gemm_gguf(
    x: torch.Tensor,  # [M, K] bfloat16 or float32, unit stride along K
    blocks: torch.Tensor,  # [N, K / block_size * block_bytes] uint8, dense: each weight row's GGUF blocks
    fmt: Any,  # the blocks' BlockFormat (name, block_size, kernel_type, r16, row_bytes): formats.py's
    k: int,  # K, the weight's input features (a multiple of the format's block size)
    out_dtype: torch.dtype = torch.bfloat16,  # bfloat16 or float32
    lib: ctypes.CDLL | None = None,
    validate: bool = True,  # False: the caller vouches for the tensors (the model's hot path)
    r16: bool = False,  # blocks in r16.py's 16-row interleaved layout (type | GGUF_R16; N a multiple of 16)
) -> torch.Tensor:  # [M, N] out_dtype
    """``F.linear(x, dequantize(blocks))`` with the weight kept quantized (``cpu_gguf_gemm.c``:
    each block dequantized in registers, float32 sums, one rounding per output; bf16 ``x`` with
    32-element blocks, or any format interleaved (``r16``), where :func:`gguf_int8_dot`: int8
    activations, ``cpu_gguf_q8.c``, ``cpu_gguf_r16.c`` or ``cpu_gguf_r16k.c``). Runs on
    ``torch.get_num_threads()`` OpenMP threads.

    Raises:
        ValueError: shapes, dtypes or a type that do not fit (the message names the parameter),
            or no library.
    """
    lib = lib or load()
    if lib is None:
        raise ValueError("the native CPU kernels are not available (see the cpu_kernels_unavailable log)")
    m = x.shape[0]
    if validate:
        if x.dim() != 2 or x.dtype not in _DTYPES or x.device.type != "cpu" or x.stride(1) != 1 or x.shape[1] != k:
            raise ValueError(f"x must be a float32/bfloat16 [M, {k}] CPU tensor with unit stride along K")
        if fmt.kernel_type is None or k % fmt.block_size or (r16 and not fmt.r16):
            raise ValueError(f"ggml_type {fmt.name} must have a kernel{' interleaved by 16' if r16 else ''} and k "
                             f"(got {k}) a multiple of its block size {fmt.block_size}")
        if r16 and blocks.shape[0] % 16:
            raise ValueError(f"blocks in the 16-row interleaved layout need a multiple of 16 rows, got {blocks.shape[0]}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() \
                or blocks.shape[1] != fmt.row_bytes(k) or blocks.device.type != "cpu":
            raise ValueError(f"blocks must be a dense [N, {fmt.row_bytes(k)}] uint8 CPU tensor")
        if out_dtype not in _DTYPES:
            raise ValueError("out_dtype must be torch.float32 or torch.bfloat16")
    n = blocks.shape[0]
    out = torch.empty((m, n), dtype=out_dtype)
    status = lib.pagedllm_gemm_gguf(fmt.kernel_type | (GGUF_R16 if r16 else 0), blocks.data_ptr(), _DTYPES[x.dtype], x.data_ptr(),
                                    x.stride(0) if m > 1 else k, _DTYPES[out_dtype], out.data_ptr(), n, m, n, k,
                                    torch.get_num_threads())
    if status != 0:
        raise ValueError(f"cpu gguf gemm failed (status {status}) for x {tuple(x.shape)}, blocks {tuple(blocks.shape)}")
    return out
