"""Activations of the gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.executor.layers.utils import FastModule


class SiluAndMul(FastModule):
    """``silu(gate) * up`` for ``x = gate | up`` (SwiGLU, Shazeer 2020; vLLM's ``SiluAndMul``).

    In the input's dtype: SiLU rounds, then the product rounds, as Hugging Face's
    ``act_fn(gate_proj(x)) * up_proj(x)`` does.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate).mul_(up)
