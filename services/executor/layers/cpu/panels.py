"""bf16 matmuls on CPU in the native bf16-weight GEMM (``kernels/cpu/csrc/cpu_gemm_bf16.c``).

Used where :func:`kernels.cpu.ops.prefer_native_gemm`: with AVX512-BF16 and no AMX its
vdpbf16ps tiles beat oneDNN, and on CPUs without bf16 arithmetic (where torch emulates bf16
matmuls) its float32 AVX2 + FMA tiles multiply straight from the bf16 weights. Measurements:
``benchmarks/RESULTS.md`` (``benchmarks/cpu_gemm.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import ops
from services.executor.layers.linear import LinearBase, LinearMethodBase


class PanelLinearMethod(LinearMethodBase):
    """bf16 weights ``[out, in]`` laid out once for :func:`kernels.cpu.ops.gemm_bf16w` (panels
    of 16 output columns), for every row count; float32 sums, one rounding per output.

    A linear layer's panels replace its weight's storage (they hold the same values, so the
    weights are not held twice; :meth:`restore_weights` rebuilds them bit for bit). The LM
    head's panels are a copy: its table is also the embedding's, which the lookup still reads.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        layer.panel = ops.pack_bf16_weight(weight)
        layer.panel_rows = weight.shape[0]
        layer.panel_released = isinstance(layer, LinearBase)
        if layer.panel_released:
            weight.data = torch.empty((0, weight.shape[1]), dtype=weight.dtype)

    def restore_weights(self, layer: nn.Module) -> None:
        if layer.panel_released:
            layer.weight.data = ops.unpack_bf16_weight(layer.panel, layer.panel_rows, layer.weight.shape[1])
        layer.panel, layer.panel_released = None, False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] bf16 with unit stride along in -> [T, out] bf16
        return ops.gemm_bf16w(x, layer.panel, layer.panel_rows, bias, torch.bfloat16, validate=False)

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # float32 out: no bf16 rounding of the logits to refine
        return ops.gemm_bf16w(x.contiguous(), layer.panel, layer.panel_rows, None, torch.float32, validate=False)
