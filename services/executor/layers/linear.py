"""Linear layers with the field's names (vLLM / nano-vllm), and the linear method behind each one.

A layer (``ReplicatedLinear``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``GroupedQKVParallelLinear``, ``RowParallelLinear``) holds its
parameters and hands the matmul to its *linear method* (vLLM's ``LinearMethodBase``):
``create_weights`` registers the parameters, ``process_weights_after_loading`` derives what
``apply`` reads (a packed copy, another layout), ``restore_weights`` undoes that,
``apply(layer, x, bias)`` multiplies. The plain
method here is :class:`UnquantizedLinearMethod`; the CPU ones (oneDNN-prepacked, native-GEMM
panels) are in ``layers/cpu/``, and ``layers/selection.py`` picks one per model at load time.

Every parameter carries ``weight_loader(param, loaded_weight, loaded_shard_id=None)``, which
knows where a checkpoint tensor goes: the shards ``"q"``, ``"k"``, ``"v"`` of
:class:`QKVParallelLinear` and ``0``, ``1`` (gate, up) of :class:`MergedColumnParallelLinear`
are rows of one merged parameter.

Tensor parallelism (vLLM's semantics) is in the layers and their loaders, so the models do not
see it: a layer built under a :class:`~services.executor.parallel.group.TensorParallelGroup`
(``use_tp_group``) holds only its rank's part and each loader reads only that slice of the
checkpoint tensor (``narrow_checked``). Column-parallel layers split their output rows (q/k/v
by the rank's heads, ``parallel/partition.py``), row-parallel layers their input columns and
sum the partial outputs with an all-reduce (the bias added once, after it). Quantized formats
add linear methods, likewise without touching the models.

Shapes (per rank): ``x`` ``[T, input_size_per_partition]`` -> ``[T, output_size_per_partition]``;
``weight`` ``[output_size_per_partition, input_size_per_partition]`` (rows of merged layers:
q | k | v, gate | up); ``bias`` ``[output_size_per_partition]`` or ``None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.utils import FastModule, copy_checked, narrow_checked, set_weight_attrs
from services.executor.parallel.group import current_tp_group
from services.executor.parallel.partition import HeadShard, attention_heads, balanced_range


class LinearMethodBase(ABC):
    """How a linear layer keeps its weights and multiplies by them (vLLM's ``LinearMethodBase``).

    ``quantized``: the weights are held in a quantized form that only this method reads (a
    checkpoint's quantized tensors, GGUF blocks: ``layers/quantization/``); the kernel choice of
    ``layers/selection.py`` leaves it in place."""

    quantized = False

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        """Register ``weight`` ``[sum(output_partition_sizes), input_size]`` and ``bias`` (or
        ``None``) on ``layer``, uninitialised, each with the layer's ``weight_loader``."""
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader})
        layer.register_parameter("weight", weight)
        self.register_bias(layer, rows, params_dtype, bias)

    def register_bias(self, layer: nn.Module, rows: int, params_dtype: torch.dtype, bias: bool) -> None:
        """``bias`` ``[rows]`` in ``params_dtype`` with the layer's own loader (or ``None``): every
        method's bias is the unquantized layer's."""
        if not bias:
            layer.register_parameter("bias", None)
            return
        b = nn.Parameter(torch.empty(rows, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(b, {"weight_loader": layer.weight_loader})
        layer.register_parameter("bias", b)

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

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        """An embedding table's rows ``weight[input_ids]``."""
        return F.embedding(input_ids, layer.weight)


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
        input_size / output_size: this rank's ``W`` is ``[output_size, input_size]`` (a
            parallel subclass passes its partition's sizes).
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
        self.tp = current_tp_group()
        self.tp_size, self.tp_rank = self.tp.world_size, self.tp.rank
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
    """Output rows split over the tensor-parallel ranks (balanced ranges); each rank's output is
    its own rows (``[T, output_size_per_partition]``), the input is whole on every rank.

    ``row_ranges``: each merged shard's ``(start, size)`` in the checkpoint's rows, for this
    rank (default: a balanced range of each of ``output_sizes``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, quant_method: LinearMethodBase | None = None,
                 output_sizes: list[int] | None = None,
                 row_ranges: list[tuple[int, int]] | None = None) -> None:
        tp = current_tp_group()
        self.output_sizes = list(output_sizes or [output_size])  # whole (checkpoint) rows of each shard
        self.row_ranges = row_ranges or [balanced_range(n, tp.world_size, tp.rank) for n in self.output_sizes]
        sizes = [size for _, size in self.row_ranges]
        super().__init__(input_size, sum(sizes), bias, params_dtype, quant_method, sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """Shard ``loaded_shard_id`` (its index in ``output_sizes``; ``None``: an already merged
        tensor, split into its shards here): this rank's rows of it into this shard's rows."""
        if loaded_shard_id is None:
            whole = sum(self.output_sizes)
            if not loaded_weight.shape or loaded_weight.shape[0] != whole:
                raise ValueError(f"checkpoint shape {tuple(loaded_weight.shape)} != expected {whole} rows")
            for index in range(len(self.output_sizes)):  # this rank's rows of each shard, read alone
                self._load_shard(param, loaded_weight, index, sum(self.output_sizes[:index]), whole)
            return None
        index = self._shard_index(loaded_shard_id)
        return self._load_shard(param, loaded_weight, index, 0, self.output_sizes[index])

    def _shard_index(self, loaded_shard_id: str | int) -> int:
        return int(loaded_shard_id)

    def _load_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, index: int, first_row: int,
                    rows: int) -> None:
        """This rank's rows of shard ``index``, which starts at row ``first_row`` of the
        ``rows``-row checkpoint tensor, into this shard's rows of ``param``."""
        start, size = self.row_ranges[index]
        offset = sum(s for _, s in self.row_ranges[:index])
        copy_checked(param.data.narrow(0, offset, size),
                     narrow_checked(loaded_weight, 0, first_row + start, size, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input stacked into one matmul (``gate_up_proj``:
    rows gate | up, each split over the ranks); checkpoint shard ``i`` holds the rows of
    ``output_sizes[i]``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None, quant_method: LinearMethodBase | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, params_dtype, quant_method, list(output_sizes))

    def forward_act(self, x: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act_fn(self(x))``, fused where the linear method can (``[T, input_size]`` -> act_fn's output)."""
        return self.quant_method.apply_act(self, x, self.bias, act_fn)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections of attention in one matmul: rows q | k | v of this rank's
    heads (:func:`~services.executor.parallel.partition.attention_heads`), i.e.
    ``[(num_heads + 2 num_kv_heads) head_size, hidden_size]`` per rank; checkpoint shards
    ``"q"``, ``"k"``, ``"v"``. ``num_heads`` / ``num_kv_heads`` are this rank's.

    Raises:
        ValueError: the heads cannot be split over the group's ranks (the numbers named).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, params_dtype: torch.dtype | None = None,
                 quant_method: LinearMethodBase | None = None) -> None:
        tp = current_tp_group()
        total_kv = total_num_kv_heads or total_num_heads
        shard = attention_heads(total_num_heads, total_kv, tp.world_size, tp.rank)
        kv_range = (shard.kv_start * head_size, shard.num_kv_heads * head_size)
        super().__init__(hidden_size, 0, bias, params_dtype, quant_method,
                         [total_num_heads * head_size, total_kv * head_size, total_kv * head_size],
                         [(shard.q_start * head_size, shard.num_heads * head_size), kv_range, kv_range])
        self.head_shard: HeadShard = shard
        self.head_size, self.num_heads, self.num_kv_heads = head_size, shard.num_heads, shard.num_kv_heads
        self.q_size, self.kv_size = shard.num_heads * head_size, shard.num_kv_heads * head_size

    def _shard_index(self, loaded_shard_id: str | int) -> int:
        return {"q": 0, "k": 1, "v": 2}[loaded_shard_id]


class GroupedQKVParallelLinear(QKVParallelLinear):
    """A :class:`QKVParallelLinear` loaded from one fused checkpoint tensor whose rows are laid
    out per KV group, ``[num_kv_heads, q_per_kv + 2, head_size]``: each KV head's query heads,
    then its key, then its value (Falcon's ``query_key_value``; GPT-NeoX's and the older
    Falcon's ``[num_heads, 3, head_size]`` are the case ``q_per_kv = 1``, multi-query Falcon's
    ``[num_heads + 2, head_size]`` the case of one KV group). The loader reads this rank's KV
    groups (a replicated KV head: its whole group) and stores their rows as q | k | v of this
    rank's heads, as :class:`QKVParallelLinear` computes."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """The fused weight ``[(H + 2 Hkv) D, hidden]`` (or bias ``[(H + 2 Hkv) D]``): this rank's
        groups, de-interleaved into ``param``'s rows q | k | v (ValueError on a shape mismatch)."""
        if loaded_shard_id is not None:
            return super().weight_loader(param, loaded_weight, loaded_shard_id)
        shard, d = self.head_shard, self.head_size
        total_kv, total_q = self.output_sizes[1] // d, self.output_sizes[0] // d
        group = total_q // total_kv + 2  # rows of heads in a KV group: its queries, k, v
        rows = narrow_checked(loaded_weight, 0, shard.kv_start * group * d, shard.num_kv_heads * group * d,
                              total_kv * group * d)
        rows = rows.view(shard.num_kv_heads, group, d, *rows.shape[1:])  # [Hkv_rank, q_per_kv + 2, D, ...]
        q = rows[:, :-2].flatten(0, 2)  # [Hkv_rank q_per_kv D, ...]: every query head of these groups
        q = q.narrow(0, (shard.q_start - shard.kv_start * (group - 2)) * d, shard.num_heads * d)  # this rank's
        copy_checked(param.data, torch.cat((q, rows[:, -2].flatten(0, 1), rows[:, -1].flatten(0, 1))))


class RowParallelLinear(LinearBase):
    """Input columns split over the tensor-parallel ranks, the partial outputs summed with an
    all-reduce; the bias (whole on every rank) is added once, after the sum. The input is this
    rank's columns (``[T, input_size_per_partition]``), the output whole on every rank.

    ``input_range``: this rank's ``(start, size)`` of the input columns, to match the layer
    feeding it (``o_proj`` takes its rank's attention heads); default a balanced range.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, quant_method: LinearMethodBase | None = None,
                 input_range: tuple[int, int] | None = None) -> None:
        tp = current_tp_group()
        self.full_input_size = input_size
        self.input_range = input_range or balanced_range(input_size, tp.world_size, tp.rank)
        super().__init__(self.input_range[1], output_size, bias, params_dtype, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """The weight's columns of this rank (the whole bias) into ``param``."""
        if param.dim() == 2:
            start, size = self.input_range
            loaded_weight = narrow_checked(loaded_weight, 1, start, size, self.full_input_size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, input_size_per_partition] -> [T, output_size]
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = self.tp.all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out.add_(self.bias)
