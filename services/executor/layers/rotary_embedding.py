"""Rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face's ``rotate_half`` form.

:func:`get_rope` builds the embedding for a model's RoPE parameters (``default``, or Llama
3.1's ``llama3`` frequency scaling). The model computes cos and sin once per step
(:meth:`RotaryEmbedding.forward`) and every attention layer rotates its q and k heads in one
go with them (:func:`apply_rope`). Same arithmetic as ``transformers.modeling_rope_utils``
(``_compute_default_rope_parameters``, ``_compute_llama3_parameters``) and
``modeling_llama.apply_rotary_pos_emb``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from services.executor.layers.utils import FastModule


def apply_rope(
    x: torch.Tensor,  # [T, heads, D], q and k heads side by side
    cos: torch.Tensor,  # [T, 1, D]
    sin_signed: torch.Tensor,  # [T, 1, D], (-sin, +sin) halves
) -> torch.Tensor:  # [T, heads, D]
    """``x * cos + rotate_half(x) * sin`` with the sign of ``rotate_half`` folded into ``sin_signed``."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [T, heads, D], halves exchanged (new tensor)
    return swapped.mul_(sin_signed).add_(x * cos)  # same roundings as HF in every dtype


class RotaryEmbedding(FastModule):
    """RoPE with the inverse frequencies ``base ** (-2i / head_size)``.

    ``inv_freq`` ``[head_size // 2]`` float32 is computed on the CPU (as HF does) and kept on
    ``device``; it is not a parameter.
    """

    def __init__(self, head_size: int, base: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.head_size, self.base, self.dtype = head_size, base, dtype
        self.inv_freq = self._compute_inv_freq().to(device)  # [D/2] float32

    def _compute_inv_freq(self) -> torch.Tensor:  # [D/2] float32, on the CPU
        dim = self.head_size
        return 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, D]`` in the model dtype for ``positions [T]``."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2] float32
        cos = torch.cat((freqs, freqs), dim=-1).cos()  # [T, D]
        sin = freqs.sin()
        sin = torch.cat((-sin, sin), dim=-1)  # [T, D], rotate_half's sign folded in
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's RoPE scaling: wavelengths above ``original_max_position / low_freq_factor``
    are divided by ``scaling_factor``, those below ``original_max_position / high_freq_factor``
    kept, and the band between interpolated smoothly."""

    def __init__(self, head_size: int, base: float, dtype: torch.dtype, device: torch.device | str,
                 scaling_factor: float, low_freq_factor: float, high_freq_factor: float,
                 original_max_position: int) -> None:
        self.scaling_factor, self.low_freq_factor = scaling_factor, low_freq_factor
        self.high_freq_factor, self.original_max_position = high_freq_factor, original_max_position
        super().__init__(head_size, base, dtype, device)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        factor, low, high = self.scaling_factor, self.low_freq_factor, self.high_freq_factor
        old_len = self.original_max_position
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def get_rope(head_size: int, rope_parameters: dict[str, Any], dtype: torch.dtype,
             device: torch.device | str) -> RotaryEmbedding:
    """The rotary embedding for ``rope_parameters`` (the flat dict of
    :func:`services.executor.models.hf_config.rope_parameters`: ``rope_type``, ``rope_theta``
    and the scaling's own keys).

    Raises:
        ValueError: a ``rope_type`` other than ``default`` and ``llama3``.
    """
    rope_type, base = rope_parameters["rope_type"], rope_parameters["rope_theta"]
    if rope_type == "default":
        return RotaryEmbedding(head_size, base, dtype, device)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size, base, dtype, device, rope_parameters["factor"], rope_parameters["low_freq_factor"],
            rope_parameters["high_freq_factor"], rope_parameters["original_max_position_embeddings"],
        )
    raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")
