"""Beam search results of the offline API, shaped like vLLM's ``vllm.beam_search``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's ``BeamSearchSequence``).

    ``tokens`` holds the prompt's token ids then the generated ones (an EOS that finished the
    beam included); ``logprobs`` one dict per generated token: token id -> ``Logprob`` for the
    chosen token and the continuations its parent beam weighed; ``cum_logprob`` the sum of
    the chosen tokens' log probabilities (natural log); ``text`` the generated text (special
    tokens such as EOS skipped, as ``skip_special_tokens``); ``finish_reason`` ``"stop"`` (EOS)
    or ``"length"``.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The result of one prompt: its ``beam_width`` best beams, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]
