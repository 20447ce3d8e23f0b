"""FP8 weights, weight-only (``quant_method: "fp8"``, and compressed-tensors' float schemes through
:class:`Fp8LinearMethod`): ``weight`` float8 e4m3 ``[N, K]`` and ``weight_scale``, one per tensor
(a scalar, or ``[1]``) or one per output row (``[N]`` / ``[N, 1]``); ``w = weight * scale``.
The matmul runs in the activations' dtype (the weight dequantized per call, never cached):
activations are not quantized, and a static ``input_scale`` is loaded and not used.

A merged layer (q | k | v) keeps one per-tensor scale per shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod, quant_param


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, static_input_scale: bool) -> None:
        self.static_input_scale = static_input_scale

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        if config.get("weight_block_size"):
            raise ValueError(f"FP8 with weight_block_size={config['weight_block_size']} is not supported "
                             "(only per-tensor scales)")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt={fmt!r} is not supported (only 'e4m3')")
        return cls(config.get("activation_scheme", "dynamic") == "static")

    def linear_method(self, prefix: str, shard_names: list[str]) -> Fp8LinearMethod:
        return Fp8LinearMethod(per_channel=False, static_input_scale=self.static_input_scale)


class Fp8LinearMethod(QuantizedLinearMethod):
    """``F.linear(x, weight.to(x.dtype) * scale)``; ``per_channel``: a scale per output row."""

    def __init__(self, per_channel: bool, static_input_scale: bool) -> None:
        self.per_channel, self.static_input_scale = per_channel, static_input_scale

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        n, shards = sum(output_partition_sizes), len(output_partition_sizes)
        quant_param(layer, "weight", (n, input_size), torch.float8_e4m3fn, output_dim=0, input_dim=1)
        if self.per_channel:
            quant_param(layer, "weight_scale", (n, 1), torch.float32, output_dim=0)
        else:
            quant_param(layer, "weight_scale", (shards,), torch.float32, shard_dim=0)
        if self.static_input_scale:
            quant_param(layer, "input_scale", (shards,), torch.float32, shard_dim=0)
        self.register_bias(layer, n, params_dtype, bias)

    def row_scales(self, layer: nn.Module) -> torch.Tensor:  # [N, 1] float32
        if self.per_channel:
            return layer.weight_scale
        sizes = torch.tensor(layer.output_partition_sizes, device=layer.weight_scale.device)
        return layer.weight_scale.repeat_interleave(sizes).unsqueeze(1)

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        return (layer.weight.float() * self.row_scales(layer)).to(dtype)

    def apply_checkpoint(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer, x.dtype), bias)
