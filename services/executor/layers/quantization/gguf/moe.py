"""A mixture of experts whose experts are GGUF blocks (llama.cpp's ``ffn_gate_exps`` /
``ffn_up_exps`` / ``ffn_down_exps``), kept quantized matmul by matmul: :class:`GGUFMoEMethod`.

llama.cpp stores a MoE layer's experts stacked: gate and up ``[E, I, hidden]``, down ``[E,
hidden, I]`` (rows = output features, each row whole blocks of its input, as a linear layer's).
Expert ``e``'s rows are a plain GGUF weight, so each expert is multiplied by the GGUF matmul of
``linear.py`` (:class:`~services.executor.layers.quantization.gguf.linear.GGUFLinearMethod`: the
native C kernel on CPU, the Triton kernel on CUDA, else dequantize + ``F.linear``): its gate | up
rows in one matmul (each shard's blocks apart, ``GGUFShardedLinearMethod``,
when gate and up come in different formats), SiLU(gate) * up, then down. The tokens are grouped
by expert as ``fused_moe_cpu`` groups them (:func:`~services.executor.layers.fused_moe.experts_weighted_sum`),
so the loop is over the experts that have tokens, with the same rounding as the unquantized path.

Each of the two matmuls is kept on its own (:func:`kept_formats`): gate | up when the gate and up
tensors are both of formats ``formats.py`` keeps, down when its tensor is. A matmul not kept
(llama.cpp's Q4_K_M files of Qwen1.5-MoE write ``ffn_down_exps`` in a 5-bit format not kept)
holds its weight dequantized into the model's dtype and is multiplied by ``F.linear``
(:class:`~services.executor.layers.linear.UnquantizedLinearMethod`). Experts with neither matmul
kept are no business of this method: ``GGUFConfig.moe_method`` gives none, and the loader
dequantizes them into the unquantized method's ``w13`` / ``w2``. The model asks for this method
when it builds the ``FusedMoE`` (its ``quant_method``); the loader hands it the file's experts
(:meth:`GGUFMoEMethod.load`).

The fused Triton MoE kernel (``kernels/triton/fused_moe.py``) takes dense ``w13`` / ``w2`` only:
on CUDA the GGUF experts run as that loop of per-expert matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.fused_moe import FusedMoE, FusedMoEMethodBase, experts_weighted_sum
from services.executor.layers.linear import UnquantizedLinearMethod
from services.executor.layers.quantization.gguf.formats import BlockFormat
from services.executor.layers.quantization.gguf.linear import GGUFLinearMethod, GGUFShardedLinearMethod

Formats = tuple[BlockFormat | None, BlockFormat | None, BlockFormat | None]


def kept_formats(fmts: Formats) -> Formats:
    """The gate, up and down tensors' formats (``None``: a format not kept) as the experts keep
    them: gate and up both ``None`` unless both are kept (they are one matmul), down as it is."""
    gate, up, down = fmts
    return (gate, up, down) if gate is not None and up is not None else (None, None, down)


class GGUFMoEMethod(FusedMoEMethodBase):
    """A :class:`FusedMoE`'s experts, each matmul as GGUF blocks where its formats are kept: each
    expert ``e`` is the sub-module ``moe.gguf_experts[e]`` with ``gate_up`` (rows gate | up,
    ``[2 I_rank, hidden]``) and ``down`` (``[hidden, I_rank]``), each holding its weight and the
    method that multiplies by it (``quant_method``): the blocks with their GGUF linear method, or
    dense values in the model's dtype with ``UnquantizedLinearMethod``.

    ``fmts``: the gate, up and down tensors' formats as :func:`kept_formats` gives them (``None``:
    that matmul is dense); ``dtype``: the model's activation dtype (and the dense weights';
    default: the ``FusedMoE``'s ``params_dtype``); ``native``: the C kernels may serve small row
    counts on CPU (as ``GGUFLinearMethod``; the loader sets it).

    Raises:
        ValueError: ``fmts`` keeps neither matmul, or gate | up only in part.
    """

    quantized = True

    def __init__(self, fmts: Formats, dtype: torch.dtype | None = None, native: bool = False) -> None:
        if kept_formats(fmts) != tuple(fmts) or all(f is None for f in fmts):
            raise ValueError(f"GGUF experts of formats {[f and f.name for f in fmts]}: each of gate | up and down "
                             f"is kept whole or not, and one of them must be (else dense w13 / w2)")
        self.fmts, self.dtype, self.native = tuple(fmts), dtype, native

    def create_weights(self, moe: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Empty ``w13`` / ``w2`` in ``params_dtype``: the experts come at :meth:`load`."""
        self.dtype = self.dtype or params_dtype
        empty = torch.empty(0, dtype=params_dtype)
        moe.register_parameter("w13", nn.Parameter(empty, requires_grad=False))
        moe.register_parameter("w2", nn.Parameter(empty.clone(), requires_grad=False))

    def load(self, moe: FusedMoE, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, native: bool) -> None:
        """The file's experts at load (this rank's part, as :meth:`install` takes them);
        ``native``: as the constructor's.

        Raises:
            ValueError: as :meth:`install`.
        """
        self.native = native
        self.install(moe, gate, up, down)

    def install(self, moe: FusedMoE, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Make the tensors ``moe``'s experts, replacing its dense ``w13`` / ``w2`` (left empty).

        Args:
            gate / up: this rank's rows, ``[E, I_rank, hidden / block_size * block_bytes]`` uint8
                blocks, or (gate | up dense) ``[E, I_rank, hidden]`` values.
            down: this rank's columns, ``[E, hidden, I_rank / block_size * block_bytes]`` uint8
                blocks, or (down dense) ``[E, hidden, I_rank]`` values.

        Raises:
            ValueError: a tensor that is not ``E`` experts of whole rows of the expected sizes.
        """
        experts, inter, hidden = moe.num_experts, moe.intermediate_range[1], moe.hidden_size
        for name, t, rows in (("gate", gate, inter), ("up", up, inter), ("down", down, hidden)):
            if t.dim() != 3 or t.shape[0] != experts or t.shape[1] != rows:
                raise ValueError(f"GGUF {name} experts {tuple(t.shape)} are not {experts} experts of {rows} rows")
        gate_fmt, up_fmt, down_fmt = self.fmts
        # the dense matmuls' weights: [E, 2 I_rank, hidden], [E, hidden, I_rank] in the model's dtype
        w13 = self._dense(torch.cat((gate, up), dim=1), hidden, "gate | up") if gate_fmt is None else None
        w2 = self._dense(down, inter, "down") if down_fmt is None else None
        moe.gguf_experts = nn.ModuleList()
        for e in range(experts):
            expert = nn.Module()
            expert.gate_up, expert.down = nn.Module(), nn.Module()
            if w13 is not None:
                _install_dense(expert.gate_up, w13[e])
            elif gate_fmt == up_fmt:
                blocks = torch.cat((gate[e], up[e]))  # [2 I_rank, ...]: gate rows | up rows
                GGUFLinearMethod(gate_fmt, self.dtype, self.native).install(expert.gate_up, blocks, hidden)
            else:
                GGUFShardedLinearMethod([gate_fmt, up_fmt], self.dtype, self.native).install(
                    expert.gate_up, [gate[e].clone(), up[e].clone()], hidden)
            if w2 is not None:
                _install_dense(expert.down, w2[e])
            else:
                GGUFLinearMethod(down_fmt, self.dtype, self.native).install(expert.down, down[e].clone(), inter)
            moe.gguf_experts.append(expert)
        empty = torch.empty(0, dtype=moe.w13.dtype)
        moe.w13 = nn.Parameter(empty, requires_grad=False)
        moe.w2 = nn.Parameter(empty.clone(), requires_grad=False)
        moe.quant_method = self

    def _dense(self, values: torch.Tensor, columns: int, name: str) -> torch.Tensor:  # [E, rows, columns] dtype
        if not values.is_floating_point() or values.shape[2] != columns:
            raise ValueError(f"dense GGUF {name} experts {tuple(values.shape)} {values.dtype} are not rows of "
                             f"{columns} values")
        return values.to(self.dtype)

    def weights(self, moe: FusedMoE, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts dequantized (the dense ones as held): ``w13 [E, 2 I_rank, hidden]`` and ``w2
        [E, hidden, I_rank]`` in ``dtype`` (for checks: serving multiplies the blocks)."""
        return (torch.stack([_dequantized(e.gate_up, dtype) for e in moe.gguf_experts]),
                torch.stack([_dequantized(e.down, dtype) for e in moe.gguf_experts]))

    def apply(self, moe: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])`` (this rank's
        partial sum): ``[T, hidden]``, ``[T, K]``, ``[T, K]`` -> ``[T, hidden]`` in ``hidden_states``' dtype."""
        inter = moe.intermediate_range[1]

        def expert(e: int, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
            gate_up = moe.gguf_experts[e].gate_up
            h = gate_up.quant_method.apply(gate_up, x)  # [n, 2 I_rank]
            act = F.silu(h[:, :inter]).mul_(h[:, inter:])  # [n, I_rank]
            down = moe.gguf_experts[e].down
            return down.quant_method.apply(down, act)

        return experts_weighted_sum(hidden_states, topk_weights, topk_ids, moe.num_experts, expert)


def _install_dense(layer: nn.Module, weight: torch.Tensor) -> None:  # weight [N, K] in the model's dtype
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.quant_method = UnquantizedLinearMethod()


def _dequantized(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [N, K] dtype
    method = layer.quant_method
    if isinstance(method, GGUFShardedLinearMethod):
        return torch.cat([m.weight(part, dtype) for m, part in zip(method.parts, layer.gguf_shards, strict=True)])
    if isinstance(method, GGUFLinearMethod):
        return method.weight(layer, dtype)
    return layer.weight.to(dtype)  # dense
