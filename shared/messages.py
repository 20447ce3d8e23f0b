"""Every message between services: pydantic models, msgpack on the wire (see shared/bus.py).

Flow of one request (subjects in shared/subjects.py):
  gateway/LLM --TokenizeRequest--> tokenizer --SubmitRequest--> scheduler
  scheduler --StepPlan--> executor group --StepResult--> scheduler
  scheduler --DetokStep--> detokenizer shard --GatewayStep--> gateway/LLM
  gateway/detokenizer --AbortRequests--> scheduler
  detokenizer --FailRequests--> scheduler
A prompt's token ids cross each hop once; per step only changes travel (vLLM V1's
``SchedulerOutput`` style: new requests in full, then appended block ids and counts).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_N = 64  # most samples of one prompt (``n``)
MAX_LOGPROBS = 20  # most alternatives per sampled token (``logprobs``; vLLM's default max_logprobs)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the range every integer of a message must fit (msgpack, torch)
#: temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
#: float32-underflowing temperature would give inf / NaN probabilities
GREEDY_TEMPERATURE = 1e-5


class Message(BaseModel):
    """Base of every wire message: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ServiceError(Message):
    """A typed error that travels between services and becomes an OpenAI-shaped error body."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400


# vLLM SamplingParams fields that ours lacks: refused by name rather than as unknown fields
_VLLM_ONLY_SAMPLING_PARAMS = frozenset({
    "best_of", "logits_processors", "bad_words", "allowed_token_ids",
    "truncate_prompt_tokens", "guided_decoding", "structured_outputs", "output_kind", "detokenize",
    "spaces_between_special_tokens", "extra_args",
})


class SamplingParams(Message):
    """How to sample one request (a subset of vLLM's ``SamplingParams``, same names).

    ``temperature`` below 1e-5 (``GREEDY_TEMPERATURE``, as vLLM) means greedy. ``top_k`` 0 or
    -1 disables top-k. A per-request ``seed`` makes the request's samples independent of
    whatever else is in the batch. ``logprobs`` N returns, with each sampled token, its log
    probability, its rank and the N most likely tokens' (0: the sampled token's only; None:
    nothing), over the model's raw distribution (before temperature, top-k and top-p; vLLM's
    default ``raw_logprobs``). ``prompt_logprobs`` N does the same for every prompt token but
    the first (a request asking for them is not served from the prefix cache, as in vLLM).
    Every integer must fit a signed 64-bit integer.

    Logits processing, as vLLM (and OpenAI for ``presence_penalty``, ``frequency_penalty``,
    ``logit_bias``), in this order: ``logit_bias`` adds to a token's logit; ``min_tokens``
    forbids EOS and ``stop_token_ids`` until that many tokens are generated (stop strings are
    not matched before either); ``repetition_penalty`` (CTRL, Keskar et al. 2019) divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output;
    ``frequency_penalty`` subtracts per occurrence in the output, ``presence_penalty`` once per
    token present there. Greedy requests take the argmax after these. Then the temperature;
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely one; then top-k and
    top-p.

    Raises:
        pydantic.ValidationError: a value is out of range, also when assigned later, or a
            vLLM parameter this engine does not implement is given; the message names the
            parameter.
    """

    n: int = 1
    max_tokens: int | None = Field(16, description="Max generated tokens; None = up to max_model_len")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # alternatives per sampled token, 0..MAX_LOGPROBS
    prompt_logprobs: int | None = None  # alternatives per prompt token, 0..MAX_LOGPROBS
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0; 1 = none
    min_p: float = 0.0  # 0..1
    min_tokens: int = 0  # <= max_tokens
    logit_bias: dict[int, float] = Field(default_factory=dict)  # token id -> bias in -100..100

    @model_validator(mode="before")
    @classmethod
    def _vllm_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = sorted(k for k in data if k in _VLLM_ONLY_SAMPLING_PARAMS)
            if given:
                raise ValueError(f"{', '.join(given)}: vLLM sampling parameter(s) that this engine does not "
                                 f"support; supported: {', '.join(cls.model_fields)}")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v: Any) -> Any:
        return [] if v is None else v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens is not None and not (1 <= self.max_tokens <= INT64_MAX):
            raise ValueError(f"max_tokens must be between 1 and {INT64_MAX}, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (-1 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive (at most {INT64_MAX}), got {self.top_k}")
        if self.seed is not None and not (INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be between {INT64_MIN} and {INT64_MAX}, got {self.seed}")
        if bad := [t for t in self.stop_token_ids if not (0 <= t <= INT64_MAX)]:
            raise ValueError(f"stop_token_ids must be token ids >= 0 (at most {INT64_MAX}), got {bad[0]}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0 <= self.min_tokens <= INT64_MAX):
            raise ValueError(f"min_tokens must be between 0 and {INT64_MAX}, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        if bad_ids := [t for t in self.logit_bias if not (0 <= t <= INT64_MAX)]:
            raise ValueError(f"logit_bias: token ids must be between 0 and {INT64_MAX}, got {bad_ids[0]}")
        if bad := [v for v in self.logit_bias.values() if not (-100.0 <= v <= 100.0)]:
            raise ValueError(f"logit_bias: biases must be in [-100, 100], got {bad[0]}")
        return self

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, frequency or presence penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def __setattr__(self, name: str, value: Any) -> None:
        """An assigned field is checked as at construction (pydantic's ``validate_assignment``
        would keep a value that the model check then refuses)."""
        if name in type(self).model_fields:
            value = getattr(type(self).model_validate({**self.__dict__, name: value}), name)
        super().__setattr__(name, value)

    @property
    def greedy(self) -> bool:
        """Whether the request samples greedily (temperature below ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n > 1`` request (vLLM's rule: a seeded
        request's sample i uses ``seed + i``, so the n samples differ yet are reproducible).
        The sum wraps around in 64 bits (two's complement), so a child seed always fits."""
        seed = None
        if self.seed is not None:
            seed = self.seed + index
            if seed > INT64_MAX:
                seed -= 2**64
        return self.model_copy(update={"n": 1, "seed": seed})


# ---------------------------------------------------------------- gateway -> tokenizer


class TokenizeRequest(Message):
    """A completion (``prompt``) or chat (``messages``) request, before tokenization."""

    request_id: str
    gateway_id: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0  # unix seconds
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    # prompt + max_tokens may exceed max_model_len: the request then stops at max_model_len with
    # finish_reason "length" (vLLM's offline LLM); False: refused, as the OpenAI server does
    cap_at_max_model_len: bool = False
    return_prompt: bool = False  # reply with the prompt text (chat: as rendered; token ids: decoded)
    # the scheduler tells the gateway when it accepts the request (RequestDelta.accepted), so
    # that a streaming HTTP response starts only once it cannot be refused any more
    notify_accepted: bool = False


class TokenizeReply(Message):
    """The tokenizer's answer: accepted (and submitted to the scheduler) or an error."""

    request_id: str
    error: ServiceError | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    prompt: str | None = None  # the prompt text, when asked (return_prompt)


# ---------------------------------------------------------------- tokenizer -> scheduler


class SubmitRequest(Message):
    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None
    notify_accepted: bool = False  # send the gateway a RequestDelta(accepted=True) once queued


class AbortRequests(Message):
    """Stop these requests and free their blocks (client gone, or stop string matched)."""

    request_ids: list[str]
    reason: FinishReason = "abort"


class FailRequests(Message):
    """End these requests with ``error`` (a detokenizer lost their state): the scheduler frees
    their blocks and sends the error to the gateway of each one it still holds (the sender does
    not know the gateways)."""

    request_ids: list[str]
    error: ServiceError


# ---------------------------------------------------------------- scheduler <-> executor


class RegisterGroup(Message):
    """An executor group announces itself (request/reply; answered by ``RegisterAck``). The
    scheduler refuses a group whose served ``model`` or ``max_model_len`` differs from its own."""

    group_id: str
    model: str  # the served model name
    num_blocks: int
    block_size: int  # tokens
    max_model_len: int


class RegisterAck(Message):
    group_id: str
    accepted: bool
    error: ServiceError | None = None
    # the first step id planned for this registration: a re-registering executor drops the
    # plans of its previous registration still queued (async scheduling keeps two in flight)
    next_step_id: int = 0


class Heartbeat(Message):
    """An executor group is alive (request/reply: answered by ``HeartbeatAck``).

    ``idle``: no plan is queued or running on the executor; ``last_step_id``: the newest plan
    it has received. An idle executor that never received the scheduler's oldest step in
    flight, in two heartbeats in a row with the step sent before the first, lost its plan; one
    that received it lost its result if the scheduler has not had it for
    ``heartbeat_timeout_s`` (a NATS reconnect drops messages in transit). The scheduler then
    drops the group, which registers again. ``stopping``: the executor is shutting down; its
    requests go elsewhere now.
    """

    group_id: str
    idle: bool = False
    last_step_id: int = 0
    stopping: bool = False


class HeartbeatAck(Message):
    """``known`` False: the scheduler has dropped the group (a step timed out, or the
    scheduler restarted); the executor registers again."""

    group_id: str
    known: bool


class NewRequestData(Message):
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


class CachedRequestData(Message):
    """A running request the executor knows: only the blocks appended this step, and the one
    entry a copy-on-write changed in place (``(position in the block table, new block id)``;
    the K/V copy itself is in ``StepPlan.block_copies``)."""

    request_id: str
    new_block_ids: list[int] = Field(default_factory=list)
    num_computed_tokens: int
    replaced_block: tuple[int, int] | None = None


class StepPlan(Message):
    """One step for one executor group (vLLM V1's ``SchedulerOutput``).

    ``num_scheduled_tokens[request_id]`` tokens of each listed request are computed this
    step, starting at its ``num_computed_tokens``. A request whose computed tokens reach
    its known tokens gets one token sampled.
    """

    step_id: int
    group_id: str
    new_requests: list[NewRequestData] = Field(default_factory=list)
    cached_requests: list[CachedRequestData] = Field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = Field(default_factory=dict)
    finished_request_ids: list[str] = Field(default_factory=list)
    block_copies: list[tuple[int, int]] = Field(default_factory=list)  # (src, dst) block ids
    # n > 1: when a parent's prefill completes this step, the executor forks these children
    # (same tokens and blocks) and samples each one's first token from the parent's logits.
    forks: dict[str, list[str]] = Field(default_factory=dict)


class SampleLogprobs(Message):
    """The log probabilities (natural log, float32 log-softmax of the raw logits) at one
    sampled token, for a request with ``SamplingParams.logprobs``."""

    logprob: float  # of the sampled token
    rank: int  # of the sampled token: the number of tokens at least as likely (1 = the most likely)
    top_token_ids: list[int] = Field(default_factory=list)  # the logprobs most likely, most likely first
    top_logprobs: list[float] = Field(default_factory=list)


class PromptLogprobs(Message):
    """The log probabilities of prompt tokens ``start``, ``start + 1``, ... (each under the
    distribution after the tokens before it; the first prompt token has none)."""

    start: int  # >= 1: the prompt position of the first entry
    token_ids: list[int]  # the prompt tokens they are of
    logprobs: list[SampleLogprobs]


class StepResult(Message):
    """The executor's answer to a ``StepPlan``: one sampled token per request that got one,
    and its log probabilities where the request asked for them."""

    step_id: int
    group_id: str
    sampled_token_ids: dict[str, int] = Field(default_factory=dict)
    logprobs: dict[str, SampleLogprobs] = Field(default_factory=dict)
    # the prompt positions this step computed, of the requests with prompt_logprobs
    prompt_logprobs: dict[str, PromptLogprobs] = Field(default_factory=dict)
    error: ServiceError | None = None


# ---------------------------------------------------------------- scheduler -> detokenizer


class DetokNewRequest(Message):
    request_id: str
    gateway_id: str
    prompt_tail_ids: list[int]  # last few prompt tokens: context for the first output token
    num_prompt_tokens: int
    stop: list[str] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings are matched only in text after this many output tokens
    prompt_logprobs: PromptLogprobs | None = None  # all of them (start 1), if asked
    first_prompt_token_id: int | None = None  # with prompt_logprobs: the prompt token they start after
    parent_request_id: str | None = None  # n > 1: the client's request id of this sample
    index: int = 0  # n > 1: which sample (choice index)


class TokenUpdate(Message):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended the request
    num_cached_tokens: int = 0
    logprobs: list[SampleLogprobs] = Field(default_factory=list)  # one per new token, if asked


class DetokStep(Message):
    """One message per detokenizer shard per scheduler step."""

    new_requests: list[DetokNewRequest] = Field(default_factory=list)
    updates: list[TokenUpdate] = Field(default_factory=list)
    # requests the scheduler ended without a last output (aborted, failed; their clients heard
    # it elsewhere): drop their state, send nothing
    released: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------- detokenizer/scheduler -> gateway


class TokenLogprob(Message):
    """One token and its log probability, decoded (OpenAI's ``token``, ``bytes``, ``logprob``)."""

    token_id: int
    token: str  # the token's own text (special tokens included; "\ufffd" for part of a character)
    bytes: bytes  # its UTF-8 bytes (a byte-level BPE token's own bytes, even a partial character)
    logprob: float | None  # None: the first prompt token (nothing before it)
    rank: int | None


class DecodedLogprobs(Message):
    """The log probabilities at one output token: the sampled token's and the most likely ones."""

    sampled: TokenLogprob
    top: list[TokenLogprob] = Field(default_factory=list)  # most likely first


class RequestDelta(Message):
    """What one request produced in one step, as the client sees it."""

    request_id: str
    index: int = 0  # the choice index, for n > 1
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_cached_tokens: int = 0
    error: ServiceError | None = None
    logprobs: list[DecodedLogprobs] = Field(default_factory=list)  # one per token id, if asked
    # the first delta of a request with prompt_logprobs: one per prompt token (the first's logprob None)
    prompt_logprobs: list[DecodedLogprobs] = Field(default_factory=list)
    accepted: bool = False  # only this: the scheduler queued the request (SubmitRequest.notify_accepted)


class GatewayStep(Message):
    """One message per gateway per step."""

    outputs: list[RequestDelta]


# ---------------------------------------------------------------- statistics


class GroupStats(Message):
    group_id: str
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of them, served from the cache


class SchedulerStats(Message):
    """Published every second and answered on request (``stats_get`` subject)."""

    num_running: int
    num_waiting: int
    groups: list[GroupStats]
    num_preemptions: int = 0
    num_finished: int = 0
    time: float = 0.0


class StatsQuery(Message):
    pass


class RequestsQuery(Message):
    """Which of these client request ids does the scheduler still hold? (request/reply)"""

    request_ids: list[str]


class RequestsKnown(Message):
    """The ids of a ``RequestsQuery`` that the scheduler holds (a request, or samples of it)."""

    known: list[str] = Field(default_factory=list)


class Ping(Message):
    """Liveness probe of a service (request/reply on ``Subjects.ping(service)``)."""


class Pong(Message):
    service: str
