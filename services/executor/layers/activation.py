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


class GeluAndMul(FastModule):
    """``gelu(gate) * up`` for ``x = gate | up`` (GeGLU, Shazeer 2020; Gemma). ``approximate``:
    "none" (exact erf) or "tanh" (``gelu_pytorch_tanh``, Gemma's ``hidden_activation``)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


class Activation(FastModule):
    """An elementwise activation by its Hugging Face name (``ACT2FN``'s): ``gelu`` (exact),
    ``gelu_new`` / ``gelu_pytorch_tanh`` / ``gelu_fast`` (tanh approximation), ``relu``,
    ``silu``.

    Raises:
        ValueError: another name.
    """

    _TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in ("gelu", "relu", "silu", *self._TANH):
            raise ValueError(f"activation {name!r} is not supported (gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, "
                             "relu, silu)")
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "relu":
            return F.relu(x)
        if self.name == "silu":
            return F.silu(x)
        return F.gelu(x, approximate="tanh" if self.name in self._TANH else "none")


def gated_activation(name: str) -> FastModule:
    """The gated MLP activation for a ``hidden_act`` / ``hidden_activation`` name: SiLU or GELU.

    Raises:
        ValueError: another name.
    """
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("none" if name == "gelu" else "tanh")
    raise ValueError(f"gated activation {name!r} is not supported (silu, gelu, gelu_pytorch_tanh)")
