"""GPTQ checkpoints (``quant_method: "gptq"``): 4-bit, any group size (-1: one group), with or
without ``desc_act``, ``checkpoint_format`` ``"gptq"`` (zero points stored minus one) or
``"gptq_v2"``.

Tensors of a linear layer with ``K`` inputs, ``N`` outputs, groups of ``G`` (Frantar et al. 2022,
the AutoGPTQ / GPTQModel layout): ``qweight`` int32 ``[K/8, N]`` (8 input rows per int32, the
lowest bits first), ``qzeros`` int32 ``[K/G, N/8]`` (8 outputs per int32), ``scales``
``[K/G, N]``, ``g_idx`` int32 ``[K]`` (each input row's group; ``k // G`` unless
``desc_act``). ``w[k, n] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``.

Tensor parallelism: a row-parallel rank takes its input rows of ``qweight`` and ``g_idx`` and,
where groups follow the rows, its groups of ``scales`` / ``qzeros``; with ``desc_act`` (groups
in any row order) or one group for the whole input every rank keeps all groups (as vLLM does).
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


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, zeros_minus_one: bool) -> None:
        self.group_size, self.desc_act, self.zeros_minus_one = group_size, desc_act, zeros_minus_one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"GPTQ with bits={bits} is not supported (only 4)")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported (only 'gptq', 'gptq_v2')")
        return cls(int(config.get("group_size", 128)), bool(config.get("desc_act", False)), fmt == "gptq")

    def linear_method(self, prefix: str, shard_names: list[str]) -> GPTQLinearMethod:
        return GPTQLinearMethod(self)


class GPTQLinearMethod(Int4LinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        n, k, full_k = sum(output_partition_sizes), input_size, full_input_size(layer, input_size)
        g = full_k if self.config.group_size == -1 else self.config.group_size
        check_divisible(k, 8, "GPTQ input size (8 rows per int32)")
        check_divisible(n, 8, "GPTQ output size of qzeros (8 per int32)")
        check_divisible(full_k, g, f"GPTQ input size for group size {g}")
        split_groups = k == full_k or not (self.config.desc_act or g == full_k)
        groups = k // g if split_groups else full_k // g
        if split_groups:
            check_divisible(k, g, f"this rank's GPTQ input rows for group size {g}")
        group_dim = 0 if split_groups else None
        layer.gptq_group_size = g
        quant_param(layer, "qweight", (k // 8, n), torch.int32, output_dim=1, input_dim=0, input_pack=8)
        quant_param(layer, "qzeros", (groups, n // 8), torch.int32, output_dim=1, output_pack=8,
                    input_dim=group_dim, input_pack=g)
        quant_param(layer, "scales", (groups, n), torch.float32, output_dim=1, input_dim=group_dim, input_pack=g)
        quant_param(layer, "g_idx", (k,), torch.int32, input_dim=0)
        self.register_bias(layer, n, params_dtype, bias)

    def unpack(self, layer: nn.Module) -> Int4Weights:
        k4, n = layer.qweight.shape
        q = unpack_int32(layer.qweight, 4).transpose(1, 2).reshape(k4 * 8, n)  # [K, N]
        z = unpack_int32(layer.qzeros, 4).flatten(1)  # [groups, N]
        if self.config.zeros_minus_one:
            z = (z + 1) & 15
        if self.config.desc_act:
            g_idx = layer.g_idx.long()  # global groups: every rank holds them all when rows split
        else:  # k // G: this rank's rows are its own groups' (as vLLM, the stored g_idx unread)
            g_idx = torch.arange(k4 * 8, device=q.device) // layer.gptq_group_size
        return Int4Weights(q.t().to(torch.uint8), z.t().float(), layer.scales.t().float(), g_idx)
