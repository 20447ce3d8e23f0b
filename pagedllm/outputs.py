"""Offline API results, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: ``import pagedllm`` stays light for the CLI
    from gateway.generation import RequestState
    from shared.messages import DecodedLogprobs


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


def request_output(request_id: str, state: RequestState, prompt: str | None, prompt_token_ids: list[int],
                   logprobs: bool) -> RequestOutput:
    """The ``RequestOutput`` of one finished engine request, from its folded deltas.

    Args:
        request_id: its id.
        state: its deltas folded.
        prompt: the prompt text to report (None for token ids, as vLLM's ``LLM``).
        prompt_token_ids: the prompt's token ids, from the tokenizer.
        logprobs: whether ``SamplingParams.logprobs`` asked for log probabilities.
    """
    outputs = [
        CompletionOutput(
            index=i,
            text=s.text,
            token_ids=s.token_ids,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=[_logprob_dict(lp) for lp in s.logprobs] if logprobs else None,
            cumulative_logprob=s.cumulative_logprob if logprobs else None,
        )
        for i, s in enumerate(state.samples)
    ]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=outputs,
        finished=all(c.finish_reason is not None for c in outputs),
        num_cached_tokens=state.num_cached_tokens,
        prompt_logprobs=([None, *(_logprob_dict(lp) for lp in state.prompt_logprobs[1:])]
                         if state.prompt_logprobs else None),
    )


def _logprob_dict(lp: DecodedLogprobs) -> dict[int, Logprob]:
    """vLLM's per-token dict: the sampled token first, then the most likely ones."""
    out = {lp.sampled.token_id: Logprob(lp.sampled.logprob, lp.sampled.rank, lp.sampled.token)}
    for t in lp.top:
        out.setdefault(t.token_id, Logprob(t.logprob, t.rank, t.token))
    return out
