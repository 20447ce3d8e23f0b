"""The native GGUF-block GEMM (kernels/cpu/csrc/cpu_gguf_gemm.c) against the torch path
(services/executor/layers/gguf.py: dequantize, then a float32 matmul)."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_fixtures import random_blocks
from native_builds import X86

from kernels.cpu import native, quant_ops
from services.executor.layers import gguf as G


def _portable_kernel(tmp_path) -> ctypes.CDLL:
    """``cpu_gguf_gemm.c`` alone, compiled without AVX-512 (the portable C loop): a second
    build of the whole library would cost ~20 s; this file alone, about one."""
    so = tmp_path / "gguf_portable.so"
    cmd = [native.find_compiler(), "-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-fPIC", "-shared",
           str(native.CSRC / "cpu_gguf_gemm.c"), "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedllm_gemm_gguf.argtypes = [c_int, p, c_int, p, i64, c_int, p, i64, i64, i64, i64, c_int]
    lib.pagedllm_gemm_gguf.restype = c_int
    return lib


@pytest.fixture(scope="module", params=[
    pytest.param("native", id="native"),
    pytest.param("portable", id="portable", marks=pytest.mark.skipif(not X86, reason="-mno-avx512f is x86")),
])
def lib(request, tmp_path_factory):
    """The library as built for this CPU (AVX-512 blocks where the CPU has them) and the kernel
    built without AVX-512 (the portable C loop)."""
    session_lib = request.getfixturevalue("kernel_library")
    return session_lib if request.param == "native" else _portable_kernel(tmp_path_factory.mktemp("gguf"))


def _blocks(fmt: G.BlockFormat, n: int, k: int, seed: int) -> torch.Tensor:  # [n, k / 32 * block_bytes]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(quants.quantize(w, GGMLQuantizationType(fmt.ggml_type)))


@pytest.mark.parametrize("fmt", [G.Q4_0, G.Q4_1, G.Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3, 11])  # one row, a partial tile, a full tile and a partial one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_gguf_matches_the_torch_path(lib, fmt, m, dtype):
    n, k = 37, 96
    blocks = _blocks(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    reference = x.float() @ G.dequantize(blocks, fmt).t()  # [m, n] float32
    out32 = quant_ops.gemm_gguf(x, blocks, fmt.ggml_type, k, torch.float32, lib=lib)
    torch.testing.assert_close(out32, reference, rtol=1e-5, atol=1e-4)
    out = quant_ops.gemm_gguf(x, blocks, fmt.ggml_type, k, dtype, lib=lib)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.to(dtype), **({} if dtype == torch.float32 else
                                                            {"rtol": 1.6e-2, "atol": 1e-2}))


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 256), (5, 24, 768), (64, 19, 512)])
def test_gemm_gguf_k_quants_match_gguf_dequantize(lib, fmt, m, n, k):
    """Random valid K-quant blocks (every quant and scale bit pattern) against
    ``gguf.quants.dequantize`` and a float32 matmul; bf16 activations and output too."""
    blocks = random_blocks(fmt, n, k, seed=m + fmt.ggml_type)
    weight = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType(fmt.ggml_type)))  # [n, k]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    reference = x @ weight.t()
    torch.testing.assert_close(quant_ops.gemm_gguf(x, blocks, fmt.ggml_type, k, torch.float32, lib=lib), reference,
                               rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()
    out = quant_ops.gemm_gguf(xb, blocks, fmt.ggml_type, k, torch.bfloat16, lib=lib)
    torch.testing.assert_close(out, (xb.float() @ weight.t()).bfloat16(), rtol=1.6e-2, atol=1e-2)


def test_gemm_gguf_reads_strided_rows(lib):
    blocks = _blocks(G.Q4_1, 16, 64, seed=5)
    x = torch.randn(4, 128)[:, 32:96]  # [4, 64], row stride 128
    torch.testing.assert_close(quant_ops.gemm_gguf(x, blocks, G.Q4_1.ggml_type, 64, torch.float32, lib=lib),
                               x @ G.dequantize(blocks, G.Q4_1).t(), rtol=1e-5, atol=1e-4)


def test_gemm_gguf_refuses_bad_arguments(lib):
    blocks = _blocks(G.Q4_1, 4, 64, seed=0)
    with pytest.raises(ValueError, match="ggml_type"):
        quant_ops.gemm_gguf(torch.randn(1, 64), blocks, 12, 64, lib=lib)
    with pytest.raises(ValueError, match="blocks must be"):
        quant_ops.gemm_gguf(torch.randn(1, 64), blocks, G.Q8_0.ggml_type, 64, lib=lib)
    with pytest.raises(ValueError, match="multiple of its block size"):  # K-quants: super-blocks of 256
        quant_ops.gemm_gguf(torch.randn(1, 64), blocks, G.Q4_K.ggml_type, 64, lib=lib)
