"""AWQ checkpoints (``quant_method: "awq"``, ``version: "gemm"``): 4-bit with zero points
(Lin et al. 2023, the AutoAWQ GEMM layout).

Tensors of a linear layer with ``K`` inputs, ``N`` outputs, groups of ``G``: ``qweight`` int32
``[K, N/8]`` and ``qzeros`` int32 ``[K/G, N/8]``, each packing 8 outputs in the interleaved
order ``0 2 4 6 1 3 5 7`` (nibble ``i``, lowest first, holds output ``ORDER[i]``); ``scales``
``[K/G, N]``. ``w[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n]``; no ``g_idx``, no +1.
``modules_to_not_convert`` names layers left unquantized.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.executor.layers.quantization.base import (
    QuantizationConfig,
    check_divisible,
    full_input_size,
    quant_param,
)
from services.executor.layers.quantization.int4 import Int4LinearMethod, Int4Weights, unpack_int32

#: the output of each nibble of a packed int32 (AutoAWQ's pack order)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: the nibble of each output: AWQ_ORDER's inverse
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size, self.modules_to_not_convert = group_size, modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits} is not supported (only 4)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported (only 'gemm')")
        if not config.get("zero_point", True):
            raise ValueError("AWQ with zero_point=false is not supported")
        return cls(int(config.get("group_size", config.get("q_group_size", 128))),
                   list(config.get("modules_to_not_convert") or []))

    def linear_method(self, prefix: str, shard_names: list[str]) -> AWQLinearMethod | None:
        names = [prefix] + [prefix.rsplit(".", 1)[0] + "." + s for s in shard_names]
        if any(skip in name for skip in self.modules_to_not_convert for name in names):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod(Int4LinearMethod):
    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        n, k = sum(output_partition_sizes), input_size
        g = full_input_size(layer, input_size) if self.config.group_size == -1 else self.config.group_size
        check_divisible(n, 8, "AWQ output size (8 per int32)")
        check_divisible(k, g, f"this rank's AWQ input rows for group size {g}")
        quant_param(layer, "qweight", (k, n // 8), torch.int32, output_dim=1, output_pack=8, input_dim=0)
        quant_param(layer, "qzeros", (k // g, n // 8), torch.int32, output_dim=1, output_pack=8,
                    input_dim=0, input_pack=g)
        quant_param(layer, "scales", (k // g, n), torch.float32, output_dim=1, input_dim=0, input_pack=g)
        layer.awq_group_size = g
        self.register_bias(layer, n, params_dtype, bias)

    def unpack(self, layer: nn.Module) -> Int4Weights:
        order = torch.tensor(AWQ_REVERSE_ORDER, device=layer.qweight.device)
        q = unpack_int32(layer.qweight, 4)[..., order].flatten(1)  # [K, N]
        z = unpack_int32(layer.qzeros, 4)[..., order].flatten(1)  # [K/G, N]
        g_idx = torch.arange(q.shape[0], device=q.device) // layer.awq_group_size
        return Int4Weights(q.t().to(torch.uint8), z.t().float(), layer.scales.t().float(), g_idx)
