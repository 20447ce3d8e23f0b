"""Which kernels serve a model: one strategy, decided once at load time (:func:`select_kernels`).

The decision covers every place where the CPU fast path changes how a step is computed:

- the linear method of the decoder's matmuls and of the LM head:
  :class:`~services.executor.layers.cpu.panels.PanelLinearMethod` (bf16 on a CPU where
  :func:`kernels.cpu.ops.prefer_native_gemm`, native kernels on), else
  :class:`~services.executor.layers.cpu.onednn.OneDNNLinearMethod` (bf16 on a CPU with oneDNN
  bf16), else :class:`~services.executor.layers.cpu.onednn.GemvLinearMethod` (bf16/fp16 on
  CPU), else :class:`~services.executor.layers.linear.UnquantizedLinearMethod` (input-major
  weights in float32 on CPU);
- the embedding table's method: the plain one (input-major in float32 on CPU, which also
  serves a tied LM head);
- the RMSNorm forms (``layers/layernorm.py``): ``"native"`` (bf16 on CPU, native kernels on,
  the library loads), else ``"layer_norm"`` in bf16/fp16 (the decoder layers' norms take
  ``"torch"`` where the panels serve the matmuls), else ``"torch"``;
- whether one-row decoder passes may run on torch's GEMV (CPU, bf16/fp16), and whether every
  decoder layer may run in one C call (the panels serve: ``layers/cpu/native_layers.py``); the
  model runner uses both per step (``services/executor/forward_pass.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.cpu import ops
from services.executor.layers.cpu.onednn import GemvLinearMethod, OneDNNLinearMethod, mkldnn_packing_supported
from services.executor.layers.cpu.panels import PanelLinearMethod
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.layernorm import NormForm
from services.executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from services.executor.layers.quantization.base import QuantizedLinearMethod


@dataclass(frozen=True)
class KernelChoice:
    """What :func:`select_kernels` decided for one model."""

    linear_method: LinearMethodBase  # every LinearBase and the LM head
    embedding_method: LinearMethodBase  # the embedding table
    layer_norm_form: NormForm  # the decoder layers' RMSNorms
    final_norm_form: NormForm  # the final RMSNorm
    single_row_gemv: bool  # one-row decoder passes under reduced_precision_gemv

    @property
    def native_matmuls(self) -> bool:
        """The native bf16-weight GEMM serves every matmul (and so NativeLayers may run)."""
        return isinstance(self.linear_method, PanelLinearMethod)

    @property
    def native_norms(self) -> bool:
        """The C kernel serves every RMSNorm."""
        return self.final_norm_form == "native"


def select_kernels(dtype: torch.dtype, device: torch.device, native_norms: bool = False,
                   native_matmuls: bool = False, onednn: bool = True) -> KernelChoice:
    """The kernels for a model of ``dtype`` on ``device``. ``native_norms`` / ``native_matmuls``
    allow the C norms / the native GEMM (``Settings.native_cpu_kernels``), used where they
    apply (bf16 on CPU, the library builds, and for the GEMM :func:`kernels.cpu.ops.prefer_native_gemm`);
    ``onednn=False`` keeps oneDNN's prepacked copies off (``F.linear`` on the parameters, for comparisons)."""
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    reduced = dtype in (torch.bfloat16, torch.float16)
    native_norms = native_norms and cpu_bf16 and ops.load() is not None
    if native_matmuls and cpu_bf16 and ops.prefer_native_gemm():
        linear: LinearMethodBase = PanelLinearMethod()
    elif onednn and mkldnn_packing_supported(device, dtype):
        linear = OneDNNLinearMethod()
    elif device.type == "cpu" and reduced:
        linear = GemvLinearMethod()
    else:
        linear = UnquantizedLinearMethod(input_major=device.type == "cpu" and dtype == torch.float32)
    final: NormForm = "native" if native_norms else "layer_norm" if reduced else "torch"
    in_layers: NormForm = "torch" if final == "layer_norm" and isinstance(linear, PanelLinearMethod) else final
    return KernelChoice(
        linear_method=linear,
        embedding_method=UnquantizedLinearMethod(input_major=device.type == "cpu" and dtype == torch.float32),
        layer_norm_form=in_layers,
        final_norm_form=final,
        single_row_gemv=device.type == "cpu" and reduced,
    )


def use_linear_method(layer: nn.Module, method: LinearMethodBase) -> None:
    """Multiply ``layer``'s loaded weights with ``method`` from now on: the old method's
    derived copies are dropped (the parameters hold their values), the new one processes them.
    A layer whose weights are quantized keeps its method (only that method reads them)."""
    if layer.quant_method.quantized:
        return
    layer.quant_method.restore_weights(layer)
    layer.quant_method = method
    method.process_weights_after_loading(layer)


def use_linear_methods(model: nn.Module, kernels: KernelChoice) -> None:
    """:func:`use_linear_method` on every linear layer, LM head and embedding of ``model``; a
    quantized layer keeps its method (``layers/quantization/``), which processes its weights once."""
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(module.quant_method, QuantizedLinearMethod):
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, LinearBase | ParallelLMHead):
            use_linear_method(module, kernels.linear_method)
        elif isinstance(module, VocabParallelEmbedding):
            use_linear_method(module, kernels.embedding_method)


def restore_weights(model: nn.Module) -> None:
    """Every layer's parameters back to their loaded values, derived copies dropped (before a reload)."""
    for module in model.modules():
        if isinstance(module, LinearBase | VocabParallelEmbedding):
            module.quant_method.restore_weights(module)


class KernelSwitches:
    """A model's switches over :func:`select_kernels` (mixed into the model classes).

    The model keeps ``kernel_request`` (the keyword arguments of :func:`select_kernels` it was
    built with), ``kernels`` (the current :class:`KernelChoice`), ``dtype`` and ``device``, and
    implements ``use_kernels(kernels)``, which puts a choice to work on its layers.
    """

    kernel_request: dict[str, bool]
    kernels: KernelChoice
    dtype: torch.dtype
    device: torch.device

    def use_kernels(self, kernels: KernelChoice) -> None:
        raise NotImplementedError

    @property
    def native_norms(self) -> bool:
        """Every RMSNorm runs in the C kernel."""
        return self.kernels.native_norms

    @property
    def native_matmuls(self) -> bool:
        """Every matmul runs in the native bf16-weight GEMM."""
        return self.kernels.native_matmuls

    def select_kernels(self, **request: bool) -> None:
        """Decide the kernels again with ``request`` changed (``native_norms``,
        ``native_matmuls``, ``onednn``: the arguments of :func:`select_kernels`) and use them."""
        self.kernel_request.update(request)
        self.use_kernels(select_kernels(self.dtype, self.device, **self.kernel_request))

    def use_native_norms(self, enabled: bool) -> bool:
        """Allow the C norms (with the attention residual add fused); returns whether they serve."""
        self.select_kernels(native_norms=enabled)
        return self.native_norms

    def use_native_matmuls(self, enabled: bool) -> bool:
        """Allow the native bf16-weight GEMM; returns whether it serves every matmul."""
        self.select_kernels(native_matmuls=enabled)
        return self.native_matmuls

    def unpack_weights(self) -> None:
        """Every matmul as ``F.linear`` on the parameters (no oneDNN copies, no panels): for comparisons."""
        self.select_kernels(native_matmuls=False, onednn=False)

    def process_weights_after_loading(self) -> None:
        """Derive the selected kernels' weight forms (oneDNN copies allowed again) from the
        parameters: after loading, and again after changing weights in place."""
        self.select_kernels(onednn=True)
