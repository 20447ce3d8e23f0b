"""bf16 / fp16 matmuls on CPU through torch: oneDNN on prepacked weights, torch's GEMV for one row.

:class:`GemvLinearMethod` multiplies the parameters with ``F.linear``, one row at a time on
torch's reduced-precision GEMV (:func:`reduced_precision_gemv`); :class:`OneDNNLinearMethod`
adds, for steps of several rows, weights reordered once into oneDNN's blocked layout with SiLU
and the gate * up product as epilogues of the MLP's matmuls. Measurements behind these
choices: ``benchmarks/RESULTS.md``, "Figures moved out of the code".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.activation import SiluAndMul
from services.executor.layers.linear import MergedColumnParallelLinear, UnquantizedLinearMethod

_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
_linear_binary = torch.ops.mkldnn._linear_pointwise.binary


@contextlib.contextmanager
def reduced_precision_gemv(active: bool) -> Iterator[None]:
    """Route bf16/fp16 ``[1, K] x [K, N]`` matmuls on CPU to torch's GEMV kernel instead of oneDNN.

    For a single row the weights stream from DRAM and torch's reduced-precision GEMV (fp32
    accumulation, same result bit for bit in our measurements) streams them fastest, faster
    than oneDNN on plain or prepacked weights (which win only while the weights sit in cache).
    The switch (``torch._C._set_mkldnn_enabled``) is process-global, so it is set only for the
    duration of a single-row forward pass or LM head.
    """
    if not active:
        yield
        return
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


def mkldnn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`OneDNNLinearMethod` can serve this device and dtype (CPU bfloat16 with oneDNN)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class GemvLinearMethod(UnquantizedLinearMethod):
    """``F.linear`` on the parameters; a one-row LM head on torch's GEMV (bf16/fp16 on CPU;
    the model runs a one-row decoder pass under :func:`reduced_precision_gemv` too)."""

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with reduced_precision_gemv(x.shape[0] == 1):
            return F.linear(x, layer.weight)


class OneDNNLinearMethod(GemvLinearMethod):
    """bf16 weights ``[out, in]`` also reordered once into oneDNN's blocked layout (CPU).

    ``F.linear`` on a plain bf16 weight makes oneDNN reorder (re-block) the whole weight on
    every call; :func:`torch.ops.mkldnn._reorder_linear_weight` does it once after loading and
    ``torch.ops.mkldnn._linear_pointwise`` then runs the same GEMM kernels on the prepacked copy
    (what inductor's CPU weight prepacking uses), with optional fused epilogues. Results equal
    ``F.linear`` bit for bit in our measurements. Steps of several rows use the copies; one
    row multiplies the parameters (GEMV), which the copies sit next to, not instead of. A
    merged gate | up layer keeps gate and up apart, for :meth:`apply_act`.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w, b = layer.weight.detach(), layer.bias
        if isinstance(layer, MergedColumnParallelLinear):
            sizes = layer.output_partition_sizes
            layer.packed = None
            layer.packed_parts = [torch.ops.mkldnn._reorder_linear_weight(p.contiguous()) for p in w.split(sizes)]
            layer.packed_biases = [None] * len(sizes) if b is None else [p.contiguous() for p in b.split(sizes)]
        else:
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
            layer.packed_parts = layer.packed_biases = None

    def restore_weights(self, layer: nn.Module) -> None:
        layer.packed = layer.packed_parts = layer.packed_biases = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > 1 and layer.packed is not None:
            return _linear_pointwise(x, layer.packed, bias, "none", [], "")
        return F.linear(x, layer.weight, bias)

    def apply_act(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                  act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``silu(x Wg^T) * (x Wu^T)`` with SiLU and the product as epilogues of the gate and up
        matmuls (several rows): two fewer passes over ``[T, I]`` than a gate_up matmul,
        ``F.silu`` and a multiply. The epilogues work on the float32 accumulator, so gate and
        up skip HF's intermediate bf16 roundings (closer to float32, not to HF bf16)."""
        if x.shape[0] > 1 and layer.packed_parts is not None and isinstance(act_fn, SiluAndMul):
            (gate, up), (gate_bias, up_bias) = layer.packed_parts, layer.packed_biases
            act = _linear_pointwise(x, gate, gate_bias, "swish", [], "")  # silu(gate) [T, I]
            return _linear_binary(x, act, up, up_bias, "mul")  # up * silu(gate) [T, I]
        return act_fn(self.apply(layer, x, bias))

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            return _linear_pointwise(x.contiguous(), layer.packed, None, "none", [], "")
        return super().apply_logits(layer, x)
