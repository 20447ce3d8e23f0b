"""RMSNorm (Zhang & Sennrich 2019) in the three forms the model's numerics use.

- ``"torch"``: ``F.rms_norm``, bitwise equal to Hugging Face's ``LlamaRMSNorm`` in float32.
- ``"layer_norm"`` (bf16 / fp16): :func:`rms_norm` with a LayerNorm weight. ``F.rms_norm`` in
  bf16 is a chain of ~10 small ops (upcast, pow, mean, rsqrt, ...) while ``F.layer_norm`` is
  one fused kernel that accumulates in float32. ``(x, -x)`` has mean 0 and variance
  ``mean(x ** 2)``, so the first half of its LayerNorm, scaled by ``weight``, is the RMSNorm.
  The mean is 0 only up to float32 rounding (~1e-7 relative), far below bf16's resolution:
  outputs equal ``F.rms_norm``'s but for rare 1-ulp differences.
- ``"native"`` (bf16 on CPU): the C kernel with the residual add fused in
  (:func:`kernels.cpu.ops.add_rms_norm`, vLLM's ``fused_add_rms_norm``).

In bf16 / fp16 every form rounds once where HF rounds twice (normalised value, then product):
<= 1 ulp apart. The timings behind the forms: ``benchmarks/RESULTS.md``, "Figures moved out of
the code".
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import ops
from services.executor.layers.utils import FastModule, default_weight_loader, set_weight_attrs

NormForm = Literal["torch", "layer_norm", "native"]


def rms_norm(
    x: torch.Tensor,  # [T, n]
    weight: torch.Tensor,  # [n]
    eps: float,
    ln_weight: torch.Tensor | None,  # [2 n] = (weight, zeros) for the LayerNorm form, or None
) -> torch.Tensor:  # [T, n], contiguous
    """RMSNorm; with ``ln_weight`` computed as a LayerNorm of ``(x, -x)`` (bf16/fp16 only)."""
    if ln_weight is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    n = x.shape[-1]
    out = F.layer_norm(torch.cat((x, x.neg()), dim=-1), ln_weight.shape, ln_weight, None, eps)[:, :n]
    return out if x.shape[0] == 1 else out.contiguous()


def ln_trick_weight(weight: torch.Tensor) -> torch.Tensor:  # [n] -> [2 n]
    """The LayerNorm weight for :func:`rms_norm`: ``weight`` then zeros."""
    return torch.cat((weight.detach(), torch.zeros_like(weight)))


class RMSNorm(FastModule):
    """``x * rsqrt(mean(x ** 2) + eps) * weight`` over the last dimension, optionally after a
    residual add (``forward(x, residual)``), in the form :meth:`set_form` chose."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        self.variance_epsilon = eps
        self.form: NormForm = "torch"
        self.native = False
        self.ln_weight: torch.Tensor | None = None

    def set_form(self, form: NormForm) -> None:
        """Compute as ``form`` from now on (after loading: the LayerNorm weight is derived from
        the loaded weight; call again after changing it)."""
        self.form, self.native = form, form == "native"
        self.ln_weight = ln_trick_weight(self.weight) if form == "layer_norm" else None

    def forward(
        self,
        x: torch.Tensor,  # [T, n], dense
        residual: torch.Tensor | None = None,  # [T, n]: added to x first
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``RMSNorm(x)``; with ``residual``: ``x += residual`` (in place: ``x`` becomes the
        residual stream) and ``(RMSNorm(x), x)``."""
        if self.native:
            out = ops.add_rms_norm(x, self.weight, self.variance_epsilon, residual, validate=False)
            return out if residual is None else (out, x)
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon, self.ln_weight)
        x = x.add_(residual)
        return rms_norm(x, self.weight, self.variance_epsilon, self.ln_weight), x


class LayerNorm(FastModule):
    """``F.layer_norm`` with a weight and (optionally) a bias (GPT-2, GPT-NeoX, OPT, Falcon, Phi);
    ``elementwise_affine=False``: neither (``nn.LayerNorm``'s option; some OPT checkpoints)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype: torch.dtype | None = None,
                 bias: bool = True, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        if bias and elementwise_affine:
            self.bias = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": default_weight_loader})
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, n] -> [T, n]
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class GemmaRMSNorm(FastModule):
    """Gemma's RMSNorm: ``x * rsqrt(mean(x ** 2) + eps) * (1 + weight)``, computed in float32
    and rounded once to the input's dtype, as Hugging Face's ``GemmaRMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, n] -> [T, n] (also [T, heads, D] over D)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)
