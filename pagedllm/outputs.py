"""Offline API results, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log probability of one token at one position (vLLM's ``Logprob``).

    ``logprob`` is the natural log of its probability under the model's raw distribution;
    ``rank`` is the number of tokens at least as likely (1: the most likely);
    ``decoded_token`` is the token's text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence: its text, token ids and why it stopped (``stop``/``length``).

    With ``SamplingParams.logprobs`` N, ``logprobs`` has one dict per token id, as in vLLM:
    token id -> ``Logprob`` for the N most likely tokens and the sampled one (N or N + 1
    entries); else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # with logprobs: the sum of the sampled tokens' (vLLM)


@dataclass
class RequestOutput:
    """The result of one prompt (``outputs``: its ``n`` samples)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs, as vLLM: None for the first prompt token, then one
    # dict per prompt token (the token first, then the most likely ones)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
