"""A mixture of experts whose experts are GGUF blocks (llama.cpp's ``ffn_gate_exps`` /
``ffn_up_exps`` / ``ffn_down_exps``), kept quantized: :class:`GGUFMoEMethod`.

llama.cpp stores a MoE layer's experts stacked: gate and up ``[E, I, hidden]``, down ``[E,
hidden, I]`` (rows = output features, each row whole blocks of its input, as a linear layer's).
Expert ``e``'s rows are a plain GGUF weight, so each expert is multiplied by the GGUF matmul of
``layers/gguf.py`` (:class:`~services.executor.layers.gguf.GGUFLinearMethod`: the native C
kernel on CPU, the Triton kernel on CUDA, else dequantize + ``F.linear``): its gate | up rows in
one matmul (each shard's blocks apart, :class:`~services.executor.layers.gguf.GGUFShardedLinearMethod`,
when gate and up come in different formats), SiLU(gate) * up, then down. The tokens are grouped
by expert as ``fused_moe_cpu`` groups them (:func:`~services.executor.layers.fused_moe.experts_weighted_sum`),
so the loop is over the experts that have tokens, with the same rounding as the unquantized path.

The fused Triton MoE kernel (``kernels/triton/fused_moe.py``) takes dense ``w13`` / ``w2`` only:
on CUDA the GGUF experts run as that loop of per-expert GGUF matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.fused_moe import FusedMoE, experts_weighted_sum
from services.executor.layers.gguf import BlockFormat, GGUFLinearMethod, GGUFShardedLinearMethod


class GGUFMoEMethod:
    """A :class:`FusedMoE`'s experts as GGUF blocks: each expert ``e`` is the sub-module
    ``moe.gguf_experts[e]`` with ``gate_up`` (rows gate | up, ``[2 I_rank, hidden]`` as blocks)
    and ``down`` (``[hidden, I_rank]`` as blocks), each holding its GGUF linear method.

    ``fmts``: the gate, up and down tensors' formats; ``dtype``: the model's activation dtype;
    ``native``: the C kernels may serve small row counts on CPU (as ``GGUFLinearMethod``).
    """

    def __init__(self, fmts: tuple[BlockFormat, BlockFormat, BlockFormat], dtype: torch.dtype,
                 native: bool = False) -> None:
        self.fmts, self.dtype, self.native = fmts, dtype, native

    def install(self, moe: FusedMoE, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Make the blocks ``moe``'s experts, replacing its dense ``w13`` / ``w2`` (left empty).

        Args:
            gate / up: ``[E, I_rank, hidden / block_size * block_bytes]`` uint8 (this rank's rows).
            down: ``[E, hidden, I_rank / block_size * block_bytes]`` uint8 (this rank's columns).

        Raises:
            ValueError: a tensor that is not ``E`` experts of whole rows of the expected sizes.
        """
        experts, inter = moe.num_experts, moe.intermediate_range[1]
        for name, t, rows in (("gate", gate, inter), ("up", up, inter), ("down", down, moe.hidden_size)):
            if t.dim() != 3 or t.shape[0] != experts or t.shape[1] != rows:
                raise ValueError(f"GGUF {name} experts {tuple(t.shape)} are not {experts} experts of {rows} rows")
        gate_fmt, up_fmt, down_fmt = self.fmts
        moe.gguf_experts = nn.ModuleList()
        for e in range(experts):
            expert = nn.Module()
            expert.gate_up, expert.down = nn.Module(), nn.Module()
            if gate_fmt == up_fmt:
                blocks = torch.cat((gate[e], up[e]))  # [2 I_rank, ...]: gate rows | up rows
                GGUFLinearMethod(gate_fmt, self.dtype, self.native).install(expert.gate_up, blocks, moe.hidden_size)
            else:
                GGUFShardedLinearMethod([gate_fmt, up_fmt], self.dtype, self.native).install(
                    expert.gate_up, [gate[e].clone(), up[e].clone()], moe.hidden_size)
            GGUFLinearMethod(down_fmt, self.dtype, self.native).install(expert.down, down[e].clone(), inter)
            moe.gguf_experts.append(expert)
        empty = torch.empty(0, dtype=moe.w13.dtype)
        moe.w13 = nn.Parameter(empty, requires_grad=False)
        moe.w2 = nn.Parameter(empty.clone(), requires_grad=False)
        moe.experts_method = self

    def weights(self, moe: FusedMoE, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts dequantized: ``w13 [E, 2 I_rank, hidden]`` and ``w2 [E, hidden, I_rank]`` in ``dtype``
        (for checks: serving multiplies the blocks)."""
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


def _dequantized(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [N, K] dtype
    method = layer.quant_method
    if isinstance(method, GGUFShardedLinearMethod):
        return torch.cat([m.weight(part, dtype) for m, part in zip(method.parts, layer.gguf_shards, strict=True)])
    return method.weight(layer, dtype)
