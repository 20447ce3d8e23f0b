"""The native int4 group-quantized matmul (kernels/cpu/csrc/cpu_gemm_w4.c) against its torch
reference: the packed weight dequantized (``PackedInt4.dequantize``) and ``F.linear`` in float64."""

from __future__ import annotations

import pytest
import torch
from native_builds import NEEDS_KERNEL

from kernels.cpu import quant_ops
from services.executor.layers.quantization.int4 import Int4Weights, int4_matmul, pack_int4

pytestmark = [NEEDS_KERNEL, pytest.mark.kernel]


def _packed(n: int, k: int, group: int, seed: int = 0, act_order: bool = False):
    gen = torch.Generator().manual_seed(seed)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = Int4Weights(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                    torch.randint(0, 16, (n, k // group), generator=gen).float(),
                    torch.rand(n, k // group, generator=gen) * 0.1 + 0.01, g_idx)
    return w, pack_int4(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 37, 256, 128), (9, 64, 128, 32), (17, 5, 64, 64)])
def test_int4_gemm_matches_the_dequantized_matmul(m, n, k, group, dtype):
    w, packed = _packed(n, k, group)
    x = torch.randn(m, k).to(dtype)
    out = quant_ops.gemm_w4(x, packed.qweight, packed.scales, packed.szeros, packed.group_size)
    ref = (x.double() @ w.dequantize(torch.float64).T)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_strided_rows_and_act_order_go_through_the_kernel():
    """A row-strided x (``ldx``) and a GPTQ act order (columns gathered by ``perm``)."""
    w, packed = _packed(24, 128, 32, seed=1, act_order=True)
    assert packed.perm is not None
    x = torch.randn(6, 256)[:, :128]
    assert quant_ops.gemm_w4_supports(x) and x.stride(0) == 256
    torch.testing.assert_close(int4_matmul(x, packed), x @ w.dequantize().T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(quant_ops.gemm_w4(x, packed.qweight, packed.scales, packed.szeros, 32),
                               x @ packed.dequantize(torch.float32).T, atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused_naming_the_parameter():
    _, packed = _packed(8, 64, 32)
    with pytest.raises(ValueError, match="qweight must be"):
        quant_ops.gemm_w4(torch.randn(2, 64), packed.qweight[:, :16].contiguous(), packed.scales, packed.szeros, 32)
    with pytest.raises(ValueError, match="group_size=48"):
        quant_ops.gemm_w4(torch.randn(2, 64), packed.qweight, packed.scales, packed.szeros, 48)
