"""Sampling, structured-output and beam-search parameters, importable as from
``vllm.sampling_params``: ``from pagedllm.sampling_params import SamplingParams,
StructuredOutputsParams, BeamSearchParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.messages import MAX_N, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["BeamSearchParams", "GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]


@dataclass(frozen=True)
class BeamSearchParams:
    """Parameters of ``LLM.beam_search`` (vLLM's ``BeamSearchParams``).

    Args:
        beam_width: beams kept per step and returned, 1..64.
        max_tokens: the most tokens generated per beam, >= 1.
        ignore_eos: an EOS does not finish a beam.
        temperature: accepted as vLLM does; the beams are scored by the raw log probabilities
            (vLLM's default ``raw_logprobs``), so it does not change them.
        length_penalty: a finished beam scores ``cum_logprob / generated_len ** length_penalty``
            (``generated_len`` counts the EOS; see ``services/scheduler/beam.py``).
        include_stop_str_in_output: keep an EOS's text in ``text`` (with special tokens shown).

    Raises:
        ValueError: a value out of range; the message names the parameter.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_N:
            raise ValueError(f"beam_width must be an integer between 1 and {MAX_N}, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    def sampling_params(self) -> SamplingParams:
        """The engine request's parameters: ``n`` beams, ``use_beam_search``."""
        return SamplingParams(n=self.beam_width, use_beam_search=True, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=self.temperature,
                              length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output)
