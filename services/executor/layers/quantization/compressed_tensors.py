"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, as llm-compressor
writes them): weight-only schemes of ``config_groups``, symmetric, without activation ordering.

- ``pack-quantized`` int4 / int8 (W4A16, W8A16), strategy ``group`` or ``channel``:
  ``weight_packed`` int32 ``[N, K * bits / 32]`` (values along the input, lowest bits first,
  each stored plus ``2^(bits-1)``), ``weight_scale`` ``[N, K/G]`` (``[N, 1]`` per channel),
  ``weight_shape`` int64 ``[2]``; ``w = (stored - 2^(bits-1)) * scale``. Int4 goes through
  the int4 kernel (``int4.py``), int8 stays on the torch path.
- ``float-quantized`` / ``naive-quantized`` float8 (FP8), strategy ``tensor`` or ``channel``:
  ``fp8.py``'s method.

``ignore`` (names, or ``re:`` regular expressions) leaves layers unquantized; a group's
``targets`` are ``Linear`` or names / regular expressions of layers.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.linear import LinearMethodBase
from services.executor.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod, quant_param
from services.executor.layers.quantization.fp8 import Fp8LinearMethod
from services.executor.layers.quantization.int4 import Int4LinearMethod, Int4Weights, unpack_int32

FORMATS = ("pack-quantized", "float-quantized", "naive-quantized")


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[tuple[list[str], dict[str, Any], str, bool]], ignore: list[str]) -> None:
        self.schemes, self.ignore = schemes, ignore  # (targets, weights args, format, static input scale)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        top_format = config.get("format")
        schemes = []
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            fmt = group.get("format") or top_format
            what = f"compressed-tensors group {name!r}"
            if fmt not in FORMATS:
                raise ValueError(f"{what}: format {fmt!r} is not supported (only {', '.join(FORMATS)})")
            if group.get("input_activations") and weights.get("type") == "int":
                raise ValueError(f"{what}: quantized activations are not supported (only weight-only int schemes)")
            kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
            if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
                raise ValueError(f"{what}: {kind} weights of {bits} bits are not supported "
                                 "(only int 4, int 8, float 8)")
            allowed = ("group", "channel") if kind == "int" else ("tensor", "channel")
            if strategy not in allowed:
                raise ValueError(f"{what}: strategy {strategy!r} for {kind} weights is not supported "
                                 f"(only {', '.join(allowed)})")
            if not weights.get("symmetric", True):
                raise ValueError(f"{what}: asymmetric weights are not supported")
            if weights.get("actorder"):
                raise ValueError(f"{what}: actorder={weights['actorder']!r} is not supported")
            if weights.get("dynamic"):
                raise ValueError(f"{what}: dynamic weight quantization is not supported")
            if kind == "int" and fmt != "pack-quantized":
                raise ValueError(f"{what}: int weights in format {fmt!r} are not supported (only pack-quantized)")
            acts = group.get("input_activations") or {}
            static_input = bool(acts) and not acts.get("dynamic", False)  # an input_scale per layer, unused
            schemes.append((list(group.get("targets") or ["Linear"]), weights, fmt, static_input))
        if not schemes:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(schemes, list(config.get("ignore") or []))

    def linear_method(self, prefix: str, shard_names: list[str]) -> LinearMethodBase | None:
        parent = prefix.rsplit(".", 1)[0]
        names = [parent + "." + s for s in shard_names] or [prefix]
        if any(_matches(p, name) for p in self.ignore for name in names):
            return None
        for targets, weights, _, static_input in self.schemes:
            if any(t == "Linear" or _matches(t, name) for t in targets for name in names):
                if weights["type"] == "float":
                    return Fp8LinearMethod(per_channel=weights["strategy"] == "channel", static_input_scale=static_input)
                if weights["num_bits"] == 4:
                    return CTInt4LinearMethod(weights)
                return CTInt8LinearMethod(weights)
        return None


def _create_packed(layer: nn.Module, weights: dict[str, Any], input_size: int, output_partition_sizes: list[int]) -> None:
    n, k, bits = sum(output_partition_sizes), input_size, weights["num_bits"]
    per_int = 32 // bits
    if weights["strategy"] == "group":
        g = int(weights["group_size"])
        if k % g:
            raise ValueError(f"this rank's input size {k} is not a multiple of the group size {g}")
        quant_param(layer, "weight_scale", (n, k // g), torch.float32, output_dim=0, input_dim=1, input_pack=g)
    else:
        g = k
        quant_param(layer, "weight_scale", (n, 1), torch.float32, output_dim=0)
    if k % per_int:
        raise ValueError(f"input size {k} is not a multiple of {per_int} ({bits}-bit values per int32)")
    quant_param(layer, "weight_packed", (n, k // per_int), torch.int32, output_dim=0, input_dim=1, input_pack=per_int)
    quant_param(layer, "weight_shape", (len(output_partition_sizes), 2), torch.int64, shard_dim=0)
    layer.ct_group_size = g


class _PackQuantized:
    """The ``pack-quantized`` tensors of a layer (``weights``: the scheme's weight arguments)."""

    def __init__(self, weights: dict[str, Any]) -> None:
        self.weights = weights

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        _create_packed(layer, self.weights, input_size, output_partition_sizes)
        self.register_bias(layer, sum(output_partition_sizes), params_dtype, bias)


class CTInt4LinearMethod(_PackQuantized, Int4LinearMethod):
    """``pack-quantized`` int4 (W4A16) through the int4 kernel."""

    def unpack(self, layer: nn.Module) -> Int4Weights:
        q = unpack_int32(layer.weight_packed, 4).flatten(1)  # [N, K], stored + 8
        g_idx = torch.arange(q.shape[1], device=q.device) // layer.ct_group_size
        scales = layer.weight_scale.float()
        return Int4Weights(q.to(torch.uint8), torch.full_like(scales, 8.0), scales, g_idx)


class CTInt8LinearMethod(_PackQuantized, QuantizedLinearMethod):
    """``pack-quantized`` int8 (W8A16): unpacked once to int8 ``[N, K]`` (the same bytes),
    dequantized to the activations' dtype at each call."""

    def derive(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        q = (unpack_int32(layer.weight_packed, 8).flatten(1) - 128).to(torch.int8)  # [N, K]
        return q, layer.weight_scale.clone()

    @staticmethod
    def _dequantize(q: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
        s = scales.repeat_interleave(group, dim=1) if scales.shape[1] > 1 else scales  # [N, K] or [N, 1]
        return (q.float() * s).to(dtype)

    def apply_derived(self, layer: nn.Module, derived: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        q, scales = derived
        return F.linear(x, self._dequantize(q, scales, layer.ct_group_size, x.dtype), bias)

    def apply_checkpoint(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.apply_derived(layer, self.derive(layer), x, bias)
