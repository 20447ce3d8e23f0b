"""Linear layers with the field's names (vLLM / nano-vllm), and the linear method behind each one.

A layer (``ReplicatedLinear``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``RowParallelLinear``) holds its parameters and hands the matmul to its
*linear method* (vLLM's ``LinearMethodBase``): ``create_weights`` registers the parameters,
``process_weights_after_loading`` derives what ``apply`` reads (a packed copy, another
layout), ``restore_weights`` undoes that, ``apply(layer, x, bias)`` multiplies. The plain
method here is :class:`UnquantizedLinearMethod`; the CPU ones (oneDNN-prepacked, native-GEMM
panels) are in ``layers/cpu/``, and ``layers/selection.py`` picks one per model at load time.

Every parameter carries ``weight_loader(param, loaded_weight, loaded_shard_id=None)``, which
knows where a checkpoint tensor goes: the shards ``"q"``, ``"k"``, ``"v"`` of
:class:`QKVParallelLinear` and ``0``, ``1`` (gate, up) of :class:`MergedColumnParallelLinear`
are rows of one merged parameter. ``tp_size`` is 1: tensor parallelism adds the rank's slice
in these loaders, and quantized formats add linear methods, without touching the models.

Shapes: ``x`` ``[T, input_size]`` -> ``[T, output_size]``; ``weight`` ``[output_size,
input_size]`` (rows of merged layers: q | k | v, gate | up); ``bias`` ``[output_size]`` or ``None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.utils import FastModule, copy_checked, set_weight_attrs


class LinearMethodBase(ABC):
    """How a linear layer keeps its weights and multiplies by them (vLLM's ``LinearMethodBase``)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        """Register ``weight`` ``[sum(output_partition_sizes), input_size]`` and ``bias`` (or
        ``None``) on ``layer``, uninitialised, each with the layer's ``weight_loader``."""
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader})
        layer.register_parameter("weight", weight)
        if bias:
            b = nn.Parameter(torch.empty(rows, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(b, {"weight_loader": layer.weight_loader})
            layer.register_parameter("bias", b)
        else:
            layer.register_parameter("bias", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Derive what :meth:`apply` reads from the loaded parameters (nothing here)."""
        return None

    def restore_weights(self, layer: nn.Module) -> None:
        """Undo :meth:`process_weights_after_loading`: the parameters hold the loaded values
        again (to be loaded into, or processed by another method); derived copies are dropped."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``: ``[T, input_size]`` -> ``[T, output_size]`` in the weight's dtype."""

    def apply_act(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                  act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act_fn(apply(layer, x, bias))``; a method may fuse the activation into the matmul."""
        return act_fn(self.apply(layer, x, bias))

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The LM head's ``x @ weight.T`` ``[N, vocab]``: in the weight's dtype, or float32
        where the method computes that directly (the LM head then refines nothing)."""
        return self.apply(layer, x)


class UnquantizedLinearMethod(LinearMethodBase):
    """``F.linear`` on the parameters.

    ``input_major`` (float32 on CPU): every weight is kept as the transposed view of a
    contiguous ``[in, out]`` copy. MKL's SGEMV streams that layout about twice as fast for
    one-row inputs, larger batches run at the same speed, and an embedding lookup from the
    strided table costs a few microseconds per token. Values are unchanged; matmul summation
    order differs from the row-major layout by float32 rounding (~1e-6 relative).
    """

    def __init__(self, input_major: bool = False) -> None:
        self.input_major = input_major

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.input_major:  # idempotent: a reload copies into the strided view
            layer.weight.data = layer.weight.data.t().contiguous().t()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class LinearBase(FastModule):
    """A linear layer ``y = x W^T + b`` whose parameters and matmul belong to ``quant_method``.

    Args:
        input_size / output_size: ``W`` is ``[output_size, input_size]``.
        bias: whether there is a ``b``.
        params_dtype: the parameters' dtype (default: torch's default dtype).
        quant_method: a :class:`LinearMethodBase` (default :class:`UnquantizedLinearMethod`).
        output_partition_sizes: rows of each merged shard (default ``[output_size]``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, quant_method: LinearMethodBase | None = None,
                 output_partition_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.output_partition_sizes = output_partition_sizes or [output_size]
        self.tp_size = 1  # tensor parallelism: the weight loaders take the rank's slice when it comes
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes, self.params_dtype, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """The whole checkpoint tensor into ``param`` (ValueError on a shape mismatch)."""
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, input_size] -> [T, output_size]
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output rows split over the tensor-parallel ranks (one rank today: the whole weight)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input stacked into one matmul (``gate_up_proj``:
    rows gate | up); checkpoint shard ``i`` holds the rows of ``output_sizes[i]``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None, quant_method: LinearMethodBase | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, params_dtype, quant_method, list(output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """Shard ``loaded_shard_id`` (0, 1, ...) into its rows; ``None``: an already merged tensor."""
        if loaded_shard_id is None:
            return copy_checked(param.data, loaded_weight)
        sizes = self.output_partition_sizes
        copy_checked(param.data.narrow(0, sum(sizes[:loaded_shard_id]), sizes[loaded_shard_id]), loaded_weight)

    def forward_act(self, x: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act_fn(self(x))``, fused where the linear method can (``[T, input_size]`` -> act_fn's output)."""
        return self.quant_method.apply_act(self, x, self.bias, act_fn)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections of attention in one matmul: rows q | k | v, i.e.
    ``[(num_heads + 2 num_kv_heads) head_size, hidden_size]``; checkpoint shards ``"q"``,
    ``"k"``, ``"v"``."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, params_dtype: torch.dtype | None = None,
                 quant_method: LinearMethodBase | None = None) -> None:
        num_kv_heads = total_num_kv_heads or total_num_heads
        q_size, kv_size = total_num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, params_dtype, quant_method,
                         [q_size, kv_size, kv_size])
        self.head_size, self.num_heads, self.num_kv_heads = head_size, total_num_heads, num_kv_heads
        self.q_size, self.kv_size = q_size, kv_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """Shard ``"q"``, ``"k"`` or ``"v"`` into its rows; ``None``: an already merged tensor."""
        if loaded_shard_id is None:
            return copy_checked(param.data, loaded_weight)
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[loaded_shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight)


class RowParallelLinear(LinearBase):
    """Input columns split over the tensor-parallel ranks, partial outputs summed (one rank
    today: the whole weight, nothing to sum)."""
