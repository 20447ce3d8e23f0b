"""What every quantization method shares: its config, its linear method's base, and the weight
loader that puts a checkpoint's quantized tensors into a (tensor-parallel) layer.

A :class:`QuantizationConfig` is read from ``config.json``'s ``quantization_config`` (vLLM's
``QuantizationConfig``; a GGUF file's from its header: ``gguf/config.py``);
:meth:`QuantizationConfig.linear_method` gives the
:class:`QuantizedLinearMethod` of one linear layer (or ``None``: that layer is not quantized,
e.g. one in compressed-tensors' ``ignore`` list). A quantized layer keeps its method for good:
``layers/selection.py`` gives the kernel choice (oneDNN, panels, ...) only to the others.

Quantized parameters say which of their dims runs along the layer's output and input, and how
many output / input elements one index along it covers (:func:`quant_param`): ``8`` for int4
values packed 8 to an int32, ``group_size`` for a group's scale, ``1`` for plain rows.
:func:`quantized_weight_loader` uses that to take a column-parallel rank's output rows (each
merged shard's) and a row-parallel rank's input rows, and refuses a split that would cut a packed
int32 or a quantization group (ValueError naming the sizes).
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from services.executor.layers.linear import ColumnParallelLinear, LinearMethodBase, RowParallelLinear
from services.executor.layers.utils import copy_checked, narrow_checked, set_weight_attrs


class QuantizationConfig:
    """One checkpoint's ``quantization_config`` (a subclass per method), or a GGUF file's block
    formats (``gguf/``). The models ask it for each layer's method when they build the layer:
    :meth:`linear_method` for the decoder's linear layers, :meth:`moe_method` for a ``FusedMoE``'s
    experts, :meth:`layer_method` for the layers a checkpoint's quantization leaves unquantized."""

    name: ClassVar[str]  # the quant_method name, as vLLM's --quantization takes it
    #: read from config.json's quantization_config (False: a GGUF file's formats, which quantize
    #: every GGUF-served architecture and which the all-layers C call reads)
    from_checkpoint: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse ``quantization_config``. Raises ValueError naming what is not supported."""

    @abstractmethod
    def linear_method(self, prefix: str, shard_names: list[str]) -> LinearMethodBase | None:
        """The method of the linear layer named ``prefix`` (checkpoint names, e.g.
        ``model.layers.0.self_attn.qkv_proj``) whose checkpoint shards are ``shard_names``
        (``q_proj``, ``k_proj``, ``v_proj``); ``None``: the layer is not quantized."""

    def moe_method(self, prefix: str) -> Any | None:
        """The method of the ``FusedMoE`` named ``prefix`` (e.g. ``model.layers.0.mlp.experts``);
        ``None``: unquantized experts (every checkpoint method here)."""
        return None

    def layer_method(self, prefix: str) -> LinearMethodBase | None:
        """The method of a layer that checkpoint quantization leaves in the model's dtype (the
        embedding, the LM head, a MoE router or gate); ``None`` (every checkpoint method here)."""
        return None


class QuantizedLinearMethod(LinearMethodBase):
    """A linear method that owns the layer's checkpoint format: never swapped for the kernel
    choice (``layers/selection.py``), processed once after each load.

    A subclass registers the checkpoint's tensors in :meth:`create_weights` (:func:`quant_param`)
    and implements :meth:`apply_checkpoint` (the torch path on them); it may derive another form
    in :meth:`derive` (the kernel's layout), which then replaces the checkpoint tensors: their
    storage is freed, so the weights are held once. :meth:`restore_weights` gives back empty
    parameters of the checkpoint's shapes to load into (the values are the next load's)."""

    quantized = True  # only this method reads the layer's weights (LinearMethodBase.quantized)

    def derive(self, layer: nn.Module) -> Any:
        """What :meth:`apply_derived` reads, built from the loaded parameters (None: keep them)."""
        return None

    def apply_derived(self, layer: nn.Module, derived: Any, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @abstractmethod
    def apply_checkpoint(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` from the checkpoint's tensors, ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "quant_derived", None) is not None:
            return  # already derived from this load
        derived = self.derive(layer)
        if derived is not None:  # the checkpoint's tensors are not read again: free them
            layer.quant_shapes = {}
            for name, param in layer.named_parameters(recurse=False):
                if getattr(param, "output_dim", False) is not False:  # a quant_param
                    layer.quant_shapes[name] = tuple(param.shape)
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        layer.quant_derived = derived

    def restore_weights(self, layer: nn.Module) -> None:
        if getattr(layer, "quant_derived", None) is None:
            return
        for name, shape in layer.quant_shapes.items():
            param = getattr(layer, name)
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        layer.quant_derived = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        derived = getattr(layer, "quant_derived", None)
        if derived is not None:
            return self.apply_derived(layer, derived, x, bias)
        return self.apply_checkpoint(layer, x, bias)


def quant_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, *,
                output_dim: int | None = None, output_pack: int = 1, input_dim: int | None = None,
                input_pack: int = 1, shard_dim: int | None = None) -> nn.Parameter:
    """Register parameter ``name`` on ``layer`` (uninitialised) with :func:`quantized_weight_loader`.

    ``output_dim`` / ``input_dim``: its dim along the layer's output / input (None: not split
    along it), each index covering ``output_pack`` / ``input_pack`` elements. ``shard_dim``: a
    dim with one entry per merged shard (a per-tensor scale of q, k and v)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, {"output_dim": output_dim, "output_pack": output_pack, "input_dim": input_dim,
                             "input_pack": input_pack, "shard_dim": shard_dim,
                             "weight_loader": functools.partial(quantized_weight_loader, layer)})
    layer.register_parameter(name, param)
    return param


def _scaled(start: int, size: int, pack: int, what: str) -> tuple[int, int]:
    if start % pack or size % pack:
        raise ValueError(f"{what} [{start}, {start + size}) does not align with {pack} elements per index "
                         "(a packed int32 or a quantization group would be split)")
    return start // pack, size // pack


def quantized_weight_loader(layer: nn.Module, param: nn.Parameter, loaded_weight: torch.Tensor | Any,
                            loaded_shard_id: str | int | None = None) -> None:
    """A checkpoint tensor (or merged shard ``loaded_shard_id``) into ``param``: a column-parallel
    rank's rows of each shard along ``param.output_dim``, a row-parallel rank's input rows along
    ``param.input_dim``; a per-shard entry (``shard_dim``) into its slot.

    Raises:
        ValueError: a shape mismatch, or a rank's range that splits a packed value or a group.
    """
    dst = param.data
    column = isinstance(layer, ColumnParallelLinear)
    if param.shard_dim is not None:  # one entry per merged shard (a per-tensor scale), read whole
        value = loaded_weight if isinstance(loaded_weight, torch.Tensor) else loaded_weight.load()
        indices = [0] if not column else (range(len(layer.output_sizes)) if loaded_shard_id is None
                                          else [layer._shard_index(loaded_shard_id)])
        for index in indices:
            slot = dst.select(param.shard_dim, index)
            if value.numel() != slot.numel():
                raise ValueError(f"checkpoint shape {tuple(value.shape)} != expected {tuple(slot.shape)}")
            slot.copy_(value.reshape(slot.shape))
        return None
    if param.input_dim is not None and isinstance(layer, RowParallelLinear):
        start, size = _scaled(*layer.input_range, param.input_pack, "this rank's input columns")
        full = layer.full_input_size // param.input_pack
        loaded_weight = narrow_checked(loaded_weight, param.input_dim, start, size, full)
    if not column:
        copy_checked(dst, loaded_weight)
        return None
    indices = range(len(layer.output_sizes)) if loaded_shard_id is None else [layer._shard_index(loaded_shard_id)]
    if param.output_dim is None:  # the same for every shard (g_idx)
        copy_checked(dst, loaded_weight)
        return None
    merged = loaded_shard_id is None  # every shard's rows in one checkpoint tensor
    whole = sum(layer.output_sizes) if merged else layer.output_sizes[indices[0]]
    for index in indices:
        start, size = layer.row_ranges[index]
        offset = sum(s for _, s in layer.row_ranges[:index])
        shard_first = sum(layer.output_sizes[:index]) if merged else 0
        start, size = _scaled(shard_first + start, size, param.output_pack, "this rank's output rows")
        offset, _ = _scaled(offset, 0, param.output_pack, "the shard's output rows")
        copy_checked(dst.narrow(param.output_dim, offset, size),
                     narrow_checked(loaded_weight, param.output_dim, start, size, whole // param.output_pack))
    return None


def full_input_size(layer: nn.Module, input_size: int) -> int:
    """The whole layer's input size (``input_size`` is this rank's part in a row-parallel layer)."""
    return getattr(layer, "full_input_size", input_size)


def check_divisible(value: int, by: int, what: str) -> None:
    """ValueError unless ``by`` divides ``value`` (``what`` names them)."""
    if value % by:
        raise ValueError(f"{what}: {value} is not a multiple of {by}")
