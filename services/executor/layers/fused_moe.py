"""Mixture of experts: top-k routing and the experts' SwiGLU MLPs as one layer.

A sparse MoE block (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen-MoE) sends each
token to ``top_k`` of ``E`` expert MLPs picked by a router and sums their outputs weighted by
the router's probabilities:

    weights, ids = topk_softmax(gate(x), top_k, renormalize)      # [T, K] each
    y[t] = sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]

:class:`FusedMoE` holds every expert's weights stacked, ``w13 [E, 2 I, hidden]`` (gate | up
rows, as ``MergedColumnParallelLinear``) and ``w2 [E, hidden, I]``, and computes the sum with
:func:`fused_moe`: on CUDA the Triton grouped GEMM (``kernels/triton/fused_moe.py``), on CPU
a batched torch path (the token copies sorted by expert, two matmuls per expert over its
tokens, no per-token loop). :func:`fused_moe_reference` is the per-token oracle of the tests.

The experts' weights and their matmuls belong to the layer's ``quant_method`` (a
:class:`FusedMoEMethodBase`, as a linear layer's belong to its linear method): by default
:class:`UnquantizedFusedMoEMethod` (``w13`` / ``w2`` and :func:`fused_moe`); a quantization's
``moe_method`` may keep them in another form and multiply them itself
(``layers/quantization/gguf/moe.py``: GGUF blocks, one GGUF matmul per expert over its tokens).

Tensor parallelism (vLLM's): each rank holds a balanced range of every expert's intermediate
size (column-parallel ``w13``, row-parallel ``w2``), so its output is a partial sum that the
layer all-reduces (``reduce_results``; a caller adding another partial sum first, Qwen2-MoE's
shared expert, reduces once itself).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.utils import FastModule, copy_checked, narrow_checked, set_weight_attrs
from services.executor.parallel.group import current_tp_group
from services.executor.parallel.partition import balanced_range


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice, as Hugging Face's ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``:
    softmax over the experts in float32, the ``top_k`` largest probabilities, divided by their
    sum when ``renormalize`` (Mixtral always; Qwen's ``norm_topk_prob``).

    Args:
        router_logits: ``[T, E]`` in the model's dtype.

    Returns:
        ``topk_weights [T, K]`` float32 and ``topk_ids [T, K]`` int64, largest first.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E] f32
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe_reference(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The oracle: one token and one chosen expert at a time, in float32.

    Shapes: ``hidden_states [T, hidden]``, ``w13 [E, 2 I, hidden]`` (gate | up), ``w2 [E,
    hidden, I]``, ``topk_weights [T, K]``, ``topk_ids [T, K]`` -> ``[T, hidden]`` float32.
    """
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    inter = w2.shape[2]
    for t in range(hidden_states.shape[0]):
        x = hidden_states[t].float()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e].float() @ x  # [2 I]
            act = F.silu(gate_up[:inter]) * gate_up[inter:]  # [I]
            out[t] += topk_weights[t, k].float() * (w2[e].float() @ act)
    return out


def experts_weighted_sum(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         num_experts: int, expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden_states[t])``, batched per
    expert: the ``T * K`` (token, expert) pairs are sorted by expert, and ``expert(e, x [n,
    hidden]) -> [n, hidden]`` runs once over all of expert ``e``'s tokens (the loop is over
    experts, not tokens). Each output times its routing weight is in the promoted dtype of the
    two, summed into the output in expert order (Hugging Face's ``MixtralExperts``).

    Shapes: ``hidden_states [T, hidden]``, ``topk_weights [T, K]``, ``topk_ids [T, K]`` int64;
    returns ``[T, hidden]`` in ``hidden_states``' dtype.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)  # [T K], pair p = t * K + k
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens in order
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // top_k  # [T K] the token of each sorted pair
    weight_of = topk_weights.reshape(-1)[order]  # [T K]
    x = hidden_states[token_of]  # [T K, hidden], sorted by expert
    out = torch.zeros_like(hidden_states)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        y = expert(e, x[rows]) * weight_of[rows, None]  # [n, hidden]
        out.index_add_(0, token_of[rows], y.to(out.dtype))
        start += n
    return out


def fused_moe_cpu(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum, batched per expert (:func:`experts_weighted_sum`). Each
    expert's rounding is Hugging Face's ``MixtralExperts``: matmuls and SiLU * up in the model's
    dtype, the product with the routing weight in the promoted dtype of the two.

    Shapes as :func:`fused_moe_reference`; returns ``[T, hidden]`` in ``hidden_states``' dtype.
    """
    inter = w2.shape[2]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate_up = F.linear(x, w13[e])  # [n, 2 I]
        return F.linear(F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]), w2[e])  # [n, I] in between

    return experts_weighted_sum(hidden_states, topk_weights, topk_ids, w13.shape[0], expert)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t])``: the Triton
    grouped GEMM on CUDA, :func:`fused_moe_cpu` elsewhere. Shapes as :func:`fused_moe_reference`;
    returns ``[T, hidden]`` in ``hidden_states``' dtype."""
    if hidden_states.is_cuda:
        from kernels.triton.fused_moe import fused_moe as triton_fused_moe

        return triton_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)
    return fused_moe_cpu(hidden_states, w13, w2, topk_weights, topk_ids)


class FusedMoEMethodBase(ABC):
    """How a :class:`FusedMoE` keeps its experts' weights and computes their weighted sum (vLLM's
    ``FusedMoEMethodBase``). ``quantized``: a form only this method reads."""

    quantized = False

    @abstractmethod
    def create_weights(self, moe: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register the experts' parameters on ``moe`` (``intermediate_size``: this rank's ``I``)."""

    @abstractmethod
    def apply(self, moe: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum ``[T, hidden]`` of the chosen experts' outputs (shapes as
        :func:`fused_moe`), in ``hidden_states``' dtype."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """``w13 [E, 2 I_rank, hidden]`` (gate rows | up rows) and ``w2 [E, hidden, I_rank]`` in the
    parameters' dtype, loaded through ``moe.weight_loader``; :func:`fused_moe` multiplies."""

    def create_weights(self, moe: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype),
                          requires_grad=False)
        for param in (w13, w2):
            set_weight_attrs(param, {"weight_loader": moe.weight_loader})
        moe.register_parameter("w13", w13)
        moe.register_parameter("w2", w2)

    def apply(self, moe: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(hidden_states, moe.w13, moe.w2, topk_weights, topk_ids)


class FusedMoE(FastModule):
    """``num_experts`` SwiGLU expert MLPs, their weights stacked (this rank's part of each).

    Args:
        num_experts: ``E``.
        hidden_size: the model's.
        intermediate_size: each expert's ``I`` (whole; a rank holds a balanced range of it).
        params_dtype: the parameters' dtype.
        reduce_results: all-reduce the partial outputs of the ranks (False: the caller does).
        quant_method: a :class:`FusedMoEMethodBase` (default :class:`UnquantizedFusedMoEMethod`).

    Parameters (the unquantized method's): ``w13 [E, 2 I_rank, hidden]`` (gate rows | up rows)
    and ``w2 [E, hidden, I_rank]``, loaded from the checkpoint's per-expert tensors with the
    shard ids of :meth:`expert_params_mapping`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, params_dtype: torch.dtype,
                 reduce_results: bool = True, quant_method: FusedMoEMethodBase | None = None) -> None:
        super().__init__()
        self.tp = current_tp_group()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.intermediate_range = balanced_range(intermediate_size, self.tp.world_size, self.tp.rank)
        self.reduce_results = reduce_results
        self.quant_method = quant_method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_range[1], params_dtype)

    @staticmethod
    def expert_params_mapping(num_experts: int, gate: str = "w1", up: str = "w3",
                              down: str = "w2") -> list[tuple[str, str, Any]]:
        """The loader's ``stacked_params_mapping`` entries for the checkpoint's per-expert
        tensors ``experts.<e>.<gate|up|down>.weight`` (Mixtral: ``w1``/``w3``/``w2``; Qwen MoE:
        ``gate_proj``/``up_proj``/``down_proj``); shard id ``(e, "w1" | "w3" | "w2")``."""
        return [(f".experts.{param}", f".experts.{e}.{name}.weight", (e, shard))
                for e in range(num_experts)
                for param, name, shard in (("w13", gate, "w1"), ("w13", up, "w3"), ("w2", down, "w2"))]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, loaded_shard_id: tuple[int, str]) -> None:
        """Expert ``e``'s checkpoint tensor into its slice of ``param``: this rank's rows of
        ``w1`` (gate, ``[I, hidden]``) or ``w3`` (up) into the first or second half of
        ``w13[e]``, this rank's columns of ``w2`` (``[hidden, I]``) into ``w2[e]``.

        Raises:
            ValueError: the checkpoint tensor's shape is not the expert's.
        """
        expert, shard = loaded_shard_id
        start, size = self.intermediate_range
        if shard == "w2":
            copy_checked(param.data[expert], narrow_checked(loaded_weight, 1, start, size, self.intermediate_size))
            return
        rows = param.data[expert].narrow(0, 0 if shard == "w1" else size, size)
        copy_checked(rows, narrow_checked(loaded_weight, 0, start, size, self.intermediate_size))

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:  # [T, hidden], [T, K], [T, K] -> [T, hidden]
        out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp.world_size > 1:
            self.tp.all_reduce(out)
        return out
