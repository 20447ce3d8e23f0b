"""The four messages sent every step, and their parts: msgspec structs (as vLLM's engine core
messages), not pydantic models.

``StepPlan`` (scheduler -> executor group), ``StepResult`` (executor -> scheduler),
``DetokStep`` (scheduler -> detokenizer shard) and ``GatewayStep`` (detokenizer / scheduler ->
gateway) carry one entry per running request every step. msgspec encodes and decodes them
about ten times faster than pydantic's ``model_dump`` / ``model_validate`` (see
``benchmarks/messages.py``) while the decoder still checks every field's type and refuses
unknown fields. Unlike a pydantic model, a struct does not check its values when built in
code: the code that builds one is the check. The records they embed (``SamplingParams``,
``DetokenizeParams``) are msgspec structs too, checked where the request was made and not again
on decode; the one pydantic model, ``ServiceError``, travels as its fields and is validated on
decode (``shared/bus.py``'s hooks).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator

from msgspec import Struct, field

from shared.messages.common import FinishReason, ServiceError
from shared.messages.sampling import DetokenizeParams, SamplingParams


class StepMessage(Struct, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """Base of the per-step structs: defaults stay off the wire, unknown fields are refused,
    and instances are not tracked by the cyclic garbage collector (they hold no cycles)."""


# ---------------------------------------------------------------- scheduler <-> executor


class NewRequestData(StepMessage, kw_only=True):
    """A request the executor has not seen (or must recompute after preemption).

    ``prompt_token_ids`` holds every token known so far (prompt, plus the outputs of a
    preempted request being recomputed); ``num_computed_tokens`` of them are already in
    the KV cache (prefix cache hit).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int = 0  # of prompt_token_ids, how many are generated (resumed)


class CachedRequests(StepMessage, kw_only=True):
    """The running requests the executor knows, as columns (vLLM V1's ``CachedRequestData``):
    request ``req_ids[i]`` has ``new_block_ids[i]`` appended to its block table this step and
    ``num_computed_tokens[i]`` tokens in the cache; ``replaced_blocks[request id]`` is the one
    entry a copy-on-write changed in place (``(position in the block table, new block id)``;
    the K/V copy itself is in ``StepPlan.block_copies``). Columns keep a step's running
    requests to three lists on the wire, whatever their number."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    replaced_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def append(self, request_id: str, new_block_ids: list[int], num_computed_tokens: int,
               replaced_block: tuple[int, int] | None = None) -> None:
        """Add one running request's row."""
        self.req_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        if replaced_block is not None:
            self.replaced_blocks[request_id] = replaced_block

    def rows(self) -> Iterator[tuple[str, list[int], int, tuple[int, int] | None]]:
        """``(request id, new block ids, num_computed_tokens, replaced block or None)`` per row."""
        replaced = self.replaced_blocks
        for rid, blocks, computed in zip(self.req_ids, self.new_block_ids, self.num_computed_tokens, strict=True):
            yield rid, blocks, computed, replaced.get(rid)

    def __len__(self) -> int:
        return len(self.req_ids)


class BeamForks(StepMessage, kw_only=True):
    """Beam search: new beams ``req_ids[i]`` continue beams ``parent_ids[i]`` with
    ``token_ids[i]`` (columns, as ``CachedRequests``).

    The executor starts each as a copy of its parent's state as the parent was planned (its
    first ``num_computed_tokens`` tokens and its block table, shared) plus the token; the same
    plan's ``CachedRequests`` row for it then carries its copy-on-write and new blocks.
    """

    req_ids: list[str] = field(default_factory=list)
    parent_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def append(self, request_id: str, parent_id: str, token_id: int) -> None:
        self.req_ids.append(request_id)
        self.parent_ids.append(parent_id)
        self.token_ids.append(token_id)

    def rows(self) -> Iterator[tuple[str, str, int]]:
        """``(new beam id, parent id, token id)`` per fork."""
        return zip(self.req_ids, self.parent_ids, self.token_ids, strict=True)

    def __len__(self) -> int:
        return len(self.req_ids)


class StepPlan(StepMessage, kw_only=True):
    """One step for one executor group (vLLM V1's ``SchedulerOutput``).

    ``num_scheduled_tokens[request_id]`` tokens of each listed request are computed this
    step, starting at its ``num_computed_tokens``. A request whose computed tokens reach
    its known tokens gets one token sampled.
    """

    step_id: int
    group_id: str
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequests = field(default_factory=CachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids
    # n > 1: when a parent's prefill completes this step, the executor forks these children
    # (same tokens and blocks) and samples each one's first token from the parent's logits.
    forks: dict[str, list[str]] = field(default_factory=dict)
    # beam search: beams to start before anything else of the plan (before finished_request_ids
    # drops their parents)
    beam_forks: BeamForks = field(default_factory=BeamForks)


class SampleLogprobs(StepMessage, kw_only=True):
    """The log probabilities (natural log, float32 log-softmax of the raw logits) at one
    sampled token, for a request with ``SamplingParams.logprobs``."""

    logprob: float  # of the sampled token
    rank: int  # of the sampled token: the number of tokens at least as likely (1 = the most likely)
    top_token_ids: list[int] = field(default_factory=list)  # the logprobs most likely, most likely first
    top_logprobs: list[float] = field(default_factory=list)


class PromptLogprobs(StepMessage, kw_only=True):
    """The log probabilities of prompt tokens ``start``, ``start + 1``, ... (each under the
    distribution after the tokens before it; the first prompt token has none)."""

    start: int  # >= 1: the prompt position of the first entry
    token_ids: list[int]  # the prompt tokens they are of
    logprobs: list[SampleLogprobs]


class StepResult(StepMessage, kw_only=True):
    """The executor's answer to a ``StepPlan``: one sampled token per request that got one,
    and its log probabilities where the request asked for them."""

    step_id: int
    group_id: str
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    # the prompt positions this step computed, of the requests with prompt_logprobs
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    error: ServiceError | None = None


# ---------------------------------------------------------------- scheduler -> detokenizer


class DetokNewRequest(StepMessage, kw_only=True):
    request_id: str
    gateway_id: str
    prompt_tail_ids: list[int]  # last few prompt tokens: context for the first output token
    num_prompt_tokens: int
    # the request's (SamplingParams.detokenize_params): stop strings, special tokens, min_tokens
    params: DetokenizeParams = field(default_factory=DetokenizeParams)
    prompt_logprobs: PromptLogprobs | None = None  # all of them (start 1), if asked
    first_prompt_token_id: int | None = None  # with prompt_logprobs: the prompt token they start after
    parent_request_id: str | None = None  # n > 1: the client's request id of this sample
    index: int = 0  # n > 1: which sample (choice index)
    # output tokens before its first update (a resubmitted request's: its client has their text);
    # prompt_tail_ids then ends with them
    num_output_tokens: int = 0


class TokenUpdate(StepMessage, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended the request
    num_cached_tokens: int = 0
    logprobs: list[SampleLogprobs] = field(default_factory=list)  # one per new token, if asked
    # the request's output tokens after this update: a shard that counts fewer before it missed
    # an update (lost in a NATS outage) and reports the request lost rather than skip text
    num_output_tokens: int = 0


class DetokStep(StepMessage, kw_only=True):
    """One message per detokenizer shard per scheduler step."""

    new_requests: list[DetokNewRequest] = field(default_factory=list)
    updates: list[TokenUpdate] = field(default_factory=list)
    # requests the scheduler ended without a last output (aborted, failed; their clients heard
    # it elsewhere): drop their state, send nothing
    released: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- detokenizer/scheduler -> gateway


class TokenLogprob(StepMessage, kw_only=True):
    """One token and its log probability, decoded (OpenAI's ``token``, ``bytes``, ``logprob``)."""

    token_id: int
    token: str  # the token's own text (special tokens included; "\ufffd" for part of a character)
    bytes: builtins.bytes  # its UTF-8 bytes (a byte-level BPE token's own bytes, even a partial character)
    logprob: float | None  # None: the first prompt token (nothing before it)
    rank: int | None


class DecodedLogprobs(StepMessage, kw_only=True):
    """The log probabilities at one output token: the sampled token's and the most likely ones."""

    sampled: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)  # most likely first


class RequestDelta(StepMessage, kw_only=True):
    """What one request produced in one step, as the client sees it."""

    request_id: str
    index: int = 0  # the choice index, for n > 1
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_cached_tokens: int = 0
    error: ServiceError | None = None
    logprobs: list[DecodedLogprobs] = field(default_factory=list)  # one per token id, if asked
    # the first delta of a request with prompt_logprobs: one per prompt token (the first's logprob None)
    prompt_logprobs: list[DecodedLogprobs] = field(default_factory=list)


class GatewayStep(StepMessage, kw_only=True):
    """One message per gateway per step: what its requests produced, and which requests
    submitted with ``notify_accepted`` the scheduler has queued (they can no longer be refused)."""

    outputs: list[RequestDelta] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
