"""Rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face's ``rotate_half`` form.

:func:`get_rope` builds the embedding for a model's RoPE parameters (``default``; ``linear``
position interpolation; Llama 3.1's ``llama3`` frequency scaling; Phi-3's ``longrope``),
over the first ``rotary_dim`` dimensions of each head (GPT-NeoX's partial rotary; all of them
by default). The model computes cos and sin once per step (:meth:`RotaryEmbedding.forward`)
and every attention layer rotates its q and k heads in one go with them (:func:`apply_rope`).
Same arithmetic as ``transformers.modeling_rope_utils`` (``_compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``,
``_compute_longrope_parameters``) and ``modeling_llama.apply_rotary_pos_emb``.
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
    """``x * cos + rotate_half(x) * sin`` with the sign of ``rotate_half`` folded into ``sin_signed``;
    with a ``cos`` narrower than ``x`` (partial rotary, ``[T, 1, R]``), over the first R
    dimensions of each head only, the others passed through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin_signed), x[..., rotary_dim:]), dim=-1)
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [T, heads, D], halves exchanged (new tensor)
    return swapped.mul_(sin_signed).add_(x * cos)  # same roundings as HF in every dtype


class RotaryEmbedding(FastModule):
    """RoPE with the inverse frequencies ``base ** (-2i / rotary_dim)`` over the first
    ``rotary_dim`` (default ``head_size``) dimensions of a head.

    ``inv_freq`` ``[rotary_dim // 2]`` float32 is computed on the CPU (as HF does) and kept on
    ``device``; it is not a parameter. ``attention_scaling`` multiplies cos and sin (1 but for
    longrope).
    """

    attention_scaling = 1.0

    def __init__(self, head_size: int, base: float, dtype: torch.dtype, device: torch.device | str,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_size, self.base, self.dtype = head_size, base, dtype
        self.rotary_dim = rotary_dim or head_size
        self.inv_freq = self._compute_inv_freq().to(device)  # [R/2] float32

    def _compute_inv_freq(self) -> torch.Tensor:  # [R/2] float32, on the CPU
        dim = self.rotary_dim
        return 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, R]`` in the model dtype for ``positions [T]``."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, R/2] float32
        cos = torch.cat((freqs, freqs), dim=-1).cos()  # [T, R]
        sin = freqs.sin()
        sin = torch.cat((-sin, sin), dim=-1)  # [T, R], rotate_half's sign folded in
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation (Chen et al. 2023): positions divided by ``factor``, i.e.
    ``inv_freq / factor``."""

    def __init__(self, head_size: int, base: float, dtype: torch.dtype, device: torch.device | str,
                 factor: float, rotary_dim: int | None = None) -> None:
        self.factor = factor
        super().__init__(head_size, base, dtype, device, rotary_dim)

    def _compute_inv_freq(self) -> torch.Tensor:
        return super()._compute_inv_freq() / self.factor


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """Phi-3's LongRoPE (Ding et al. 2024): each frequency divided by its own factor,
    ``long_factor`` for a sequence longer than ``original_max_position`` tokens, else
    ``short_factor``, and cos and sin scaled by ``attention_factor`` (default
    ``sqrt(1 + log(f) / log(original_max_position))`` with ``f = factor``, itself defaulting to
    ``max_position / original_max_position``; 1 when ``f <= 1``).

    As ``transformers.modeling_rope_utils._compute_longrope_parameters`` (``inv_freq = 1 /
    (ext_factors * base ** (2i / R))``, the same roundings) and its ``dynamic_rope_update``,
    which picks the factors per forward pass by the sequence's length (``max(position_ids) + 1``).
    Here each token picks them by its own sequence's length (``seq_lens``, per token), so the
    sequences of one step need not agree.
    """

    def __init__(self, head_size: int, base: float, dtype: torch.dtype, device: torch.device | str,
                 short_factor: list[float], long_factor: list[float], max_position: int,
                 original_max_position: int, rotary_dim: int | None = None, factor: float | None = None,
                 attention_factor: float | None = None) -> None:
        if factor is None:
            factor = max_position / original_max_position
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_position))
        self.attention_scaling = attention_factor
        self.original_max_position = original_max_position
        self.short_factor, self.long_factor = list(short_factor), list(long_factor)
        # one list at every length (a GGUF file's Llama 3.1 rope_freqs): no per-step selection
        self.one_list = self.short_factor == self.long_factor
        super().__init__(head_size, base, dtype, device, rotary_dim)
        self.long_inv_freq = self._scaled_inv_freq(self.long_factor).to(device)  # [R/2] float32

    def _scaled_inv_freq(self, ext_factors: list[float]) -> torch.Tensor:  # [R/2] float32, on the CPU
        dim = self.rotary_dim
        if len(ext_factors) != dim // 2:
            raise ValueError(f"longrope factors: {len(ext_factors)} given, rotary dimension {dim} needs {dim // 2}")
        inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * self.base**inv_freq_shape)

    def _compute_inv_freq(self) -> torch.Tensor:  # the short factors'
        return self._scaled_inv_freq(self.short_factor)

    def forward(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, R]`` for ``positions [T]``; ``seq_lens [T]``: the
        length of each token's sequence, which picks its factors (long above
        ``original_max_position``); default: the largest position + 1, for every token."""
        if self.one_list:
            inv_freq = self.inv_freq.unsqueeze(0)  # [1, R/2]
        else:
            if seq_lens is None:
                longest = int(positions.max()) + 1 if positions.numel() else 0
                long = torch.full(positions.shape, longest > self.original_max_position, device=positions.device)
            else:
                long = seq_lens > self.original_max_position  # [T] bool
            inv_freq = torch.where(long.unsqueeze(1), self.long_inv_freq.unsqueeze(0), self.inv_freq.unsqueeze(0))
        freqs = positions.float().unsqueeze(1) * inv_freq  # [T, R/2] float32
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.attention_scaling  # [T, R]
        sin = freqs.sin()
        sin = torch.cat((-sin, sin), dim=-1) * self.attention_scaling  # [T, R], rotate_half's sign folded in
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
    :func:`services.executor.models.hf_config.rope_parameters`: ``rope_type``, ``rope_theta``,
    ``partial_rotary_factor`` (the share of each head rotated, default 1) and the scaling's
    own keys).

    Raises:
        ValueError: a ``rope_type`` other than ``default``, ``linear``, ``llama3`` and ``longrope``.
    """
    rope_type, base = rope_parameters["rope_type"], rope_parameters["rope_theta"]
    rotary_dim = int(head_size * rope_parameters.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return RotaryEmbedding(head_size, base, dtype, device, rotary_dim)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(head_size, base, dtype, device, rope_parameters["factor"], rotary_dim)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size, base, dtype, device, rope_parameters["factor"], rope_parameters["low_freq_factor"],
            rope_parameters["high_freq_factor"], rope_parameters["original_max_position_embeddings"],
        )
    if rope_type == "longrope":
        return LongRopeRotaryEmbedding(
            head_size, base, dtype, device, rope_parameters["short_factor"], rope_parameters["long_factor"],
            rope_parameters["max_position_embeddings"], rope_parameters["original_max_position_embeddings"],
            rotary_dim, rope_parameters.get("factor"), rope_parameters.get("attention_factor"))
    raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default', 'linear', 'llama3' and 'longrope')")
